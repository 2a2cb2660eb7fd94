"""Ragged paged attention for CPUs: pages read in place, this step's own keys without pages.

What flows through: the reference's inputs plus this step's keys and values `k`, `v`
[T, num_kv_heads, head_dim] (the rows `write_kv_cache` has just stored). Runs inside
the caller's jitted step. Each sequence takes one of two routes:
- runs of at most `decode_query_len` queries (by default every run, when the native kernel
  builds here): the native kernel (`native_cpu`, an XLA FFI call) reads their whole context
  from the pool where it lies (this step's keys included), walking groups of short runs page
  by page so shared prefix pages are read once, and longer runs in blocks of 16 queries; pages
  many rows share (a prefix, a query block's earlier pages) are folded 16 rows at a time;
- longer runs (prefills, chunks, prefix-hit suffixes) attend two disjoint key sets, merged by
  log-sum-exp: keys computed in this step, read straight from `k`/`v` in dense tiles of
  `q_block` rows (a segment mask keeps sequences apart; no page gather), and keys cached
  before this step through the reference's paged tiles (`paged_context_attention`),
  which skips sequences with no earlier context.
When the native kernel is unavailable (no C++ compiler) short runs take the jnp routes too.
The result equals the reference's up to float rounding (tests/kernels/
test_ragged_paged_attention_cpu.py checks both against a float64 oracle).

Why: the reference gathers (copies) every key page before use (~5 GB/s on the CPU) and pays a
fixed cost per loop trip; decodes only read, and most prefill keys are in this step anyway.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax

from kernels_pallas import native_cpu
from kernels_pallas.ragged_paged_attention import (_F32, _cdiv, _finish, _scaled_queries, _softmax_update,
                                                   check_ragged_paged_attention_inputs, paged_context_attention)


def ragged_paged_attention_cpu(
    q,                # [T, num_q_heads, head_dim]
    k,                # [T, num_kv_heads, head_dim]: this step's keys (already in kv_cache too)
    v,                # [T, num_kv_heads, head_dim]: this step's values
    kv_cache,         # [2, num_kv_heads, num_blocks, block_size, head_dim]
    block_tables,     # [S, max_blocks_per_seq] int32
    context_lens,     # [S] int32: cached tokens after this step
    query_start_loc,  # [S + 1] int32
    num_seqs,         # [] int32
    *,
    sm_scale: float,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
    q_block: int = 128,
    query_tile: int = 64,
    kv_pages_per_chunk: int = 8,
    decode_query_len: int | None = None,
    decode_seq_tile: int = 8,
    native: bool | None = None,
    q_rope=None,
) -> jax.Array:
    """Same contract as `ragged_paged_attention_reference`, plus this step's `k`, `v`.

    `q_rope` (q before the rotate-half RoPE, cos, sin; `q` is what they give, as XLA computes it):
    where the native kernel takes every run and `native_cpu.rope_applies` (a bf16 q), the kernel
    rotates q itself with XLA's roundings (the same bits; XLA then drops its own pass over q).

    Static knobs: `q_block` rows (and keys) per in-step tile; `query_tile` 64 (the
    reference's 32 split a 33-64-token prefix-hit suffix in two: 27 -> 22 ms per layer for 8
    suffixes of 48 after 1,024 cached tokens); `native`: sequences with at
    most `decode_query_len` queries read their earlier context through the native kernel
    (`native_cpu`; None: when it builds here, False: pure jnp); the others are the paged
    part's, as in the reference. `decode_query_len` None: every run when native (1 with
    JAXSERVE_NATIVE_PREFILL=0, the A/B switch), else the reference's 1.
    """
    if native is None:
        native = native_cpu.available()
    elif native and not native_cpu.available():
        raise ValueError("native=True, but the native CPU attention kernel is unavailable (see the log)")
    if decode_query_len is None:
        decode_query_len = q.shape[0] if native and native_cpu.prefill_enabled() else 1
    amx = bool(native) and native_cpu.attention_amx()
    power_of_two = math.frexp(sm_scale)[0] == 0.5   # a bf16 q times it is still a bf16 exactly
    # On the tiles a bf16 q may come unscaled and the kernel scale the scores (a scale that is no
    # power of two: head dim 128's 1/sqrt(128)), when the native kernel takes every run.
    scale_scores = (amx and q.dtype == jnp.bfloat16 and kv_cache.dtype == jnp.uint16 and not power_of_two
                    and decode_query_len >= q.shape[0]
                    and native_cpu.amx_attention_applies(q.shape[2], kv_cache.shape[3], soft_cap))
    if not (q_rope is not None and native and decode_query_len >= q.shape[0]
            and native_cpu.rope_applies(q_rope[0], kv_cache)):
        q_rope = None
    return _ragged_paged_attention_cpu(q, k, v, kv_cache, block_tables, context_lens, query_start_loc, num_seqs,
                                       q_rope, sm_scale=sm_scale, sliding_window=sliding_window, soft_cap=soft_cap,
                                       q_block=q_block, query_tile=query_tile,
                                       kv_pages_per_chunk=kv_pages_per_chunk,
                                       decode_query_len=decode_query_len, decode_seq_tile=decode_seq_tile,
                                       native=bool(native),
                                       q_bf16=q.dtype == jnp.bfloat16 and (power_of_two or scale_scores),
                                       min_lane_fill=native_cpu.lane_fill_setting(), amx=amx,
                                       scale_scores=bool(scale_scores))


@functools.partial(jax.jit, static_argnames=(
    "sm_scale", "sliding_window", "soft_cap", "q_block", "query_tile", "kv_pages_per_chunk", "decode_query_len",
    "decode_seq_tile", "native", "q_bf16", "min_lane_fill", "amx", "scale_scores"))
def _ragged_paged_attention_cpu(q, k, v, kv_cache, block_tables, context_lens, query_start_loc, num_seqs, q_rope, *,
                                sm_scale, sliding_window, soft_cap, q_block, query_tile, kv_pages_per_chunk,
                                decode_query_len, decode_seq_tile, native, q_bf16, min_lane_fill, amx,
                                scale_scores):
    check_ragged_paged_attention_inputs(
        q, kv_cache, block_tables, context_lens, query_start_loc, num_seqs,
        sm_scale=sm_scale, sliding_window=sliding_window, soft_cap=soft_cap)
    num_tokens, num_q_heads, head_dim = q.shape
    num_kv_heads = kv_cache.shape[1]
    for name, x in (("k", k), ("v", v)):
        if x.shape != (num_tokens, num_kv_heads, head_dim):
            raise ValueError(f"{name} shape {x.shape} != [{num_tokens}, {num_kv_heads}, {head_dim}] (from q, kv_cache)")
    if not isinstance(q_block, int) or q_block < 1:
        raise ValueError(f"q_block must be an int >= 1, got {q_block!r}")
    block = min(q_block, num_tokens)
    padded = -(-num_tokens // block) * block  # static: T in whole blocks
    qs = _scaled_queries(q, num_kv_heads, sm_scale, pad=max(query_tile, padded - num_tokens))

    num_seq_slots = block_tables.shape[0]
    real = jnp.arange(num_seq_slots) < num_seqs
    context_lens = jnp.where(real, context_lens, 0)
    q_lens = jnp.where(real, query_start_loc[1:] - query_start_loc[:-1], 0)

    paged = dict(bits_dtype=q.dtype, sliding_window=sliding_window, soft_cap=soft_cap, query_tile=query_tile,
                 kv_pages_per_chunk=kv_pages_per_chunk, decode_seq_tile=decode_seq_tile)
    earlier = context_lens - q_lens
    in_step = q_lens > 0
    parts = []
    if native and decode_query_len >= num_tokens:   # static: the native kernel takes every run
        if q_rope is not None:   # q rotated and scaled in the kernel, as XLA's fusion computes qs
            rows, rope, q_scale = q_rope[0], q_rope[1:], 1.0 if scale_scores else sm_scale
        else:
            rows = (q.astype(_F32) if scale_scores else qs[:num_tokens]).reshape(num_tokens, num_q_heads, head_dim)
            rope, q_scale = None, 1.0
        out, _ = native_cpu.paged_context_native(
            rows, kv_cache, block_tables, context_lens, query_start_loc, num_seqs, bits_dtype=q.dtype,
            max_q_len=num_tokens, sliding_window=sliding_window, soft_cap=soft_cap, q_bf16=q_bf16,
            min_lane_fill=min_lane_fill, amx=amx, score_scale=sm_scale if scale_scores else 1.0,
            out_dtype=jnp.bfloat16 if q.dtype == jnp.bfloat16 else _F32,   # bf16: rounded in the kernel
            rope=rope, q_scale=q_scale)
        return out.astype(q.dtype)
    if native and decode_query_len > 0:
        # Short runs (decodes) read their whole context natively (the pool holds this step's
        # keys too); the in-step tiles and the jnp paged tiles take only the longer runs.
        short = q_lens <= decode_query_len
        out, lse = native_cpu.paged_context_native(
            qs[:num_tokens].reshape(num_tokens, num_q_heads, head_dim), kv_cache, block_tables, context_lens,
            query_start_loc, num_seqs, bits_dtype=q.dtype, max_q_len=decode_query_len,
            sliding_window=sliding_window, soft_cap=soft_cap, q_bf16=q_bf16,
            min_lane_fill=min_lane_fill, amx=amx)
        rows = ((0, padded - num_tokens), (0, 0), (0, 0))
        parts.append((jnp.pad(out.reshape(num_tokens, *qs.shape[1:]), rows + ((0, 0),)),
                      jnp.pad(lse.reshape(num_tokens, *qs.shape[1:-1]), rows, constant_values=-jnp.inf)))
        earlier = jnp.where(short, 0, earlier)
        in_step = in_step & ~short
        paged["decode_query_len"] = 0
    else:
        paged["decode_query_len"] = decode_query_len

    def with_longer_runs(parts):
        parts = parts + [_in_step_attention(qs[:padded], k, v, query_start_loc, num_seqs, in_step, block=block,
                                            sliding_window=sliding_window, soft_cap=soft_cap)]
        rest = paged_context_attention(qs, kv_cache, block_tables, context_lens, query_start_loc[:-1], q_lens,
                                       earlier, **paged)
        parts.append(tuple(x[:padded] for x in rest))
        return functools.reduce(_merge, parts)[0]

    if parts:   # the native kernel took the short runs: the jnp parts only run when a longer one exists
        out = lax.cond(jnp.any(in_step), with_longer_runs, lambda parts: parts[0][0], parts)
    else:
        out = with_longer_runs(parts)
    return out[:num_tokens].reshape(num_tokens, num_q_heads, head_dim).astype(q.dtype)


def _in_step_attention(qs, k, v, query_start_loc, num_seqs, active, *, block, sliding_window, soft_cap):
    """Each query over the keys of its own sequence computed in this step (causal), from `k`/`v` directly.

    `qs` [P, KVH, group, D] scaled queries (P = T padded to whole blocks); only sequences
    with `active` [S] take part. Returns (out, lse) like `paged_context_attention`, over P rows.
    """
    padded, num_kv_heads, group, head_dim = qs.shape
    num_tokens = k.shape[0]
    pad = ((0, padded - num_tokens), (0, 0), (0, 0))
    kf = jnp.pad(k.astype(_F32), pad).transpose(1, 0, 2)                   # [KVH, P, D]
    vf = jnp.pad(v.astype(_F32), pad).transpose(1, 0, 2)                   # [KVH, P, D]
    token = jnp.arange(padded, dtype=jnp.int32)
    num_real = query_start_loc[num_seqs]
    # seg[t]: the sequence row t belongs to; -1 for padding rows and inactive sequences, which no query sees.
    owner = jnp.clip(jnp.searchsorted(query_start_loc[1:], token, side="right"), 0, active.shape[0] - 1)
    seg = jnp.where((token < num_real) & active[owner], owner, -1).astype(jnp.int32)
    seq_first = query_start_loc[owner]                                    # [P] first row of its sequence
    num_rows = block * group

    def tile_body(i, out):
        row0 = i * block
        qt = lax.dynamic_slice_in_dim(qs, row0, block)                    # [B, KVH, group, D]
        qt = qt.transpose(1, 0, 2, 3).reshape(num_kv_heads, num_rows, head_dim)
        q_tok = jnp.repeat(row0 + jnp.arange(block), group)               # [R] in (row, group) order
        q_seg = jnp.repeat(lax.dynamic_slice_in_dim(seg, row0, block), group)
        first = seq_first[row0]
        if sliding_window is not None:
            first = jnp.maximum(first, row0 - sliding_window + 1)

        def key_body(j, state):
            k0 = j * block
            kt = lax.dynamic_slice_in_dim(kf, k0, block, axis=1)          # [KVH, B, D]
            vt = lax.dynamic_slice_in_dim(vf, k0, block, axis=1)
            k_tok = k0 + jnp.arange(block)
            k_seg = lax.dynamic_slice_in_dim(seg, k0, block)
            mask = (q_seg[:, None] == k_seg[None, :]) & (k_seg >= 0) & (k_tok[None, :] <= q_tok[:, None])  # [R, B]
            if sliding_window is not None:
                mask &= k_tok[None, :] > q_tok[:, None] - sliding_window
            scores = jnp.einsum("hrd,hkd->hrk", qt, kt)
            return _softmax_update(state, scores, mask, vt, "hrk,hkd->hrd", soft_cap)

        state = (jnp.full((num_kv_heads, num_rows), -jnp.inf, _F32),
                 jnp.zeros((num_kv_heads, num_rows), _F32), jnp.zeros_like(qt))
        res, lse = _finish(*lax.fori_loop(lax.div(first, block), i + 1, key_body, state))
        res = res.reshape(num_kv_heads, block, group, head_dim).transpose(1, 0, 2, 3)
        lse = lse.reshape(num_kv_heads, block, group).transpose(1, 0, 2)
        return (lax.dynamic_update_slice_in_dim(out[0], res, row0, axis=0),
                lax.dynamic_update_slice_in_dim(out[1], lse, row0, axis=0))

    # Only the tiles from the first to the last row of an active sequence (decodes, run first
    # in a batch, are often all inactive here).
    taken = seg >= 0
    first_tile = jnp.argmax(taken).astype(jnp.int32) // block
    end_tile = jnp.where(taken.any(), (padded - 1 - jnp.argmax(taken[::-1]).astype(jnp.int32)) // block + 1, 0)
    out = (jnp.zeros_like(qs), jnp.full(qs.shape[:-1], -jnp.inf, _F32))
    return lax.fori_loop(first_tile, end_tile, tile_body, out)


def _merge(a, b):
    """Merge two (out, lse) attention results over disjoint key sets -> (out, lse); rows with no key: (0, -inf)."""
    (out_a, lse_a), (out_b, lse_b) = a, b
    top = jnp.maximum(lse_a, lse_b)
    top = jnp.where(top == -jnp.inf, 0.0, top)
    w_a, w_b = jnp.exp(lse_a - top), jnp.exp(lse_b - top)                 # exp(-inf) = 0
    total = w_a + w_b
    safe = jnp.where(total == 0, 1.0, total)
    out = (out_a * w_a[..., None] + out_b * w_b[..., None]) / safe[..., None]
    return out, jnp.where(total == 0, -jnp.inf, top + jnp.log(safe))
