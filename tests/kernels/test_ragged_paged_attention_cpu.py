"""Tests of the CPU attention path (in-step keys read in place, earlier context through pages).

Checked against the same float64 oracle as the reference, on the same named scenarios,
with knob sets that make every loop run many times: in-step tiles smaller than a
sequence (a query tile spans sequences, a sequence spans key tiles) and a tile size that
does not divide the token count (padded tiles).
"""

from __future__ import annotations

import platform
import shutil
import subprocess

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernels_pallas import native_cpu
from kernels_pallas.oracle import step_kv
from kernels_pallas.ragged_paged_attention import ragged_paged_attention_reference
from kernels_pallas.ragged_paged_attention_cpu import ragged_paged_attention_cpu
from tests.kernels.test_ragged_paged_attention import (ATOL, KNOBS, RTOL, SCENARIOS, SM_SCALE,
                                                        assert_matches_oracle, make_batch, naive_attention,
                                                        oracle_cases)

CPU_KNOBS = {
    "default": {},                                   # native kernel: every run (decodes, prefill blocks)
    "jnp_longer_runs": dict(decode_query_len=1),     # native decodes, in-step tiles + jnp pages for the rest
    "pure_jnp": dict(native=False),
    "small_tiles": dict(q_block=4, **KNOBS["small_tiles"]),
    "odd_block": dict(q_block=24, query_tile=8, kv_pages_per_chunk=3),   # 64 rows = 2 tiles + 16 of padding
}


def run_cpu(args, **kw):
    k, v = step_kv(args)
    q, kv_cache, *meta = args
    return ragged_paged_attention_cpu(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), jnp.asarray(kv_cache),
                                      *map(jnp.asarray, meta), sm_scale=SM_SCALE, **kw)


def assert_matches_with_bf16_weights(got, q, cache, *meta, sm_scale, sliding_window=None):
    """The AMX path rounds each softmax weight to bf16 before P x V (8 significant bits: a relative
    error of at most 2^-8 each, to nearest), so an output may move from the float64 oracle's by
    up to 2^-8 of the sum of weights times |V| (the oracle's own, `abs_values`), plus float32
    rounding."""
    kw = dict(sm_scale=sm_scale, sliding_window=sliding_window)
    want = naive_attention(q, cache, *meta, **kw)
    bound = 2.0 ** -8 * naive_attention(q, cache, *meta, abs_values=True, **kw)
    query_start_loc, num_seqs = meta[2], meta[3]
    T = int(query_start_loc[int(num_seqs)])   # rows of real tokens
    got, want, bound = np.asarray(got)[:T], want[:T], bound[:T]
    err = np.abs(got - want)
    assert np.all(err <= bound + ATOL + RTOL * np.abs(want)), f"worst excess {np.max(err - bound):.3g}"
    return err, bound


@pytest.mark.parametrize("case, knobs", oracle_cases(CPU_KNOBS))
def test_matches_naive_oracle(case, knobs):
    assert_matches_oracle(case, lambda args, **masking: run_cpu(args, **masking, **knobs))


def test_each_part_matters():
    """On the jnp route, a prefill continuing earlier context needs both parts: dropping either
    changes the answer. The native kernel reads every key from the pool, never `k`/`v`."""
    args = make_batch([(48, 16), (9, 1)])
    want = naive_attention(*args, sm_scale=SM_SCALE)
    np.testing.assert_allclose(np.asarray(run_cpu(args, decode_query_len=1)), want, rtol=RTOL, atol=ATOL)
    k, v = step_kv(args)
    zeroed = tuple(map(jnp.asarray, (args[0], k * 0, v * 0, *args[1:])))
    wrong_step = ragged_paged_attention_cpu(*zeroed, sm_scale=SM_SCALE, decode_query_len=1)
    assert np.abs(np.asarray(wrong_step)[:17] - want[:17]).max() > 0.1
    no_context = list(args)
    no_context[1] = np.zeros_like(args[1])
    assert np.abs(np.asarray(run_cpu(tuple(no_context), decode_query_len=1))[:17] - want[:17]).max() > 0.1
    if native_cpu.available():
        np.testing.assert_allclose(np.asarray(ragged_paged_attention_cpu(*zeroed, sm_scale=SM_SCALE)), want,
                                   rtol=RTOL, atol=ATOL)


def test_16bit_pool_as_uint16_bits_matches_reference():
    """A bf16 model on the CPU path stores its pool as uint16 bits; same answer as a bf16 pool in the reference."""
    args = make_batch(SCENARIOS["mixed"])
    q = jnp.asarray(args[0], jnp.bfloat16)
    cache = jnp.asarray(args[1], jnp.bfloat16)
    k, v = (jnp.asarray(x, jnp.bfloat16) for x in step_kv(args))
    meta = tuple(map(jnp.asarray, args[2:]))
    bits = jnp.asarray(np.asarray(cache).view(np.uint16))
    got = ragged_paged_attention_cpu(q, k, v, bits, *meta, sm_scale=SM_SCALE)
    want = ragged_paged_attention_reference(q, cache, *meta, sm_scale=SM_SCALE)
    assert got.dtype == jnp.bfloat16
    rounded = naive_attention(np.asarray(q, np.float32), np.asarray(cache, np.float32), *args[2:], sm_scale=SM_SCALE)
    np.testing.assert_allclose(np.asarray(got, np.float32), rounded, rtol=1e-2, atol=1e-2)
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32), rtol=1e-2, atol=1e-2)
    with pytest.raises(ValueError, match="uint16 kv_cache holds 16-bit float bits, so q"):
        ragged_paged_attention_cpu(q.astype(jnp.float32), k, v, bits, *meta, sm_scale=SM_SCALE)


