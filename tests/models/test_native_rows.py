"""The `cpu` backend's native projections equal XLA's einsum: one-row projections through the
native matvec (the batch-1 path), and 2+ rows of float32 or bf16 through the native matmul."""

from __future__ import annotations

import functools
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxserve.models.layers import Proj, project_together
from kernels_pallas import native_cpu

SHAPES = {   # every projection form of the Llama family: q/k/v, o, gate/up, down
    "td,dhk->thk": ((24, 3, 8), (3, 8)),
    "thk,hkd->td": ((3, 8, 24), (24,)),
    "td,df->tf": ((24, 40), (40,)),
    "tf,fd->td": ((40, 24), (24,)),
}


def native_and_plain(einsum_str, dtype, rows):
    """(a `native_rows` Proj, the same Proj without, x of `rows` rows): equal weights and biases."""
    kernel_shape, bias_shape = SHAPES[einsum_str]
    native = Proj(einsum_str, kernel_shape, bias_shape, dtype=dtype, param_dtype=dtype, rngs=nnx.Rngs(0),
                  native_rows=True)
    plain = Proj(einsum_str, kernel_shape, bias_shape, dtype=dtype, param_dtype=dtype, rngs=nnx.Rngs(0))
    native.bias[...] = plain.bias[...] = jnp.asarray(np.random.default_rng(1).standard_normal(bias_shape), dtype)
    in_shape = (rows, *kernel_shape[:len(einsum_str.split(",")[0]) - 1])
    return native, plain, jnp.asarray(np.random.default_rng(2).standard_normal(in_shape), dtype)


def assert_same_projection(native, plain, x):
    got = jax.jit(lambda x: native(x))(x)
    want = jax.jit(lambda x: plain(x))(x)
    assert got.dtype == x.dtype and got.shape == want.shape
    # float32: float32 sums; bfloat16: both round a float32 sum to bf16 (1 ulp apart at most)
    tol = 1e-5 if x.dtype == jnp.float32 else 1e-2
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32), rtol=tol, atol=tol)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("einsum_str", list(SHAPES))
def test_one_row_native_equals_einsum(einsum_str, dtype):
    assert native_cpu.available()
    native, plain, x = native_and_plain(einsum_str, dtype, rows=1)
    assert native.native_rows
    assert_same_projection(native, plain, x)
    lowered = jax.jit(lambda x: native(x)).lower(x).as_text()
    assert "jaxserve_matvec" in lowered
    assert "jaxserve_matvec" not in jax.jit(lambda x: native(jnp.concatenate([x, x]))).lower(x).as_text()


@pytest.mark.parametrize("k,n", [(75, 131), (576, 1000)], ids=["odd", "k16"])
@pytest.mark.parametrize("transposed", [False, True], ids=["w[K,N]", "w[N,K]"])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_matvec_against_numpy(dtype, transposed, k, n):
    """The kernel itself on both layouts (the lm head is [N, K]), sizes not multiples of the unroll;
    [N, K] rows are dot products with a masked tail where K is not a multiple of 16."""
    rng = np.random.default_rng(3)
    x = rng.standard_normal(k).astype(np.float32)
    w = jnp.asarray(rng.standard_normal((n, k) if transposed else (k, n)), dtype)
    got = jax.jit(lambda x, w: native_cpu.matvec(x, w, transposed=transposed))(x, w)
    w64 = np.asarray(w.astype(jnp.float32), np.float64)
    want = w64 @ x if transposed else x @ w64
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match=f"x has {k - 1} elements"):
        native_cpu.matvec(x[:-1], w, transposed=transposed)


