"""Tests of the pure-jnp ragged paged attention reference and of write_kv_cache.

The reference is checked three ways: a tiny case worked out by hand, a sweep of named
scenarios against a deliberately naive float64 numpy oracle (one query token at a
time, keys gathered position by position, full softmax), and a check that one compiled
program serves any real token/sequence counts.
"""

from __future__ import annotations

import logging
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernels_pallas.oracle import make_batch
from kernels_pallas.ragged_paged_attention import (
    ragged_paged_attention_reference,
    write_kv_cache,
)

# float32 against a float64 oracle: inputs are O(1), contexts <= 64 keys, so the float32
# softmax (exp, a sum of <= 64 terms, one rescale per KV chunk) and the two dot products
# of length <= 64 each carry a few ulps (~1e-7) of rounding, i.e. errors of order 1e-6.
# 1e-5 relative (and 1e-5 absolute, for outputs near 0) is tight around that.
RTOL = ATOL = 1e-5

# Knob sets: the defaults (at these shapes up to 2 query tiles of 32 and 2 KV chunks of
# 32 keys); tiny tiles so every loop runs many times (query tiles split sequences, chunks split contexts, decode
# groups of 2, sequences of up to 3 queries on the batched path); and the batched decode
# path turned off, so every sequence goes through the tiled path.
KNOBS = {
    "default": {},
    "small_tiles": dict(query_tile=4, kv_pages_per_chunk=2, decode_query_len=3, decode_seq_tile=2),
    "no_decode_path": dict(decode_query_len=0, query_tile=8, kv_pages_per_chunk=3),
}


