"""The `cpu` backend's native projections equal XLA's einsum: one-row projections through the
native matvec (the batch-1 path), and 2+ rows of float32 or bf16 through the native matmul."""

from __future__ import annotations

import functools
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


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_matvecs_share_one_call(dtype):
    """One row through q/k/v-like weights of different widths in one call: each result equals its own
    product, and the attention's projections lower to one custom call."""
    rng = np.random.default_rng(6)
    x = rng.standard_normal(96).astype(np.float32)
    ws = [jnp.asarray(rng.standard_normal((96, n)), dtype) for n in (96, 32, 32, 50)]
    got = jax.jit(native_cpu.matvecs)(x, ws)
    for g, w in zip(got, ws):
        want = x.astype(np.float64) @ np.asarray(w.astype(jnp.float32), np.float64)
        np.testing.assert_allclose(np.asarray(g), want, rtol=1e-5, atol=1e-5)
    assert jax.jit(native_cpu.matvecs).lower(x, ws).as_text().count("jaxserve_matvec") == 1
    projs = [native_and_plain("td,dhk->thk", dtype, rows=1)[0] for _ in range(3)]
    one_row = jnp.asarray(rng.standard_normal((1, 24)), dtype)
    lowered = jax.jit(lambda x: project_together(projs, x)).lower(one_row).as_text()
    assert lowered.count("jaxserve_matvec") == 1


@pytest.mark.parametrize("ws,transposed,match", [
    ([jnp.zeros((8, 4)), jnp.zeros((8, 4), jnp.bfloat16)], False, "one dtype"),
    ([jnp.zeros((4, 8)), jnp.zeros((4, 8))], True, "one when transposed"),
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
    (5, 40, 1000),
], ids=lambda v: str(v))
def test_matmul_against_numpy(m, k, n, dtype, transposed):
    """Every tail: rows past the last full tile, columns past the last full panel, odd K (bf16
    pairs), K over one 1,024-row block (partial sums added across blocks); a [N, K] weight
    (`transposed`) also past the last full 16 x 16 block it is packed in."""
    rng = np.random.default_rng(m * 1000 + k + n)
    x = jnp.asarray(rng.standard_normal((m, k)), dtype)
    w = jnp.asarray(rng.standard_normal((k, n)), dtype)
    got = jax.jit(functools.partial(native_cpu.matmul, transposed=transposed))(x, w.T if transposed else w)
    assert got.dtype == jnp.float32 and got.shape == (m, n)
    want = np.asarray(x.astype(jnp.float32), np.float64) @ np.asarray(w.astype(jnp.float32), np.float64)
    # float32 sums of exact products (bf16 x bf16 is exact in float32): rounding error only
    np.testing.assert_allclose(np.asarray(got), want, rtol=0, atol=2e-6 * np.sqrt(k) * np.abs(want).max())


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