@pytest.mark.parametrize("name, bad", [("k", lambda k: k[:-1]), ("v", lambda v: v[:, :1])])
def test_step_kv_shapes_are_checked(name, bad):
    args = make_batch([(5, 1)])
    k, v = map(jnp.asarray, step_kv(args))
    kw = {"k": k, "v": v}
    kw[name] = bad(kw[name])
    with pytest.raises(ValueError, match=f"{name} shape"):
        ragged_paged_attention_cpu(jnp.asarray(args[0]), kw["k"], kw["v"], *map(jnp.asarray, args[1:]),
                                   sm_scale=SM_SCALE)


NATIVE = pytest.param(True, id="native")
JNP = pytest.param(False, id="jnp")


@pytest.mark.parametrize("native", [NATIVE, JNP])
@pytest.mark.parametrize("name", ["decode_only", "mixed", "prefix_hit", "page_boundary", "padding"])
def test_native_and_jnp_decode_paths_match_the_oracle(name, native):
    args = make_batch(SCENARIOS[name])
    got = run_cpu(args, native=native, decode_query_len=3)
    np.testing.assert_allclose(np.asarray(got), naive_attention(*args, sm_scale=SM_SCALE), rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("masking", [dict(sliding_window=5), dict(soft_cap=2.5)], ids=["sliding_window", "soft_cap"])
@pytest.mark.parametrize("group", [1, 3])
def test_native_masks_and_groups(masking, group):
    seqs = [(17, 1), (12, 12), (48, 16), (30, 2), (64, 1), (5, 3), (40, 1)]
    args = make_batch(seqs, group=group)
    args = (args[0] * np.float32(4.0 if "soft_cap" in masking else 1.0), *args[1:])
    got = run_cpu(args, native=True, decode_query_len=2, **masking)
    np.testing.assert_allclose(np.asarray(got), naive_attention(*args, sm_scale=SM_SCALE, **masking),
                               rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_native_reads_16bit_pools_as_bits(dtype):
    """uint16 pools (bf16 or f16 bits) decode natively to the same answer as the jnp path on the same bits."""
    args = make_batch(SCENARIOS["decode_only"] + [], num_kv_heads=2)
    q = jnp.asarray(args[0], dtype)
    cache = np.asarray(jnp.asarray(args[1], dtype))
    k, v = (jnp.asarray(x, dtype) for x in step_kv(args))
    bits = jnp.asarray(cache.view(np.uint16))
    meta = tuple(map(jnp.asarray, args[2:]))
    native = ragged_paged_attention_cpu(q, k, v, bits, *meta, sm_scale=SM_SCALE, native=True)
    plain = ragged_paged_attention_cpu(q, k, v, bits, *meta, sm_scale=SM_SCALE, native=False)
    np.testing.assert_allclose(np.asarray(native, np.float32), np.asarray(plain, np.float32), rtol=1e-2, atol=1e-2)
    want = naive_attention(np.asarray(q, np.float32), cache.astype(np.float32), *args[2:], sm_scale=SM_SCALE)
    np.testing.assert_allclose(np.asarray(native, np.float32), want, rtol=1e-2, atol=1e-2)


def test_native_kernel_builds_here():
    """The CI machine has a C++ compiler: the native kernel must build, or the fast path silently vanishes."""
    from kernels_pallas import native_cpu
    assert native_cpu.available()
    assert native_cpu.build().exists()


@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64") or shutil.which("c++") is None,
                    reason="an x86 machine with a C++ compiler")
@pytest.mark.parametrize("target", [["-march=native", "-mno-amx-tile", "-mno-amx-bf16"],   # AVX-512 BF16, no AMX
                                    ["-march=icelake-server"],                            # AVX-512, no BF16
                                    ["-march=x86-64-v3"]],                                # AVX2
                         ids=["no-amx", "no-bf16", "avx2"])
def test_the_kernels_compile_for_cpus_without_this_ones_features(target):
    """The library is built with -march=native on the user's machine: every source must compile where
    AMX, AVX-512 BF16 or AVX-512 are missing (each feature's code is compiled out, a stub stays)."""
    flags = [f for f in native_cpu._FLAGS if f not in ("-march=native", "-shared", "-fPIC")]
    procs = [subprocess.Popen(["c++", *flags, *target, "-fsyntax-only", f"-I{jax.ffi.include_dir()}", str(src)],
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
             for src in native_cpu.SOURCES]
    errors = [(src.name, proc.communicate()[1]) for src, proc in zip(native_cpu.SOURCES, procs)]
    assert all(proc.returncode == 0 for proc in procs), [(name, err[-1500:]) for name, err in errors if "error" in err]


def test_a_failing_compiler_is_named_and_leaves_no_build_folder(tmp_path, monkeypatch):
    monkeypatch.setenv("CXX", "false")   # a "compiler" that fails every source
    with pytest.raises(RuntimeError, match="false .*-c .*paged_context.cc.* failed"):
        native_cpu.build(tmp_path / "kernels.so")
    assert list(tmp_path.iterdir()) == []


def test_build_folders_of_gone_processes_are_removed(tmp_path):
    import os
    import time
    stale, fresh = tmp_path / ".build-stale", tmp_path / ".build-fresh"
    for folder in (stale, fresh):
        folder.mkdir()
        (folder / "matvec.o").write_bytes(b"half")
    old = time.time() - 2 * native_cpu._STALE_BUILD_SECONDS
    os.utime(stale, (old, old))
    native_cpu._remove_stale_builds(tmp_path)
    assert not stale.exists() and fresh.exists()   # a build still running elsewhere keeps its folder


@pytest.mark.parametrize("native", [NATIVE, JNP])
@pytest.mark.parametrize("ctx", [1, 4, 17])
def test_one_token_step(ctx, native):
    """A one-token step (batch-1 decode) takes the native kernel's answer alone."""
    args = make_batch([(ctx, 1)], num_tokens=1, num_seq_slots=1)
    got = run_cpu(args, native=native)
    np.testing.assert_allclose(np.asarray(got), naive_attention(*args, sm_scale=SM_SCALE), rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("block_size, head_dim", [(16, 64), (16, 128), (32, 64), (64, 128), (8, 32), (16, 40)])
def test_native_compiled_shapes(block_size, head_dim):
    """The kernel's shape-specialised copies (page 16/32 x head_dim 64/128) and the generic one (a
    head dim of 40: rows written 16 columns at a time, then 8 one by one)."""
    seqs = [(70, 1), (33, 1), (16, 1), (17, 1), (90, 20), (1, 1), (48, 2)]
    args = make_batch(seqs, block_size=block_size, head_dim=head_dim, num_blocks=64,
                      max_blocks=-(-90 // block_size), num_kv_heads=3, group=3)
    got = run_cpu(args, native=True, decode_query_len=2)
    np.testing.assert_allclose(np.asarray(got), naive_attention(*args, sm_scale=SM_SCALE), rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("native", [NATIVE, JNP])
def test_sequences_sharing_prefix_pages(native):
    """Prefix-cache hits: many sequences' tables start with the same blocks (the native kernel
    walks a group of sequences page by page, so shared pages are read back to back)."""
    seqs = [(40, 1)] * 6 + [(21, 1), (37, 5), (9, 1), (30, 1), (50, 1), (18, 1)]
    args = list(make_batch(seqs, num_seq_slots=16, num_blocks=128, max_blocks=16))
    tables = args[2].copy()
    for s in range(1, len(seqs)):
        shared = min(-(-seqs[s][0] // 4), 3)       # up to 3 blocks of 4 tokens in common with sequence 0
        tables[s, :shared] = tables[0, :shared]
    args[2] = tables
    got = run_cpu(tuple(args), native=native)
    np.testing.assert_allclose(np.asarray(got), naive_attention(*args, sm_scale=SM_SCALE), rtol=RTOL, atol=ATOL)


@pytest.mark.skipif(not native_cpu.gemm_available(), reason="no AVX-512 BF16 on this CPU")
@pytest.mark.parametrize("head_dim", [64, 128, 32])
def test_bf16_queries_dot_the_pages_as_they_lie(head_dim):
    """A bf16 q times a power-of-two scale is a bf16 exactly, so against a bf16 pool the kernel takes
    the scores from bf16 dot products on the raw K pages (`q_bf16`): the same answer as the float32
    path to float32 rounding, and the float64 oracle's on the same bf16 values."""
    seqs = [(70, 1), (33, 1), (16, 1), (17, 1), (90, 20), (1, 1), (48, 2), (40, 17)]
    args = make_batch(seqs, block_size=16, head_dim=head_dim, num_blocks=64, max_blocks=6, num_kv_heads=3, group=3)
    q = np.asarray(jnp.asarray(args[0], jnp.bfloat16).astype(jnp.float32))
    cache = jnp.asarray(args[1], jnp.bfloat16)
    bits = jnp.asarray(np.asarray(cache).view(np.uint16))
    meta = tuple(map(jnp.asarray, args[2:]))
    scale = 2.0 ** -round(np.log2(head_dim) / 2)
    got = {flag: native_cpu.paged_context_native(jnp.asarray(q * scale), bits, *meta, bits_dtype=jnp.bfloat16,
                                                 max_q_len=q.shape[0], sliding_window=None, soft_cap=None,
                                                 q_bf16=flag, amx=False)[0] for flag in (False, True)}
    want = naive_attention(q, np.asarray(cache.astype(jnp.float32)), *args[2:], sm_scale=scale)
    for flag in (False, True):
        np.testing.assert_allclose(np.asarray(got[flag]), want, rtol=1e-5, atol=1e-5)
    # the bf16 path ran (other summation order) in the 64/128 shapes; the generic shapes ignore the flag
    assert np.array_equal(np.asarray(got[True]), np.asarray(got[False])) == (head_dim not in (64, 128))
    if native_cpu.attention_amx():   # the default here: on the tiles, the weights rounded to bf16
        got[True] = native_cpu.paged_context_native(jnp.asarray(q * scale), bits, *meta, bits_dtype=jnp.bfloat16,
                                                    max_q_len=q.shape[0], sliding_window=None, soft_cap=None,
                                                    q_bf16=True)[0]
        assert_matches_with_bf16_weights(got[True], q, np.asarray(cache.astype(jnp.float32)), *args[2:],
                                         sm_scale=scale)
    # the model-facing entry point takes that path by itself for a bf16 q and a power-of-two scale
    k, v = (jnp.asarray(x, jnp.bfloat16) for x in step_kv(args))
    out = ragged_paged_attention_cpu(jnp.asarray(q, jnp.bfloat16), k, v, bits, *meta, sm_scale=scale, native=True)
    np.testing.assert_array_equal(np.asarray(out), np.asarray(got[True].astype(jnp.bfloat16)))


@pytest.mark.skipif(not native_cpu.gemm_available(), reason="no AVX-512 BF16 on this CPU")
@pytest.mark.parametrize("amx", [False, True])
def test_a_q_with_more_bits_than_bf16_is_rounded_alike_on_every_path(amx):
    """A bf16 model's q reaches the kernel with its RoPE sum unrounded (XLA drops that rounding), so
    `q_bf16` rows hold more bits than a bf16: every path rounds them to nearest even alike, so rows
    folded 16 at a time (shared pages) and one by one still agree bit for bit."""
    if amx and not native_cpu.attention_amx():
        pytest.skip("no AMX tiles here")
    q, cache, tables, ctx, qsl, num_seqs = _shared_prefix_batch(16, 64)
    q = np.asarray(jnp.asarray(q, jnp.bfloat16).astype(jnp.float32))
    q = q * np.float32(1 + 2 ** -10) + np.float32(1e-3)   # bits past bf16's, some rounding up
    q[0, 0, :2] = [1e-40, -3e-39]                          # subnormals
    pool = jnp.asarray(np.asarray(jnp.asarray(cache, jnp.bfloat16)).view(np.uint16))
    got = [native_cpu.paged_context_native(jnp.asarray(q * 0.125), pool, *map(jnp.asarray, (tables, ctx, qsl)),
                                           num_seqs, bits_dtype=jnp.bfloat16, max_q_len=q.shape[0],
                                           sliding_window=None, soft_cap=None, q_bf16=True, amx=amx,
                                           min_lane_fill=fill) for fill in (1, 0)]
    for a, b in zip(*got):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.skipif(not native_cpu.gemm_available(), reason="no AVX-512 BF16 on this CPU")
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("amx", [False, True])
def test_a_q_with_more_bits_than_bf16_gives_the_bits_of_q_rounded_to_nearest_even(head_dim, amx):
    """The kernel's rounding of a `q_bf16` row is XLA's convert to bf16 for normal values (to nearest
    even, ties to even both ways; subnormals flush to zero, as `vcvtne2ps2bf16` does): the outputs of
    q with bits past bf16's equal, bit for bit, those of that q rounded first by jnp, with the shared
    pages folded rows in lanes (whose q pairs are converted 16 at a time) and the rest one by one.
    This checks the rounding only: both inputs go through the same packing, whose layout the
    reference and lanes-against-rows tests check."""
    if amx and not native_cpu.attention_amx():
        pytest.skip("no AMX tiles here")
    q, cache, tables, ctx, qsl, num_seqs = _shared_prefix_batch(16, head_dim)
    rng = np.random.default_rng(head_dim)
    base = np.asarray(jnp.asarray(q, jnp.bfloat16).astype(jnp.float32))
    bits = base.view(np.uint32)
    # the bits below bf16's: a tie (0x8000) on a third of the values (half of them on an odd bf16:
    # rounds up), random bits on the rest
    low = np.where(rng.random(bits.shape) < 1 / 3, 0x8000, rng.integers(1, 0x10000, bits.shape)).astype(np.uint32)
    q_more = (bits | low).view(np.float32)
    assert (q_more != base).mean() > 0.9
    q_rounded = np.asarray(jnp.asarray(q_more, jnp.bfloat16).astype(jnp.float32))
    assert (q_rounded > base).any() and (q_rounded == base).any()   # both ways of a tie and of the rest
    pool = jnp.asarray(np.asarray(jnp.asarray(cache, jnp.bfloat16)).view(np.uint16))
    before = native_cpu.lane_block_pages()
    got = [native_cpu.paged_context_native(jnp.asarray(q_in * 0.125), pool, *map(jnp.asarray, (tables, ctx, qsl)),
                                           num_seqs, bits_dtype=jnp.bfloat16, max_q_len=q.shape[0],
                                           sliding_window=None, soft_cap=None, q_bf16=True, amx=amx, min_lane_fill=1)
           for q_in in (q_more, q_rounded)]
    assert native_cpu.lane_block_pages() > before   # the shared pages went rows in lanes
    for a, b in zip(*got):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.skipif(not native_cpu.gemm_available(), reason="no AVX-512 BF16 on this CPU")
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("window", [None, 8, 20])
@pytest.mark.parametrize("amx", [False, True])
def test_q_rotated_in_the_kernel_gives_xlas_bits(head_dim, window, amx, monkeypatch):
    """`ragged_paged_attention_cpu(q_rope=...)`: a bf16 q before its RoPE, rotated and scaled by the
    kernel's work items, gives the bits of the q XLA rotates, for runs cut into 16-query blocks (40,
    17), decodes, padding rows, and sliding windows, on the tiles and off them."""
    from jaxserve.models.config import RopeScaling
    from jaxserve.models.layers import apply_rope, rope_inv_freq, rope_tables
    if amx and not native_cpu.attention_amx():
        pytest.skip("no AMX tiles here")
    monkeypatch.setenv("JAXSERVE_AMX_ATTENTION", "1" if amx else "0")
    seqs = [(90, 40), (40, 17), (33, 1), (70, 1), (16, 1), (120, 3)]
    args = make_batch(seqs, num_tokens=80, num_seq_slots=8, block_size=16, head_dim=head_dim, num_blocks=48,
                      max_blocks=8, num_kv_heads=2, group=3, seed=head_dim)
    q_raw = jnp.asarray(args[0] * 2, jnp.bfloat16)
    pool = jnp.asarray(np.asarray(jnp.asarray(args[1], jnp.bfloat16)).view(np.uint16))
    k, v = (jnp.asarray(x, jnp.bfloat16) for x in step_kv(args))
    positions = jnp.asarray(np.random.default_rng(1).integers(0, 4000, size=q_raw.shape[0]), jnp.int32)
    inv_freq = rope_inv_freq(head_dim, 10000.0, RopeScaling())
    meta = tuple(map(jnp.asarray, args[2:]))

    @jax.jit
    def both(q_raw, positions):
        q = apply_rope(q_raw, positions, inv_freq)
        kw = dict(sm_scale=head_dim ** -0.5, sliding_window=window)
        return (ragged_paged_attention_cpu(q, k, v, pool, *meta, **kw),
                ragged_paged_attention_cpu(q, k, v, pool, *meta, **kw,
                                           q_rope=(q_raw, *rope_tables(positions, inv_freq, jnp.bfloat16))))

    xla, native = both(q_raw, positions)
    T = int(args[4][args[5]])
    np.testing.assert_array_equal(np.asarray(native), np.asarray(xla))
    assert np.isfinite(np.asarray(native.astype(jnp.float32))[:T]).all()


@pytest.mark.skipif(not native_cpu.available(), reason="native kernel not built here")
@pytest.mark.parametrize("pool, amx", [("bfloat16", True), ("bfloat16", False), ("float32", False)])
def test_bf16_output_is_the_float32_output_rounded_as_xla_rounds_it(pool, amx):
    """`out_dtype=bfloat16` (what the model's bf16 attention asks for): every output is the float32
    kernel's rounded as `.astype(jnp.bfloat16)` rounds it, bit for bit (NaN rows included), padding
    rows 0; lse as in the float32 call."""
    if amx and not native_cpu.attention_amx():
        pytest.skip("no AMX tiles here")
    seqs = [(70, 1), (33, 1), (90, 20), (1, 1), (48, 2), (40, 17), (130, 1)]
    q, cache, tables, ctx, qsl, num_seqs = make_batch(seqs, block_size=16, head_dim=64, num_blocks=64, max_blocks=9,
                                                      num_kv_heads=3, group=3, seed=7)
    q = np.asarray(jnp.asarray(q * 4.0, jnp.bfloat16).astype(jnp.float32)) * 0.125   # bf16 values, scaled
    cache[1, 1, tables[1, 0], 3] = np.nan   # the second decode's head-1 rows come out NaN
    cache[1, 2, tables[5, 1], 0] = 1e30     # a large value in one prefill's V: rounds to inf or stays finite
    kv = jnp.asarray(cache, jnp.bfloat16) if pool == "bfloat16" else jnp.asarray(cache)
    kv = jnp.asarray(np.asarray(kv).view(np.uint16)) if pool == "bfloat16" else kv
    meta = tuple(map(jnp.asarray, (tables, ctx, qsl))) + (num_seqs,)

    def attend(out_dtype):
        return native_cpu.paged_context_native(jnp.asarray(q), kv, *meta, bits_dtype=jnp.bfloat16,
                                               max_q_len=q.shape[0], sliding_window=None, soft_cap=None,
                                               q_bf16=True, amx=amx, out_dtype=out_dtype)

    (f32, lse32), (b16, lse16) = attend(jnp.float32), attend(jnp.bfloat16)
    assert b16.dtype == jnp.bfloat16
    want = np.asarray(f32.astype(jnp.bfloat16)).view(np.uint16)
    np.testing.assert_array_equal(np.asarray(b16).view(np.uint16), want)
    np.testing.assert_array_equal(np.asarray(lse16), np.asarray(lse32))
    assert np.isnan(np.asarray(f32)[int(qsl[1]), 3:6]).all()           # the NaN reached its rows ...
    assert not np.isnan(np.asarray(f32)[int(qsl[0])]).any()            # ... and no others
    assert not np.asarray(b16)[int(qsl[num_seqs]):].astype(np.float32).any()   # padding rows: 0
    with pytest.raises(ValueError, match="float32 or bfloat16"):
        native_cpu.paged_context_native(jnp.asarray(q), kv, *meta, bits_dtype=jnp.bfloat16, max_q_len=q.shape[0],
                                        sliding_window=None, soft_cap=None, out_dtype=jnp.float16)


def _shared_prefix_batch(block_size, head_dim, *, group=3):
    """12 decodes over a 9-page shared prefix and 3 more pages each, 2 decodes of their own, one
    decode sharing only the first 2 pages, and a 37-query prefill chunk after 70 tokens."""
    prefix = 9 * block_size
    seqs = [(prefix + 3 * block_size - s, 1) for s in range(12)] + [(50, 1), (90, 1), (prefix + 5, 1), (107, 37)]
    max_blocks = -(-max(c for c, _ in seqs) // block_size)
    args = list(make_batch(seqs, num_tokens=64, num_seq_slots=16, block_size=block_size, head_dim=head_dim,
                           num_blocks=16 * max_blocks + 1, max_blocks=max_blocks, num_kv_heads=2, group=group))
    tables = args[2].copy()
    tables[1:12, :9] = tables[0, :9]
    tables[14, :2] = tables[0, :2]
    args[2] = tables
    return tuple(args)


@pytest.mark.skipif(not native_cpu.available(), reason="no native kernel")
@pytest.mark.parametrize("block_size, head_dim", [(16, 64), (32, 128), (64, 64)])
@pytest.mark.parametrize("variant", ["plain", "sliding_window", "bf16_pool", "bf16_dot", "bf16_dot_window"])
def test_shared_pages_fold_16_rows_at_a_time_with_the_same_numbers(block_size, head_dim, variant):
    """Pages several runs share (and a prefill block's full pages) are folded for 16 query rows at
    a time, rows in vector lanes. Each row goes through the same operations in the same order as
    when its run folds them alone, so the answer is the same to the bit: with the path off, and
    for every sequence computed on its own (a lone decode's 3 rows never take it). bf16_dot: a
    bf16 q against a bf16 pool, scores from bf16 dot products in both layouts."""
    if variant.startswith("bf16_dot") and not native_cpu.gemm_available():
        pytest.skip("no AVX-512 BF16 on this CPU")
    args = _shared_prefix_batch(block_size, head_dim)
    q, cache, tables, ctx, qsl, num_seqs = args
    scale = 2.0 ** -round(np.log2(head_dim) / 2)   # a power of two: a bf16 q times it is still a bf16
    window = 5 * block_size + 3 if variant.endswith("window") else None
    pool, bits = jnp.asarray(cache), jnp.float32
    if variant.startswith("bf16"):
        cache = np.asarray(jnp.asarray(cache, jnp.bfloat16).astype(jnp.float32))
        pool, bits = jnp.asarray(np.asarray(jnp.asarray(cache, jnp.bfloat16)).view(np.uint16)), jnp.bfloat16
    if variant.startswith("bf16_dot"):
        q = np.asarray(jnp.asarray(q, jnp.bfloat16).astype(jnp.float32))

    def attend(q, tables, ctx, qsl, num_seqs, fill):   # waited for: the counter is read right after
        return jax.block_until_ready(native_cpu.paged_context_native(
            jnp.asarray(q * scale), pool, jnp.asarray(tables), jnp.asarray(ctx), jnp.asarray(qsl), num_seqs,
            bits_dtype=bits, max_q_len=q.shape[0], sliding_window=window, soft_cap=None,
            q_bf16=variant.startswith("bf16_dot"), min_lane_fill=fill))

    before, tiles_before = native_cpu.lane_block_pages(), native_cpu.amx_attention_folds()
    on = attend(q, tables, ctx, qsl, num_seqs, 10)
    assert native_cpu.lane_block_pages() > before   # the lane path ran
    # a bf16 q against a bf16 pool takes the AMX tiles where the CPU has them (rows in lanes for
    # blocks of 8+ rows, one by one below: a lone decode's 3 rows, checked against the lanes below)
    tiles = variant.startswith("bf16_dot") and native_cpu.attention_amx()
    assert (native_cpu.amx_attention_folds() > tiles_before) == tiles
    off_before = native_cpu.lane_block_pages()
    off = attend(q, tables, ctx, qsl, num_seqs, 0)
    assert native_cpu.lane_block_pages() == off_before
    for a, b in zip(on, off):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    T = int(qsl[num_seqs])
    if tiles:   # on the tiles: the weights rounded to bf16
        assert_matches_with_bf16_weights(np.asarray(on[0])[:T], q, cache, tables, ctx, qsl, num_seqs,
                                         sm_scale=scale, sliding_window=window)
    else:
        want = naive_attention(q, cache, tables, ctx, qsl, num_seqs, sm_scale=scale, sliding_window=window)
        np.testing.assert_allclose(np.asarray(on[0])[:T], want[:T], rtol=RTOL, atol=ATOL)
    for s in range(int(num_seqs)):   # each sequence alone, in slot 0
        lo, hi = int(qsl[s]), int(qsl[s + 1])
        alone = attend(q[lo:hi], tables[s:s + 1], ctx[s:s + 1], np.array([0, hi - lo], np.int32), 1, 10)
        np.testing.assert_array_equal(np.asarray(alone[0]), np.asarray(on[0])[lo:hi])


def test_min_lane_fill_is_checked():
    with pytest.raises(ValueError, match="min_lane_fill must be in 0..16"):
        native_cpu.lane_fill_setting(17)
    with pytest.raises(ValueError, match="min_lane_fill must be in 0..16"):
        native_cpu.lane_fill_setting(-1)


@pytest.mark.skipif(not native_cpu.available(), reason="no native kernel")
@pytest.mark.parametrize("variant", ["float32", "bf16_pool", "bf16_dot"])
def test_stale_pool_contents_past_a_runs_last_key_stay_out(variant):
    """A run's last page holds whatever an earlier owner left past its last key (inf, NaN): those
    slots are never read into its rows, whichever path folds them (the tiles multiply whole pages:
    their V rows past the last key must be zeros, not 0 x inf)."""
    if variant == "bf16_dot" and not native_cpu.gemm_available():
        pytest.skip("no AVX-512 BF16 on this CPU")
    seqs = [(21, 1), (70, 1), (37, 17), (5, 5), (100, 3)]
    q, cache, tables, ctx, qsl, num_seqs = make_batch(seqs, block_size=16, head_dim=64, num_blocks=40,
                                                      max_blocks=7, num_kv_heads=3, group=3)
    bf16 = variant != "float32"
    if bf16:
        cache = np.asarray(jnp.asarray(cache, jnp.bfloat16).astype(jnp.float32))
    if variant == "bf16_dot":
        q = np.asarray(jnp.asarray(q, jnp.bfloat16).astype(jnp.float32))
    stale = cache.copy()
    for s, c in enumerate(ctx[:num_seqs]):
        block, offset = tables[s, (c - 1) // 16], (c - 1) % 16 + 1
        stale[0, :, block, offset:] = np.nan
        stale[1, :, block, offset:] = np.inf
    results = []
    before = native_cpu.amx_attention_folds()
    for pool in (cache, stale):
        bits = jnp.asarray(np.asarray(jnp.asarray(pool, jnp.bfloat16)).view(np.uint16)) if bf16 else jnp.asarray(pool)
        out, lse = native_cpu.paged_context_native(
            jnp.asarray(q * 0.125), bits, *map(jnp.asarray, (tables, ctx, qsl)), num_seqs,
            bits_dtype=jnp.bfloat16 if bf16 else jnp.float32, max_q_len=q.shape[0], sliding_window=None,
            soft_cap=None, q_bf16=variant == "bf16_dot")
        results.append((np.asarray(out), np.asarray(lse)))
    assert (native_cpu.amx_attention_folds() > before) == (variant == "bf16_dot" and native_cpu.attention_amx())
    T = int(qsl[num_seqs])
    assert np.all(np.isfinite(results[1][0][:T])) and np.all(np.isfinite(results[1][1][:T]))
    for clean, dirty in zip(*results):
        np.testing.assert_array_equal(dirty, clean)


@pytest.mark.skipif(not (native_cpu.available() and native_cpu.attention_amx()), reason="no AMX tiles here")
@pytest.mark.parametrize("window", [None, 21])
def test_a_scale_that_is_no_power_of_two_scales_the_tiles_scores(window):
    """Head dim 128's 1/sqrt(128) times a bf16 q is no bf16: the model-facing entry point passes q
    unscaled and the kernel multiplies the tiles' scores by the scale (every row the same way)."""
    seqs = [(70, 1), (33, 1), (16, 1), (17, 1), (90, 20), (1, 1), (48, 2), (40, 17)]
    args = make_batch(seqs, block_size=16, head_dim=128, num_blocks=64, max_blocks=6, num_kv_heads=3, group=3)
    q = np.asarray(jnp.asarray(args[0], jnp.bfloat16).astype(jnp.float32))
    cache = jnp.asarray(args[1], jnp.bfloat16)
    bits = jnp.asarray(np.asarray(cache).view(np.uint16))
    meta = tuple(map(jnp.asarray, args[2:]))
    scale = 128 ** -0.5
    before = native_cpu.amx_attention_folds()
    got, _ = native_cpu.paged_context_native(jnp.asarray(q), bits, *meta, bits_dtype=jnp.bfloat16, max_q_len=q.shape[0],
                                             sliding_window=window, soft_cap=None, q_bf16=True, score_scale=scale)
    assert native_cpu.amx_attention_folds() > before
    assert_matches_with_bf16_weights(got, q, np.asarray(cache.astype(jnp.float32)), *args[2:], sm_scale=scale,
                                     sliding_window=window)
    k, v = (jnp.asarray(x, jnp.bfloat16) for x in step_kv(args))
    out = ragged_paged_attention_cpu(jnp.asarray(q, jnp.bfloat16), k, v, bits, *meta, sm_scale=scale,
                                     sliding_window=window, native=True)
    np.testing.assert_array_equal(np.asarray(out), np.asarray(got.astype(jnp.bfloat16)))
    tables, ctx, qsl = args[2], args[3], args[4]
    for s in range(int(args[5])):   # each sequence alone: the same bits
        lo, hi = int(qsl[s]), int(qsl[s + 1])
        alone, _ = native_cpu.paged_context_native(
            jnp.asarray(q[lo:hi]), bits, jnp.asarray(tables[s:s + 1]), jnp.asarray(ctx[s:s + 1]),
            jnp.asarray([0, hi - lo], jnp.int32), 1, bits_dtype=jnp.bfloat16, max_q_len=hi - lo,
            sliding_window=window, soft_cap=None, q_bf16=True, score_scale=scale)
        np.testing.assert_array_equal(np.asarray(alone), np.asarray(got)[lo:hi])


@pytest.mark.skipif(not native_cpu.available(), reason="no native kernel")
def test_a_score_scale_off_the_tiles_is_refused():
    """`score_scale` exists for the tiles only; the vector folds take scaled queries."""
    args = make_batch([(20, 1), (9, 3)], block_size=16, head_dim=64, num_blocks=8, max_blocks=2, num_kv_heads=1,
                      group=2)
    with pytest.raises(Exception, match="score_scale other than 1 needs the AMX path"):
        jax.block_until_ready(native_cpu.paged_context_native(
            jnp.asarray(args[0]), jnp.asarray(args[1]), *map(jnp.asarray, args[2:5]), int(args[5]),
            bits_dtype=jnp.float32, max_q_len=3, sliding_window=None, soft_cap=None, score_scale=0.3))


@pytest.mark.skipif(not native_cpu.gemm_available(), reason="no AVX-512 BF16 on this CPU")
@pytest.mark.parametrize("amx", [False, True])
def test_shared_pages_whole_for_some_runs_and_partial_for_the_anchor(amx):
    """Three runs share two pool blocks; the first run's context ends inside the second, which the
    others read whole. Folding the shared pages together must still give each run all of its keys
    (the pages' key count is the runs' that share them, not the first run's)."""
    rng = np.random.default_rng(0)
    ctx = np.array([24, 40, 40], np.int32)
    tables = np.array([[1, 2, 0], [1, 2, 3], [1, 2, 4]], np.int32)
    qsl = np.array([0, 1, 2, 3], np.int32)
    q = np.asarray(jnp.asarray(rng.standard_normal((3, 4, 64)), jnp.bfloat16).astype(jnp.float32))
    cache = np.asarray(jnp.asarray(rng.standard_normal((2, 1, 8, 16, 64)), jnp.bfloat16).astype(jnp.float32))
    bits = jnp.asarray(np.asarray(jnp.asarray(cache, jnp.bfloat16)).view(np.uint16))
    outs = [native_cpu.paged_context_native(
        jnp.asarray(q * 0.125), bits, jnp.asarray(tables), jnp.asarray(ctx), jnp.asarray(qsl), 3,
        bits_dtype=jnp.bfloat16, max_q_len=1, sliding_window=None, soft_cap=None, q_bf16=True, amx=amx,
        min_lane_fill=fill)[0] for fill in (0, 1)]
    np.testing.assert_array_equal(np.asarray(outs[0]), np.asarray(outs[1]))
    if amx and native_cpu.attention_amx():
        assert_matches_with_bf16_weights(outs[1], q, cache, tables, ctx, qsl, 3, sm_scale=0.125)
    else:
        want = naive_attention(q, cache, tables, ctx, qsl, 3, sm_scale=0.125)
        np.testing.assert_allclose(np.asarray(outs[1]), want, rtol=RTOL, atol=ATOL)


@pytest.mark.skipif(not (native_cpu.available() and native_cpu.attention_amx()), reason="no AMX tiles here")
@pytest.mark.parametrize("head_dim,kv_heads,group,window", [(64, 3, 3, None), (64, 2, 1, None), (128, 2, 4, 40),
                                                            (64, 1, 8, None), (64, 3, 3, 21)])
def test_a_decode_row_gets_its_own_bits_on_the_tiles(head_dim, kv_heads, group, window):
    """On the tiles a decode's row gets the bits it gets alone, and those of the same query as the
    last row of a longer run (another block, another tile shape); a NaN inside one run's keys stays
    in its rows. (Any path that packs several runs' rows together must keep all three.)"""
    rng = np.random.default_rng(head_dim + group)
    lens = [int(x) for x in rng.integers(2, 120, size=21)] + [16, 17, 32]
    seqs = [(n, 1) for n in lens] + [(50, 2)]
    need = [-(-n // 16) for n, _ in seqs]
    q, cache, tables, ctx, qsl, num_seqs = make_batch(seqs, block_size=16, head_dim=head_dim, num_blocks=sum(need) + 1,
                                                      max_blocks=max(need), num_kv_heads=kv_heads, group=group, seed=5,
                                                      num_tokens=len(seqs) + 1, num_seq_slots=len(seqs))
    tables[1:4, :1] = tables[0, :1]   # three decodes read their first page from the first one's block
    q = np.array(jnp.asarray(q, jnp.bfloat16).astype(jnp.float32))
    last = int(qsl[num_seqs - 1])     # the 2-query run: its last row asks what the first decode asks
    q[last + 1] = q[0]
    tables[num_seqs - 1] = tables[0]
    ctx[num_seqs - 1] = ctx[0]        # its last query sits where the first decode's does
    q = q[: int(qsl[num_seqs])]
    pool = np.array(jnp.asarray(cache, jnp.bfloat16))
    scale = head_dim ** -0.5
    kw = dict(score_scale=scale) if head_dim == 128 else {}
    qs = q if head_dim == 128 else q * scale

    def attend(pool, qs, tables, ctx, qsl, n):
        out, lse = native_cpu.paged_context_native(
            jnp.asarray(qs), jnp.asarray(pool.view(np.uint16)), *map(jnp.asarray, (tables, ctx, qsl)), n,
            bits_dtype=jnp.bfloat16, max_q_len=qs.shape[0], sliding_window=window, soft_cap=None, q_bf16=True, **kw)
        return np.asarray(out), np.asarray(lse)

    before = native_cpu.amx_attention_folds()
    out, lse = attend(pool, qs, tables, ctx, qsl, num_seqs)
    assert native_cpu.amx_attention_folds() > before
    assert np.all(np.isfinite(out)) and np.all(np.isfinite(lse))
    for s in range(int(num_seqs)):   # each sequence alone: the same bits
        lo, hi = int(qsl[s]), int(qsl[s + 1])
        alone = attend(pool, qs[lo:hi], tables[s:s + 1], ctx[s:s + 1], np.array([0, hi - lo], np.int32), 1)
        np.testing.assert_array_equal(alone[0], out[lo:hi])
        np.testing.assert_array_equal(alone[1], lse[lo:hi])
    np.testing.assert_array_equal(out[last + 1], out[0])   # a decode's row = a longer run's row, to the bit
    np.testing.assert_array_equal(lse[last + 1], lse[0])
    dirty = pool.copy()   # NaN in the fifth decode's last key (a page of its own): only its rows change
    dirty[0, :, tables[4, (ctx[4] - 1) // 16], (ctx[4] - 1) % 16] = np.nan
    got, got_lse = attend(dirty, qs, tables, ctx, qsl, num_seqs)
    assert not np.array_equal(got[4], out[4])
    keep = np.arange(out.shape[0]) != 4
    np.testing.assert_array_equal(got[keep], out[keep])
    np.testing.assert_array_equal(got_lse[keep], lse[keep])
    assert_matches_with_bf16_weights(jnp.asarray(out), q, np.asarray(pool.astype(np.float32)), tables, ctx, qsl,
                                     num_seqs, sm_scale=scale, sliding_window=window)