def naive_attention(q, kv_cache, block_tables, context_lens, query_start_loc, num_seqs, *,
                    sm_scale, sliding_window=None, soft_cap=None, abs_values=False):
    """Float64 oracle: each query token gathers its keys one position at a time. `abs_values`:
    the softmax weights times |V| instead (how far rounding the weights can move each output)."""
    q = np.asarray(q, np.float64)
    cache = np.asarray(kv_cache, np.float64)
    num_heads, num_kv_heads, block_size = q.shape[1], cache.shape[1], cache.shape[3]
    group = num_heads // num_kv_heads
    out = np.zeros_like(q)
    for s in range(int(num_seqs)):
        start, end = int(query_start_loc[s]), int(query_start_loc[s + 1])
        ctx = int(context_lens[s])
        for j in range(end - start):
            pos = ctx - (end - start) + j
            lo = 0 if sliding_window is None else max(0, pos - sliding_window + 1)
            slots = [(block_tables[s][p // block_size], p % block_size) for p in range(lo, pos + 1)]
            keys = np.array([cache[0, :, block, offset] for block, offset in slots])  # [n, kv_heads, D]
            vals = np.array([cache[1, :, block, offset] for block, offset in slots])
            if abs_values:
                vals = np.abs(vals)
            for h in range(num_heads):
                scores = sm_scale * keys[:, h // group] @ q[start + j, h]
                if soft_cap is not None:
                    scores = soft_cap * np.tanh(scores / soft_cap)
                weights = np.exp(scores - scores.max())
                out[start + j, h] = weights @ vals[:, h // group] / weights.sum()
    return out


DECODES = [(1, 1), (5, 1), (17, 1), (40, 1)]
# Scenarios on the base shapes (2 kv heads, group 2, block_size 4, 64 token rows, 8
# sequence slots): all pad T beyond the real tokens, most pad S beyond the real sequences.
SCENARIOS = {
    "decode_only": [(1, 1), (2, 1), (5, 1), (16, 1), (17, 1), (31, 1), (40, 1), (64, 1)],
    "prefill_only": [(20, 20), (7, 7), (1, 1), (33, 33)],
    # decodes, a first prefill chunk, a chunk continuing earlier context, a 2-token step
    "mixed": [(17, 1), (12, 12), (48, 16), (9, 1), (30, 2), (64, 1)],
    "prefix_hit": [(48, 5), (33, 1), (64, 17), (40, 3), (9, 8)],
    "page_boundary": [(8, 1), (7, 1), (9, 1), (16, 16), (15, 15), (17, 9), (32, 4), (4, 4)],
    "padding": [(10, 1), (20, 3)],
}
# Other shapes and static settings each compile once more, so they run with fewer knob
# sets: `small_tiles` exercises every loop and both paths.
EXTRA = {
    "gqa_group1": dict(seqs=DECODES + [(30, 14)], group=1),
    "gqa_group3": dict(seqs=DECODES + [(30, 14)], group=3),  # group 3, as the default model's 9 / 3
    "sliding_window": dict(seqs=[(17, 1), (12, 12), (48, 16), (30, 2), (64, 1), (5, 3)], sliding_window=5),
    # q scaled up so logits reach ~10, where a cap of 2.5 bends them hard (tanh saturates)
    "soft_cap": dict(seqs=[(17, 1), (12, 12), (48, 16), (30, 2), (64, 1)], soft_cap=2.5, q_scale=4.0),
}
SM_SCALE = 8 ** -0.5  # 1 / sqrt(head_dim) of the base shapes; one static value, one compile


def oracle_cases(knob_sets: dict[str, dict]) -> list:
    """Every scenario with every knob set; the extra shapes with "small_tiles", the masks also with "default"."""
    cases = [pytest.param(dict(seqs=seqs), knobs, id=f"{name}-{kname}")
             for name, seqs in SCENARIOS.items() for kname, knobs in knob_sets.items()]
    cases += [pytest.param(case, knob_sets["small_tiles"], id=f"{name}-small_tiles") for name, case in EXTRA.items()]
    cases += [pytest.param(EXTRA[name], knob_sets["default"], id=f"{name}-default")
              for name in ("sliding_window", "soft_cap")]
    return cases


def assert_matches_oracle(case, attend):
    """`attend(args, **masking)` on the case's batch equals the float64 oracle; padding rows are 0."""
    case = dict(case)
    masking = dict(sliding_window=case.pop("sliding_window", None), soft_cap=case.pop("soft_cap", None))
    q_scale = case.pop("q_scale", 1.0)
    args = make_batch(case.pop("seqs"), **case)
    args = (args[0] * np.float32(q_scale), *args[1:])
    got = attend(args, **masking)
    want = naive_attention(*args, sm_scale=SM_SCALE, **masking)
    if masking["soft_cap"] is not None:  # the cap must matter at these logits, or the case tests nothing
        uncapped = naive_attention(*args, sm_scale=SM_SCALE, sliding_window=masking["sliding_window"])
        assert np.abs(uncapped - want).max() > 0.1
    assert got.dtype == jnp.float32 and got.shape == args[0].shape
    np.testing.assert_allclose(np.asarray(got), want, rtol=RTOL, atol=ATOL)
    owned = int(args[4][int(args[5])])
    assert owned < args[0].shape[0], "every scenario has padding rows"
    assert not np.asarray(got[owned:]).any(), "rows of padding tokens must be 0"


@pytest.mark.parametrize("case, knobs", oracle_cases(KNOBS))
def test_matches_naive_oracle(case, knobs):
    assert_matches_oracle(case, lambda args, **masking: ragged_paged_attention_reference(
        *map(jnp.asarray, args), sm_scale=SM_SCALE, **masking, **knobs))


LN2, LN3 = math.log(2), math.log(3)


@pytest.mark.parametrize("sliding_window, knobs", [
    pytest.param(None, KNOBS["default"], id="default"),
    pytest.param(2, KNOBS["small_tiles"], id="sliding_window_2-small_tiles"),
])
def test_tiny_case_by_hand(sliding_window, knobs):
    """1 kv head, head_dim 2, block_size 2; numbers worked out on paper.

    sm_scale 0.5. Sequence 0 is a 3-token prefill, keys at blocks [2, 4]; every query is
    (2 ln2, 0), so the scores are 0.5 * 2 ln2 * k[0]:
        k = (1,0) (0,1) (1,1)  -> scores ln2, 0, ln2 -> weights 2, 1, 2
        v = (1,0) (0,1) (2,2)
      row 0 sees key 0:        v0                          = (1, 0)
      row 1 sees keys 0..1:    (2 v0 + v1) / 3             = (2/3, 1/3)
      row 2 sees keys 0..2:    (2 v0 + v1 + 2 v2) / 5      = (6/5, 1)
      row 2, window 2 (keys 1..2): (v1 + 2 v2) / 3         = (4/3, 5/3)
    Sequence 1 decodes position 2 of 3, keys at blocks [3, 1]; query (0, 2), so the
    scores are k[1]:
        k = (0,0) (5,0) (0,ln3) -> scores 0, 0, ln3 -> weights 1, 1, 3
        v = (1,1) (2,4) (0,2)
      row 3: (v0 + v1 + 3 v2) / 5 = (3/5, 11/5);  window 2 (keys 1..2): (v1 + 3 v2) / 4 = (1/2, 5/2)
    Rows 4-5 and sequence slot 2 are padding: output 0.
    """
    kv_cache = np.full((2, 1, 5, 2, 2), 7.0, np.float32)  # garbage everywhere else
    keys0, vals0 = [(1, 0), (0, 1), (1, 1)], [(1, 0), (0, 1), (2, 2)]
    keys1, vals1 = [(0, 0), (5, 0), (0, LN3)], [(1, 1), (2, 4), (0, 2)]
    for (block, offset), k, v in zip([(2, 0), (2, 1), (4, 0)], keys0, vals0):
        kv_cache[:, 0, block, offset] = k, v
    for (block, offset), k, v in zip([(3, 0), (3, 1), (1, 0)], keys1, vals1):
        kv_cache[:, 0, block, offset] = k, v
    q = np.full((6, 1, 2), 9.0, np.float32)  # padding rows hold garbage too
    q[0:3, 0] = (2 * LN2, 0)
    q[3, 0] = (0, 2)
    block_tables = np.array([[2, 4], [3, 1], [0, 0]], np.int32)
    context_lens = np.array([3, 3, 0], np.int32)
    query_start_loc = np.array([0, 3, 4, 4], np.int32)

    got = ragged_paged_attention_reference(
        *map(jnp.asarray, (q, kv_cache, block_tables, context_lens, query_start_loc)), jnp.int32(2),
        sm_scale=0.5, sliding_window=sliding_window, **knobs)

    row2, row3 = ((6 / 5, 1), (3 / 5, 11 / 5)) if sliding_window is None else ((4 / 3, 5 / 3), (1 / 2, 5 / 2))
    want = np.array([(1, 0), (2 / 3, 1 / 3), row2, row3, (0, 0), (0, 0)], np.float32)[:, None, :]
    np.testing.assert_allclose(np.asarray(got), want, rtol=RTOL, atol=ATOL)


def test_one_compile_serves_any_real_counts(caplog):
    """Same shapes, different real token/sequence counts: no new compile, correct every time."""
    batches = [make_batch(seqs, seed=seed) for seed, seqs in
               enumerate([[(9, 1)], [(40, 16), (3, 1), (12, 12)], [(28, 1)] * 8, []])]
    # The first call may compile (unless an earlier test already did); later ones must not.
    ragged_paged_attention_reference(*map(jnp.asarray, batches[0]), sm_scale=SM_SCALE)
    with jax.log_compiles(True), caplog.at_level(logging.DEBUG, logger="jax"):
        outputs = [ragged_paged_attention_reference(*map(jnp.asarray, args), sm_scale=SM_SCALE)
                   for args in batches]
        compiles = [r.getMessage() for r in caplog.records if "ragged_paged_attention" in r.getMessage()]

        def ragged_paged_attention_probe(x):  # a fresh function: proves compiles do get logged
            return x + 1

        jax.jit(ragged_paged_attention_probe)(jnp.zeros(3))
        probe = [r.getMessage() for r in caplog.records if "ragged_paged_attention_probe" in r.getMessage()]
    assert probe, "compile logging captured nothing; the check below would pass vacuously"
    assert not compiles, compiles
    for args, got in zip(batches, outputs):
        want = naive_attention(*args, sm_scale=SM_SCALE)
        np.testing.assert_allclose(np.asarray(got), want, rtol=RTOL, atol=ATOL)


def test_bfloat16_output_dtype_and_accuracy():
    """bf16 q/cache: softmax still float32, output in q's dtype, within bf16 rounding of the oracle."""
    args = make_batch([(17, 1), (30, 14)])
    q, kv_cache = jnp.asarray(args[0], jnp.bfloat16), jnp.asarray(args[1], jnp.bfloat16)
    got = ragged_paged_attention_reference(q, kv_cache, *map(jnp.asarray, args[2:]), sm_scale=SM_SCALE)
    assert got.dtype == jnp.bfloat16
    # Oracle on the same bf16-rounded inputs: the only extra error is the final bf16
    # rounding of the output (relative 2^-8), so 1e-2 is about 2.5 bf16 ulps.
    rounded = np.asarray(q, np.float32), np.asarray(kv_cache, np.float32)
    want = naive_attention(*rounded, *args[2:], sm_scale=SM_SCALE)
    np.testing.assert_allclose(np.asarray(got, np.float32), want, rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("bad, message", [
    (lambda a: {**a, "q": a["q"][..., :4]}, "head_dim"),
    (lambda a: {**a, "q": a["q"][:, :3]}, "num_q_heads"),
    (lambda a: {**a, "kv_cache": a["kv_cache"][0]}, "kv_cache"),
    (lambda a: {**a, "block_tables": a["block_tables"].astype(jnp.float32)}, "block_tables"),
    (lambda a: {**a, "context_lens": a["context_lens"][:-1]}, "context_lens"),
    (lambda a: {**a, "query_start_loc": a["query_start_loc"][:-1]}, "query_start_loc"),
    (lambda a: {**a, "num_seqs": a["num_seqs"][None]}, "num_seqs"),
])
def test_bad_inputs_raise_value_error_naming_them(bad, message):
    names = ["q", "kv_cache", "block_tables", "context_lens", "query_start_loc", "num_seqs"]
    args = bad(dict(zip(names, map(jnp.asarray, make_batch([(5, 1)])))))
    with pytest.raises(ValueError, match=message):
        ragged_paged_attention_reference(**args, sm_scale=1.0)


@pytest.mark.parametrize("knob", [{"sliding_window": 0}, {"soft_cap": 0.0}, {"soft_cap": -1.0}])
def test_bad_knobs_raise_value_error_naming_them(knob):
    args = map(jnp.asarray, make_batch([(5, 1)]))
    with pytest.raises(ValueError, match=next(iter(knob))):
        ragged_paged_attention_reference(*args, sm_scale=1.0, **knob)


def test_write_kv_cache_puts_values_at_their_slots():
    rng = np.random.default_rng(1)
    num_kv_heads, num_blocks, block_size, head_dim = 2, 10, 4, 3
    cache = rng.standard_normal((2, num_kv_heads, num_blocks, block_size, head_dim), np.float32)
    # 9 real tokens in scattered, non-contiguous slots of blocks 7, 2, 5, then 3 padding
    # tokens that all go to the null block 0.
    real_slots = [block * 4 + offset for block, offset in
                  [(7, 0), (7, 1), (7, 2), (2, 3), (5, 0), (5, 1), (5, 2), (5, 3), (2, 0)]]
    slot_mapping = np.array(real_slots + [0, 1, 0], np.int32)
    k = rng.standard_normal((12, num_kv_heads, head_dim), np.float32)
    v = rng.standard_normal((12, num_kv_heads, head_dim), np.float32)

    write = jax.jit(write_kv_cache, donate_argnums=0)
    got = np.asarray(write(jnp.asarray(cache), jnp.asarray(k), jnp.asarray(v), jnp.asarray(slot_mapping)))

    want = cache.copy()
    for t, slot in enumerate(real_slots):
        want[0, :, slot // block_size, slot % block_size] = k[t]
        want[1, :, slot // block_size, slot % block_size] = v[t]
    np.testing.assert_array_equal(got[:, :, 1:], want[:, :, 1:])  # block 0 holds garbage


def test_write_then_attend_round_trip():
    """Writing a prefill's K/V with write_kv_cache then attending equals the oracle on that cache."""
    args = list(make_batch([(12, 12), (20, 4)]))
    q, cache, block_tables, context_lens, query_start_loc, num_seqs = args
    rng = np.random.default_rng(2)
    k = rng.standard_normal((64, 2, 8), np.float32)
    v = rng.standard_normal((64, 2, 8), np.float32)
    slots = np.zeros(64, np.int32)  # padding tokens -> null block 0
    for s in range(2):
        start, end, ctx = query_start_loc[s], query_start_loc[s + 1], context_lens[s]
        pos = np.arange(ctx - (end - start), ctx)
        slots[start:end] = block_tables[s][pos // 4] * 4 + pos % 4
    cache = jax.jit(write_kv_cache)(jnp.asarray(cache), jnp.asarray(k), jnp.asarray(v), jnp.asarray(slots))
    got = ragged_paged_attention_reference(jnp.asarray(q), cache, *map(jnp.asarray, args[2:]), sm_scale=SM_SCALE)
    want = naive_attention(q, np.asarray(cache), *args[2:], sm_scale=SM_SCALE)
    np.testing.assert_allclose(np.asarray(got), want, rtol=RTOL, atol=ATOL)
    # Sequence 1's new tokens (rows 12..15) are positions 16..19: all of its fifth block.
    written = np.asarray(cache)[:, :, block_tables[1][4]]  # [2, kv_heads, block_size, D]
    np.testing.assert_array_equal(written, np.stack([k[12:16], v[12:16]]).transpose(0, 2, 1, 3))