@pytest.mark.parametrize("transposed", [False, True], ids=["w_kn", "w_nk"])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_matvecs_share_one_call(dtype, transposed):
    """One row through q/k/v-like weights of different widths in one call (widths that are and are not
    multiples of the [N, K] path's 4 rows, runs of the threads crossing from one weight to the next):
    each result equals its own product, and the attention's projections lower to one custom call."""
    rng = np.random.default_rng(6)
    x = rng.standard_normal(96).astype(np.float32)
    ws = [jnp.asarray(rng.standard_normal((n, 96) if transposed else (96, n)), dtype) for n in (96, 32, 33, 50, 3)]
    call = jax.jit(functools.partial(native_cpu.matvecs, transposed=transposed))
    got = call(x, ws)
    for g, w in zip(got, ws):
        w64 = np.asarray(w.astype(jnp.float32), np.float64)
        want = w64 @ x if transposed else x.astype(np.float64) @ w64
        np.testing.assert_allclose(np.asarray(g), want, rtol=1e-5, atol=1e-5)
        if transposed:   # a [N, K] row's bits do not depend on how the threads' runs cut the rows
            np.testing.assert_array_equal(np.asarray(g), np.asarray(call(x, [w])[0]))
    assert call.lower(x, ws).as_text().count("jaxserve_matvec") == 1
    projs = [native_and_plain("td,dhk->thk", dtype, rows=1)[0] for _ in range(3)]
    one_row = jnp.asarray(rng.standard_normal((1, 24)), dtype)
    lowered = jax.jit(lambda x: project_together(projs, x)).lower(one_row).as_text()
    assert lowered.count("jaxserve_matvec") == 1


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_matvec_rows_in_strands_keep_their_bits(dtype):
    """[N, K] rows are cut into a few runs per thread (4 per core, XLA's pool being one thread a core)
    and each run into four strands of ceil(len / 4) rows, read side by side: each row's result is the
    same bits as that row's product alone, and matches float64 math. Runs of 1, 2, 5, 8 and 10-11 rows
    read their rows in groups of one, two, three and two, four, and four and three."""
    rng = np.random.default_rng(11)
    x = rng.standard_normal(200).astype(np.float32)   # K not a multiple of 32: the masked tail too
    call = jax.jit(functools.partial(native_cpu.matvec, transposed=True))
    runs = 4 * len(os.sched_getaffinity(0))
    for n in (runs, runs * 2, runs * 5, runs * 8, runs * 10 + 2):
        w = jnp.asarray(rng.standard_normal((n, 200)), dtype)
        got = np.asarray(call(x, w))
        alone = np.array([np.asarray(call(x, w[i:i + 1]))[0] for i in range(n)])
        np.testing.assert_array_equal(got, alone)
        w64 = np.asarray(w.astype(jnp.float32), np.float64)
        np.testing.assert_allclose(got, w64 @ x, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("ws,transposed,match", [
    ([jnp.zeros((8, 4)), jnp.zeros((8, 4), jnp.bfloat16)], False, "one dtype"),
    ([jnp.zeros((4, 8)), jnp.zeros((4, 7))], True, "x has 8 elements"),   # [N, K]: the second one's K
    ([jnp.zeros((8, 4), jnp.int32)], False, "float32 or bfloat16 matrix"),
    ([jnp.zeros((7, 4))], False, "x has 8 elements"),
])
def test_matvecs_refuse_bad_operands(ws, transposed, match):
    with pytest.raises(ValueError, match=match):
        native_cpu.matvecs(jnp.zeros(8), ws, transposed=transposed)


# ---- the native matmul of 2+ rows (native/gemm.cc) --------------------------------------------

needs_gemm = pytest.mark.skipif(not native_cpu.gemm_available(), reason="no AVX-512 BF16 on this CPU")


@needs_gemm
@pytest.mark.parametrize("transposed", [False, True], ids=["w_kn", "w_nk"])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("m,k,n", [
    (2, 1, 1), (7, 33, 100), (13, 576, 192), (64, 576, 1536), (9, 577, 65), (6, 2051, 49), (64, 64, 48),
    (5, 40, 1000), (37, 2048, 100), (70, 96, 33), (32, 32, 64),
], ids=lambda v: str(v))
def test_matmul_against_numpy(m, k, n, dtype, transposed):
    """Every tail: rows past the last full tile, columns past the last full panel, odd K (bf16
    pairs), K over one 1,024-row block (partial sums added across blocks); a [N, K] weight
    (`transposed`) also past the last full 16 x 16 block it is packed in. On a CPU with AMX, bf16
    with K a multiple of 32 runs on tiles: rows and columns short of a 32 x 32 block, and K over
    a block, are among these."""
    rng = np.random.default_rng(m * 1000 + k + n)
    x = jnp.asarray(rng.standard_normal((m, k)), dtype)
    w = jnp.asarray(rng.standard_normal((k, n)), dtype)
    got = jax.jit(functools.partial(native_cpu.matmul, transposed=transposed))(x, w.T if transposed else w)
    assert got.dtype == jnp.float32 and got.shape == (m, n)
    want = np.asarray(x.astype(jnp.float32), np.float64) @ np.asarray(w.astype(jnp.float32), np.float64)
    # float32 sums of exact products (bf16 x bf16 is exact in float32): rounding error only
    np.testing.assert_allclose(np.asarray(got), want, rtol=0, atol=2e-6 * np.sqrt(k) * np.abs(want).max())


@needs_gemm
@pytest.mark.parametrize("transposed", [False, True], ids=["w_kn", "w_nk"])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_matmul_of_the_first_rows_only(dtype, transposed):
    """`rows` (traced): the first rows are the same bits as the whole product's, the rest 0;
    out-of-range counts clamp."""
    rng = np.random.default_rng(9)
    x = jnp.asarray(rng.standard_normal((37, 96)), dtype)
    w = jnp.asarray(rng.standard_normal((96, 70)), dtype)
    w = w.T if transposed else w
    whole = np.asarray(jax.jit(functools.partial(native_cpu.matmul, transposed=transposed))(x, w))
    first = jax.jit(lambda x, w, r: native_cpu.matmul(x, w, transposed=transposed, rows=r))
    for rows in (0, 1, 5, 33, 37, 50, -2):
        got = np.asarray(first(x, w, np.int32(rows)))
        n = min(max(rows, 0), 37)
        np.testing.assert_array_equal(got[:n], whole[:n])
        assert not got[n:].any()


@needs_gemm
def test_float32_lm_head_rows_take_the_same_sums_either_layout():
    """On the float32 FMAs, a [N, K] weight (packed transposed) gives each output the same bits as the
    weight [K, N] read in place, whatever the row count."""
    rng = np.random.default_rng(8)
    x = jnp.asarray(rng.standard_normal((70, 1100)), jnp.float32)     # K over one 1,024 block
    w = jnp.asarray(rng.standard_normal((1100, 203)), jnp.float32)    # N past the last 8-row group
    whole = np.asarray(jax.jit(functools.partial(native_cpu.matmul, f32_tiles=False))(x, w))
    transposed = jax.jit(functools.partial(native_cpu.matmul, transposed=True, f32_tiles=False))
    for rows in (2, 9, 48, 49, 70):
        np.testing.assert_array_equal(np.asarray(transposed(x[:rows], w.T)), whole[:rows])


needs_f32_tiles = pytest.mark.skipif(not native_cpu.f32_tiles(), reason="no AMX on this CPU (or JAXSERVE_AMX=0, "
                                                                        "JAXSERVE_F32_TILES=0)")


def _error_units(got, x, w_nk):
    """|got - x w^T| over sum_k |x w|, in units of 2^-24 (a float32 rounding), from float64."""
    x64, w64 = np.asarray(x, np.float64), np.asarray(w_nk, np.float64)
    return np.abs(np.asarray(got, np.float64) - x64 @ w64.T) / (np.abs(x64) @ np.abs(w64).T) * 2.0 ** 24


@needs_f32_tiles
@pytest.mark.parametrize("m,k,n", [(64, 576, 960), (64, 1536, 576), (300, 576, 200), (16, 576, 49152 // 16),
                                   (5, 70, 40), (9, 1, 33), (17, 16, 20), (4, 33, 17)], ids=str)
def test_float32_tiles_are_as_accurate_as_the_float32_fmas(m, k, n):
    """A [N, K] float32 weight on the tiles (each operand split into three bf16 parts, six products,
    summed in one float32 tile per element): against float64, at the model's K (576, 1,536) its
    worst error is no larger than the float32 FMAs' on the same numbers and its typical error
    smaller; at small K, where the FMAs round less often, within 5 float32 roundings of sum |x w|
    (measured up to ~4.5). A product part left out would cost 2^-16 of sum |x w|, 256 of these units."""
    rng = np.random.default_rng(m + k + n)
    x = jnp.asarray(rng.standard_normal((m, k)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((n, k)) * 0.05, jnp.float32)
    tiles = _error_units(jax.jit(functools.partial(native_cpu.matmul, transposed=True, f32_tiles=True))(x, w), x, w)
    fmas = _error_units(jax.jit(functools.partial(native_cpu.matmul, transposed=True, f32_tiles=False))(x, w), x, w)
    assert tiles.max() <= 5
    if k >= 512:
        assert tiles.max() <= fmas.max() and np.sqrt(np.mean(tiles ** 2)) <= np.sqrt(np.mean(fmas ** 2))


@needs_f32_tiles
def test_float32_tiles_give_the_fmas_value_where_a_sum_is_not_finite():
    """inf and NaN operands, values past the split's range (h would round to inf) and sums that
    overflow: those outputs are computed again by float32 FMAs, so they are ±inf or NaN as a
    float32 dot product gives them, and the other outputs of the row stay finite and right."""
    rng = np.random.default_rng(13)
    x = rng.standard_normal((20, 96)).astype(np.float32)
    w = (rng.standard_normal((40, 96)) * 0.05).astype(np.float32)
    x[1, 5] = np.inf                          # row 1: ±inf where w[:, 5] != 0
    x[2, 7] = np.nan                          # row 2: NaN everywhere
    x[3, 9] = 3.4e38                          # finite, past the split's range
    w[6, 9] = 1e-30                           # ... times a tiny weight: finite
    w[7, :] = 0
    w[7, 9] = 3.0e38                          # x[4, 9] * 3e38 overflows
    x[4, 9] = 10.0
    run = jax.jit(functools.partial(native_cpu.matmul, transposed=True, f32_tiles=True))
    got = np.asarray(run(jnp.asarray(x), jnp.asarray(w)))
    with np.errstate(all="ignore"):
        want = (x.astype(np.float64) @ w.astype(np.float64).T).astype(np.float32)
    np.testing.assert_array_equal(np.isposinf(got), np.isposinf(want))
    np.testing.assert_array_equal(np.isneginf(got), np.isneginf(want))
    np.testing.assert_array_equal(np.isnan(got), np.isnan(want))
    assert np.isnan(got[2]).all() and np.isinf(got[1]).any() and np.isinf(got[4, 7])
    finite = np.isfinite(want)
    np.testing.assert_allclose(got[finite], want[finite], rtol=1e-5, atol=1e-5)


@needs_f32_tiles
def test_float32_tile_rows_do_not_depend_on_the_rows_beside_them():
    """Each row of the float32 tiles is the same bits whatever the row count (x is split in chunks of
    up to 64 rows, blocks of 16), with and without `rows`; a NaN in one row stays in that row."""
    rng = np.random.default_rng(12)
    x = jnp.asarray(rng.standard_normal((150, 200)), jnp.float32)    # K past a 32 block
    w = jnp.asarray(rng.standard_normal((75, 200)), jnp.float32)     # N past a 16-row block
    run = jax.jit(functools.partial(native_cpu.matmul, transposed=True, f32_tiles=True))
    whole = np.asarray(run(x, w))
    for rows in (2, 15, 16, 17, 63, 64, 65, 129):
        np.testing.assert_array_equal(np.asarray(run(x[:rows], w)), whole[:rows])
    first = jax.jit(lambda x, w, r: native_cpu.matmul(x, w, transposed=True, rows=r, f32_tiles=True))
    got = np.asarray(first(x, w, np.int32(70)))
    np.testing.assert_array_equal(got[:70], whole[:70])
    assert not got[70:].any()
    poisoned = np.asarray(run(x.at[3, 7].set(jnp.nan), w))
    assert np.isnan(poisoned[3]).all() and np.array_equal(np.delete(poisoned, 3, 0), np.delete(whole, 3, 0))


@needs_gemm
@pytest.mark.skipif(not native_cpu.gemm_amx(), reason="no AMX on this CPU (or JAXSERVE_AMX=0)")
def test_amx_rows_do_not_depend_on_the_rows_beside_them():
    """Each output row of the tile path is the same bits whatever the row count (a step's rows
    must not change another's tokens), and close to the vector path's."""
    rng = np.random.default_rng(7)
    x = jnp.asarray(rng.standard_normal((75, 576)), jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal((576, 200)), jnp.bfloat16)
    whole = np.asarray(jax.jit(native_cpu.matmul)(x, w))
    transposed = jax.jit(functools.partial(native_cpu.matmul, transposed=True))
    for rows in (2, 5, 16, 31, 33, 64):
        np.testing.assert_array_equal(np.asarray(jax.jit(native_cpu.matmul)(x[:rows], w)), whole[:rows])
        # a [N, K] weight (the lm head) takes the tiles the other way round: the same bits
        np.testing.assert_array_equal(np.asarray(transposed(x[:rows], w.T)), whole[:rows])
    want = np.asarray(x.astype(jnp.float32), np.float64) @ np.asarray(w.astype(jnp.float32), np.float64)
    np.testing.assert_allclose(whole, want, rtol=0, atol=2e-6 * np.sqrt(576) * np.abs(want).max())


needs_amx = pytest.mark.skipif(not native_cpu.gemm_amx(), reason="no AMX on this CPU (or JAXSERVE_AMX=0)")


@needs_amx
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
@pytest.mark.parametrize("n", [26240, 26251], ids=["rows_aligned", "rows_unaligned"])
def test_logits_past_the_caches_are_the_bits_of_a_few_rows_at_a_time(n, dtype):
    """A [N, K] weight's results of 4 MB or more (the logits of 32+ rows) leave the tiles by
    streaming stores, after prefetches of the weight and x: each row is the same bits as when it is
    computed with three others (a result too small to stream). With rows 105,004 bytes apart
    (26,251 columns) only every 16th row starts 64-byte aligned and streams, the others take the
    masked stores; columns past the last 32-row weight block are a tail. float32 takes the tiles
    whatever JAXSERVE_F32_TILES says."""
    rng = np.random.default_rng(n)
    x = jnp.asarray(rng.standard_normal((40, 64)), dtype)
    w_nk = jnp.asarray(rng.standard_normal((n, 64)), dtype)
    product = jax.jit(functools.partial(native_cpu.matmul, transposed=True, f32_tiles=True))
    whole = np.asarray(product(x, w_nk))
    assert whole.nbytes >= 4 << 20
    for r in range(0, 40, 4):
        np.testing.assert_array_equal(np.asarray(product(x[r:r + 4], w_nk)), whole[r:r + 4])


@needs_amx
@pytest.mark.parametrize("k,ns", [(32, (32,)), (576, (576, 192, 192)), (576, (1536, 1536)), (1536, (576,)),
                                  (96, (64, 32))], ids=str)
def test_pre_packed_weights_give_the_tiles_bits_at_every_row_count(k, ns):
    """`matmuls_packed` on `pack_weight`'s layout: the same bits as the tiles on the weight as it lies,
    one row (a batch-1 step) or many, rows short of a tile and past a 32-row block, K over one
    1,024 block (down's 1,536), several weights in one call."""
    rng = np.random.default_rng(k + sum(ns))
    x = jnp.asarray(rng.standard_normal((75, k)), jnp.bfloat16)
    ws = [jnp.asarray(rng.standard_normal((k, n)), jnp.bfloat16) for n in ns]
    packed = [native_cpu.pack_weight(w) for w in ws]
    for w, p in zip(ws, packed):
        assert p.shape == (w.shape[1] // 32, k // 2, 32, 2)
        np.testing.assert_array_equal(np.asarray(native_cpu.unpack_weight(p)), np.asarray(w))
    whole = [np.asarray(y) for y in jax.jit(native_cpu.matmuls)(x, ws)]
    run = jax.jit(native_cpu.matmuls_packed)
    for rows in (1, 2, 5, 16, 17, 31, 32, 33, 64, 75):
        got = run(x[:rows], packed)
        for g, want in zip(got, whole):
            assert g.dtype == jnp.float32 and g.shape == (rows, want.shape[1])
            np.testing.assert_array_equal(np.asarray(g), want[:rows])


@needs_amx
def test_pre_packed_products_rounded_to_bf16_equal_the_float32_sums_rounded():
    """`out_dtype` bfloat16: each result is the float32 sum rounded as XLA's convert rounds it, for
    sums that are plain, inf, NaN, and finite but past bfloat16's largest (a tie there rounds to
    inf, just below it to the largest); every row count of a block."""
    rng = np.random.default_rng(11)
    x = rng.standard_normal((70, 96)).astype(np.float32)
    w = rng.standard_normal((96, 96)).astype(np.float32)
    x[3, 5], x[4, 7] = np.inf, np.nan                  # inf and NaN sums
    # row 5: (2 - 2^-7) 2^126 * 2 + 2^119 * {1, 0.5} = bf16's largest (0x7F7F) + a half / a quarter ulp
    x[5, :] = 0
    x[5, 0], x[5, 1] = 1.9921875 * 2.0 ** 126, 2.0 ** 119
    w[0, :], w[1, :64], w[1, 64:] = 2.0, 1.0, 0.5
    x = jnp.asarray(x, jnp.bfloat16)
    w = jnp.asarray(w, jnp.bfloat16)
    packed = [native_cpu.pack_weight(w[:, :64]), native_cpu.pack_weight(w[:, 64:])]
    f32 = jax.jit(native_cpu.matmuls_packed)
    bf16 = jax.jit(lambda x, w: native_cpu.matmuls_packed(x, w, jnp.bfloat16))
    for rows in (1, 7, 32, 45, 70):
        for got, want in zip(bf16(x[:rows], packed), f32(x[:rows], packed)):
            assert got.dtype == jnp.bfloat16
            same_bits(got, want.astype(jnp.bfloat16))
    tie, below = (np.asarray(y[5]).view(np.uint16) for y in bf16(x, packed))
    assert (tie == 0x7F80).all() and (below == 0x7F7F).all()   # inf; bf16's largest
    with pytest.raises(ValueError, match="float32 or bfloat16"):
        native_cpu.matmuls_packed(x, packed, jnp.float16)


@pytest.mark.parametrize("w,ok", [((64, 96), True), ((48, 64), False), ((64, 40), False), ((64,), False)],
                         ids=str)
def test_only_bf16_weights_with_32_multiples_pack(w, ok):
    weight = jnp.zeros(w, jnp.bfloat16)
    assert native_cpu.packable(weight) is ok
    assert not native_cpu.packable(weight.astype(jnp.float32))
    if not ok:
        with pytest.raises(ValueError, match="multiples of 32"):
            native_cpu.pack_weight(weight)


@pytest.mark.parametrize("x,w,match", [
    ((3, 96), (2, 32, 32, 2), "matmuls_packed takes"),            # K 96 against 32 pairs
    ((3, 64), (2, 64, 32), "matmuls_packed takes"),               # not packed
    ((3, 64), (2, 32, 16, 2), "matmuls_packed takes"),            # a column block of 16
    ((3, 48), (2, 24, 32, 2), "matmuls_packed takes"),            # K 48: not whole x tiles
    ((64,), (2, 32, 32, 2), "matmuls_packed takes"),
], ids=str)
def test_packed_matmul_refuses_bad_operands(x, w, match):
    with pytest.raises(ValueError, match=match):
        native_cpu.matmuls_packed(jnp.zeros(x, jnp.bfloat16), [jnp.zeros(w, jnp.bfloat16)])
    with pytest.raises(ValueError, match=match):   # float32 x
        native_cpu.matmuls_packed(jnp.zeros((3, 64), jnp.float32), [jnp.zeros((2, 32, 32, 2), jnp.bfloat16)])


@needs_gemm
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("einsum_str", list(SHAPES))
def test_rows_native_equal_einsum(einsum_str, dtype, monkeypatch):
    """Projections of 2+ rows run through the native matmul and equal XLA's einsum; the switch
    JAXSERVE_NATIVE_GEMM=0 keeps XLA's dot."""
    native, plain, x = native_and_plain(einsum_str, dtype, rows=5)
    assert_same_projection(native, plain, x)
    assert "jaxserve_gemm" in jax.jit(lambda x: native(x)).lower(x).as_text()
    monkeypatch.setenv("JAXSERVE_NATIVE_GEMM", "0")
    assert "jaxserve_gemm" not in jax.jit(lambda x: native(x)).lower(x).as_text()


@needs_gemm
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_matmuls_share_one_call(dtype):
    """q/k/v-like weights of different widths in one call: each result equals its own product, and the
    step lowers to one custom call."""
    rng = np.random.default_rng(5)
    x = jnp.asarray(rng.standard_normal((11, 96)), dtype)
    ws = [jnp.asarray(rng.standard_normal((96, n)), dtype) for n in (96, 32, 32, 50)]
    got = jax.jit(native_cpu.matmuls)(x, ws)
    x64 = np.asarray(x.astype(jnp.float32), np.float64)
    for g, w in zip(got, ws):
        want = x64 @ np.asarray(w.astype(jnp.float32), np.float64)
        np.testing.assert_allclose(np.asarray(g), want, rtol=0, atol=2e-6 * np.sqrt(96) * np.abs(want).max())
    assert jax.jit(native_cpu.matmuls).lower(x, ws).as_text().count("jaxserve_gemm") == 1


@needs_gemm
def test_matmul_gradients_equal_jnp():
    """The training path may run through the native matmul: its VJP is jnp's."""
    rng = np.random.default_rng(4)
    x = jnp.asarray(rng.standard_normal((6, 40)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((40, 24)), jnp.float32)
    loss = lambda mm: (lambda x, w: jnp.sum(jnp.tanh(mm(x, w))))
    got = jax.grad(loss(native_cpu.matmul), argnums=(0, 1))(x, w)
    want = jax.grad(loss(lambda x, w: jnp.dot(x, w, precision="highest")), argnums=(0, 1))(x, w)
    for g, h in zip(got, want):
        np.testing.assert_allclose(np.asarray(g), np.asarray(h), rtol=1e-4, atol=1e-5)
    w2 = w[:, :7] * 2
    two = lambda x, w, w2: sum(jnp.sum(jnp.tanh(y)) for y in native_cpu.matmuls(x, [w, w2]))
    ref = lambda x, w, w2: jnp.sum(jnp.tanh(jnp.dot(x, w, precision="highest"))) + jnp.sum(
        jnp.tanh(jnp.dot(x, w2, precision="highest")))
    for g, h in zip(jax.grad(two, argnums=(0, 1, 2))(x, w, w2), jax.grad(ref, argnums=(0, 1, 2))(x, w, w2)):
        np.testing.assert_allclose(np.asarray(g), np.asarray(h), rtol=1e-4, atol=1e-5)
    wt = lambda mm: (lambda x, w: jnp.sum(jnp.tanh(mm(x, w))))     # a [N, K] weight
    got = jax.grad(wt(functools.partial(native_cpu.matmul, transposed=True)), argnums=(0, 1))(x, w.T)
    want = jax.grad(wt(lambda x, w: jnp.dot(x, w.T, precision="highest")), argnums=(0, 1))(x, w.T)
    for g, h in zip(got, want):
        assert g.shape == h.shape
        np.testing.assert_allclose(np.asarray(g), np.asarray(h), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("x_shape,w_shape,dtypes,match", [
    ((3, 4), (5, 6), (jnp.float32, jnp.float32), r"x \[M, K\] and w \[K, N\]"),
    ((3,), (3, 6), (jnp.float32, jnp.float32), r"x \[M, K\] and w \[K, N\]"),
    ((3, 4), (4, 6), (jnp.float32, jnp.bfloat16), "one dtype"),
    ((3, 4), (4, 6), (jnp.float16, jnp.float16), "float32 or bfloat16"),
    ((3, 4), (0,), (jnp.float32, jnp.float32), r"x \[M, K\] and w \[K, N\]"),
])
def test_matmul_refuses_bad_operands(x_shape, w_shape, dtypes, match):
    with pytest.raises(ValueError, match=match):
        native_cpu.matmul(jnp.zeros(x_shape, dtypes[0]), jnp.zeros(w_shape, dtypes[1]))


def test_transposed_matmul_refuses_a_kn_weight():
    with pytest.raises(ValueError, match=r"x \[M, K\] and w \[N, K\]"):
        native_cpu.matmul(jnp.zeros((3, 4)), jnp.zeros((4, 6)), transposed=True)


# ---- the native SwiGLU of bfloat16 models (native/step_ops.cc) --------------------------------

def same_bits(got, want):
    """bf16 arrays equal bit for bit; NaNs only need to be NaNs (their payloads are XLA's business)."""
    got, want = np.asarray(got).view(np.uint16), np.asarray(want).view(np.uint16)
    nans = np.isnan(got.view(jnp.bfloat16).astype(np.float32)) & np.isnan(want.view(jnp.bfloat16).astype(np.float32))
    differ = (got != want) & ~nans
    assert not differ.any(), f"{differ.sum()} of {differ.size} differ, first at {np.argwhere(differ)[:3].tolist()}"


@pytest.mark.parametrize("up", [1.0, -3.5, 1e-30, 7e-39, 3e38])
def test_silu_mul_equals_xla_on_every_bf16_gate(up):
    """Every bfloat16 gate value (as its float32 product would arrive) times ups that are plain, tiny,
    subnormal and about to overflow: XLA's bits."""
    assert native_cpu.available()
    gate = jnp.asarray(np.arange(1 << 16, dtype=np.uint16).view(jnp.bfloat16).astype(np.float32).reshape(64, 1024))
    up = jnp.full(gate.shape, up, jnp.float32)
    same_bits(jax.jit(native_cpu.silu_mul)(gate, up), jax.jit(native_cpu.silu_mul_reference)(gate, up))


@pytest.mark.parametrize("shape", [(1, 1), (3, 17), (333, 1537), (2, 40000)], ids=str)
def test_silu_mul_equals_xla_on_any_float32(shape):
    """Random float32 bit patterns (ties of the bf16 rounding, NaNs, infinities, subnormals) and
    normal values, at sizes with 16-lane tails and several work items."""
    rng = np.random.default_rng(sum(shape))
    bits = rng.integers(0, 1 << 32, size=(2, *shape), dtype=np.uint64).astype(np.uint32)
    bits[:, ::3] &= 0xFFFF8000          # exact ties and near-ties of the rounding to bf16
    normal = rng.standard_normal((2, *shape)).astype(np.float32) * 4
    for gate, up in (bits.view(np.float32), normal):
        gate, up = jnp.asarray(gate), jnp.asarray(up)
        same_bits(jax.jit(native_cpu.silu_mul)(gate, up), jax.jit(native_cpu.silu_mul_reference)(gate, up))


def test_silu_mul_takes_products_already_rounded_to_bf16():
    """Gate and up as bfloat16 (pre-packed projections round their sums): the same bits as from
    the float32 sums."""
    rng = np.random.default_rng(12)
    bits = rng.integers(0, 1 << 32, size=(2, 37, 301), dtype=np.uint64).astype(np.uint32)
    for gate, up in (bits.view(np.float32), rng.standard_normal((2, 37, 301)).astype(np.float32) * 4):
        gate, up = jnp.asarray(gate), jnp.asarray(up)
        same_bits(jax.jit(native_cpu.silu_mul)(gate.astype(jnp.bfloat16), up.astype(jnp.bfloat16)),
                  jax.jit(native_cpu.silu_mul)(gate, up))


def test_silu_mul_gradients_equal_jnp():
    rng = np.random.default_rng(7)
    gate, up = (jnp.asarray(rng.standard_normal((5, 40)), jnp.float32) for _ in range(2))
    loss = lambda f: (lambda g, u: jnp.sum(jnp.tanh(f(g, u).astype(jnp.float32))))
    got = jax.grad(loss(native_cpu.silu_mul), argnums=(0, 1))(gate, up)
    want = jax.grad(loss(native_cpu.silu_mul_reference), argnums=(0, 1))(gate, up)
    for g, h in zip(got, want):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(h))


@pytest.mark.parametrize("gate,up,match", [
    (jnp.zeros((3, 4)), jnp.zeros((4, 3)), "one shape"),
    (jnp.zeros((3, 4), jnp.float16), jnp.zeros((3, 4), jnp.float16), "float32 \\(or already rounded bfloat16\\)"),
    (jnp.zeros((3, 4)), jnp.zeros((3, 4), jnp.bfloat16), "one shape and dtype"),
])
def test_silu_mul_refuses_bad_operands(gate, up, match):
    with pytest.raises(ValueError, match=match):
        native_cpu.silu_mul(gate, up)


@pytest.mark.parametrize("rows", [1, 5])
@pytest.mark.parametrize("dtype,bias,native_silu", [
    (jnp.bfloat16, False, True), (jnp.bfloat16, True, False), (jnp.float32, False, False)])
def test_mlp_takes_the_native_silu_in_bf16_only(rows, dtype, bias, native_silu, monkeypatch):
    """A bf16 MLP without biases (the default model's) takes the native SwiGLU after its native
    gate/up products, with the same bits as XLA's (JAXSERVE_NATIVE_SILU=0); float32 and biased
    MLPs keep XLA's."""
    from jaxserve.models.layers import MLP
    if rows > 1 and not native_cpu.gemm_available():
        pytest.skip("no AVX-512 BF16 on this CPU")
    mlp = MLP(24, 40, use_bias=bias, dtype=dtype, param_dtype=dtype, rngs=nnx.Rngs(0), native_rows=True)
    x = jnp.asarray(np.random.default_rng(8).standard_normal((rows, 24)), dtype)
    run = jax.jit(lambda x: mlp(x))
    assert ("jaxserve_silu_mul" in run.lower(x).as_text()) == native_silu
    got = run(x)
    monkeypatch.setenv("JAXSERVE_NATIVE_SILU", "0")
    xla = jax.jit(lambda x: mlp(x))
    assert "jaxserve_silu_mul" not in xla.lower(x).as_text()
    same_bits(got, xla(x)) if dtype == jnp.bfloat16 else np.testing.assert_array_equal(got, xla(x))


# ---- the residual add and RMSNorm of bfloat16 models (native/step_ops.cc) -----------------------

def _f64_norm(x32, weight, eps):
    """HF's RMSNorm of a float32 residual with a float64 mean of squares: bf16(w * bf16(x r))."""
    r = (1 / np.sqrt((x32.astype(np.float64) ** 2).mean(-1, keepdims=True) + eps)).astype(np.float32)
    normed = (x32 * r).astype(jnp.bfloat16).astype(np.float32)
    return (np.asarray(weight, np.float32) * normed).astype(jnp.bfloat16)


@pytest.mark.parametrize("t,h", [(1, 576), (75, 576), (512, 64), (3, 40)], ids=str)
@pytest.mark.parametrize("delta", ["float32", "bfloat16", None])
@pytest.mark.parametrize("x_dtype", [jnp.float32, jnp.bfloat16])
def test_add_rms_norm_equals_the_reference(t, h, delta, x_dtype):
    """The sum is the residual plus the bf16-rounded delta in float32, bit for bit; the norm is
    HF's, nearly always the same bits as the jnp reference and as a float64 mean of squares (the
    sum takes its own order: an ulp of the bf16 x * r may move, and then the product with the
    weight by up to two); H short of a 16-lane multiple (40)."""
    assert native_cpu.available()
    rng = np.random.default_rng(t * h)
    x = jnp.asarray(rng.standard_normal((t, h)) * 3, x_dtype)
    d = None if delta is None else jnp.asarray(rng.standard_normal((t, h)), delta)
    w = jnp.asarray(rng.standard_normal(h), jnp.bfloat16)
    got_x, got_n = jax.jit(lambda x, d, w: native_cpu.add_rms_norm(x, d, w, 1e-5))(x, d, w)
    want_x, want_n = jax.jit(lambda x, d, w: native_cpu.add_rms_norm_reference(x, d, w, 1e-5))(x, d, w)
    assert got_x.dtype == jnp.float32 and got_n.dtype == jnp.bfloat16 and got_n.shape == (t, h)
    np.testing.assert_array_equal(np.asarray(got_x), np.asarray(want_x))
    for want in (np.asarray(want_n), _f64_norm(np.asarray(got_x), w, 1e-5)):
        ulps = np.abs(np.asarray(got_n).view(np.int16).astype(int) - want.view(np.int16).astype(int))
        assert ulps.max() <= 2 and (ulps == 0).mean() > 0.999


@pytest.mark.parametrize("t,h", [(1, 576), (75, 576), (512, 64), (3, 40), (64, 960)], ids=str)
@pytest.mark.parametrize("delta", [True, False])
def test_add_rms_norm_of_a_float32_model_is_hfs_within_float32_rounding(t, h, delta):
    """A float32 model's add and norm: the sum bit for bit (nothing rounded), the norm within four
    float32 roundings of float64 math (XLA's own fusions, measured on these shapes: up to 3.5) and
    within five of the jnp reference."""
    assert native_cpu.available()
    rng = np.random.default_rng(t * h + delta)
    x = jnp.asarray(rng.standard_normal((t, h)) * 3, jnp.float32)
    d = jnp.asarray(rng.standard_normal((t, h)), jnp.float32) if delta else None
    w = jnp.asarray(rng.standard_normal(h), jnp.float32)
    got_x, got_n = jax.jit(lambda x, d, w: native_cpu.add_rms_norm(x, d, w, 1e-5))(x, d, w)
    want_x, want_n = jax.jit(lambda x, d, w: native_cpu.add_rms_norm_reference(x, d, w, 1e-5))(x, d, w)
    assert got_x.dtype == got_n.dtype == jnp.float32 and got_n.shape == (t, h)
    got_x, got_n, want_n = map(np.asarray, (got_x, got_n, want_n))
    np.testing.assert_array_equal(got_x, np.asarray(want_x))
    x64 = got_x.astype(np.float64)
    exact = np.asarray(w, np.float64) * x64 / np.sqrt((x64 ** 2).mean(-1, keepdims=True) + 1e-5)
    assert (np.abs(got_n - exact) / np.spacing(np.abs(exact).astype(np.float32))).max() <= 4
    assert np.abs(got_n.view(np.int32).astype(np.int64) - want_n.view(np.int32).astype(np.int64)).max() <= 5


@pytest.mark.parametrize("h", [576, 577])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_add_rms_norm_rows_do_not_depend_on_the_rows_beside_them(dtype, h):
    rng = np.random.default_rng(3)
    x = jnp.asarray(rng.standard_normal((70, h)), jnp.float32)
    d = jnp.asarray(rng.standard_normal((70, h)), jnp.float32)
    w = jnp.asarray(rng.standard_normal(h), dtype)
    run = jax.jit(lambda x, d, w: native_cpu.add_rms_norm(x, d, w, 1e-6))
    whole = [np.asarray(a) for a in run(x, d, w)]
    for rows in (1, 5, 16, 17, 33):
        for got, want in zip(run(x[:rows], d[:rows], w), whole):
            np.testing.assert_array_equal(np.asarray(got), want[:rows])
        for got, want in zip(run(x[rows:], d[rows:], w), whole):   # rows moved to other places
            np.testing.assert_array_equal(np.asarray(got), want[rows:])


@pytest.mark.parametrize("x,d,w,match", [
    (((3, 8), jnp.float16), None, ((8,), jnp.bfloat16), "x \\[T, H\\] float32 or bfloat16"),
    (((3, 8), jnp.float32), None, ((4,), jnp.bfloat16), "weight \\[H\\] bfloat16"),
    (((3, 8), jnp.bfloat16), None, ((8,), jnp.float32), "x and weight float32"),
    (((3, 8), jnp.float32), ((3, 8), jnp.bfloat16), ((8,), jnp.float32), "delta \\[T, H\\] .*float32, as the weight"),
    (((3, 8), jnp.float32), None, ((8,), jnp.float16), "weight \\[H\\] bfloat16"),
    (((3, 8), jnp.float32), ((3, 4), jnp.float32), ((8,), jnp.bfloat16), "delta \\[T, H\\]"),
    (((3, 8), jnp.float32), ((3, 8), jnp.int32), ((8,), jnp.bfloat16), "delta \\[T, H\\]"),
    (((8,), jnp.float32), None, ((8,), jnp.bfloat16), "x \\[T, H\\]"),
], ids=str)
def test_add_rms_norm_refuses_bad_operands(x, d, w, match):
    with pytest.raises(ValueError, match=match):
        native_cpu.add_rms_norm(jnp.zeros(*x), None if d is None else jnp.zeros(*d), jnp.zeros(*w), 1e-5)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_decoder_takes_the_native_norm_in_its_steps(tiny_models, dtype, monkeypatch):
    """A bf16 or float32 model's step runs each residual add and norm as one native call; the
    training forward (no cache) stays jnp and differentiable (weights as they lie: an engine's
    pre-packed kernels serve its steps only)."""
    from jaxserve import LLM, SamplingParams
    monkeypatch.setenv("JAXSERVE_PACKED_WEIGHTS", "0")
    llm = LLM(str(tiny_models["llama"]), dtype="bfloat16" if dtype == jnp.bfloat16 else "float32",
              max_num_batched_tokens=16, max_num_seqs=4, num_kv_blocks=16, max_model_len=64, token_buckets=(4, 16))
    runner = llm.engine.runner
    step = runner._executable((4, runner.rows(4))).as_text()
    assert "jaxserve_add_rms_norm" in step
    graphdef, params = runner.graphdef, runner.params
    ids = jnp.arange(5, dtype=jnp.int32)
    loss = lambda params: jnp.sum(nnx.merge(graphdef, params).forward(ids)[:, 3])
    assert "jaxserve_add_rms_norm" not in jax.jit(loss).lower(params).as_text()
    grads = jax.tree.leaves(jax.grad(loss)(params))
    assert grads and all(bool(jnp.isfinite(g.astype(jnp.float32)).all()) for g in grads)
    out = llm.generate([[3, 4, 5]], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 4


@pytest.mark.parametrize("s,v", [(1, 49152), (7, 1000), (64, 515), (3, 5)], ids=str)
def test_log_softmax_is_jaxs_and_each_row_its_own(s, v):
    """The native log_softmax: jax's values within float32 rounding (its exp and its sum's order
    differ), each row the same bits whatever rows are beside it."""
    assert native_cpu.available()
    x = np.random.default_rng(s * v).standard_normal((s, v)).astype(np.float32) * 6
    x[0, ::3] -= 150   # exponentials past the e^-87 cutoff: as 0
    x = jnp.asarray(x)
    got = np.asarray(jax.jit(native_cpu.log_softmax)(x))
    want = np.asarray(jax.nn.log_softmax(x, axis=-1))
    np.testing.assert_allclose(got, want, rtol=2e-6, atol=2e-6)
    for rows in range(1, s):   # the first rows alone, and the last ones moved up
        np.testing.assert_array_equal(np.asarray(jax.jit(native_cpu.log_softmax)(x[:rows])), got[:rows])
        np.testing.assert_array_equal(np.asarray(jax.jit(native_cpu.log_softmax)(x[rows:])), got[rows:])


def test_log_softmax_of_rows_with_inf_or_nan_is_jaxs():
    """-inf logits (a banned token) get -inf; a row with a NaN, or all -inf, is NaN, as in jax."""
    assert native_cpu.available()
    x = np.zeros((4, 40), np.float32)
    x[0, :5] = -np.inf
    x[1, 3] = np.nan
    x[2, :] = -np.inf
    x[3, 7] = np.inf
    got = np.asarray(native_cpu.log_softmax(jnp.asarray(x)))
    want = np.asarray(jax.nn.log_softmax(jnp.asarray(x), axis=-1))
    np.testing.assert_array_equal(np.isnan(got), np.isnan(want))
    np.testing.assert_allclose(got[0], want[0], rtol=1e-6)
    assert np.all(np.isneginf(got[0, :5]))


@pytest.mark.parametrize("x", [((3, 8), jnp.bfloat16), ((8,), jnp.float32), ((2, 3, 4), jnp.float32)], ids=str)
def test_log_softmax_refuses_bad_operands(x):
    with pytest.raises(ValueError, match="log_softmax takes x \\[S, V\\] float32"):
        native_cpu.log_softmax(jnp.zeros(*x))


def test_step_logprobs_take_the_native_log_softmax(tiny_engine):
    """The cpu backend's step computes its logprobs with the native call."""
    runner = tiny_engine.runner
    if runner.config.attention_backend != "cpu" or not native_cpu.available():
        pytest.skip("the native log_softmax serves the cpu backend")
    assert "jaxserve_log_softmax" in runner._executable((4, runner.rows(4))).as_text()
