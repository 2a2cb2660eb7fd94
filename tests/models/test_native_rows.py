"""One-row bf16 projections through the native CPU matvec equal the XLA einsum (the `cpu` backend's
batch-1 path); float32 weights stay with XLA's one-row dot, which measured faster in the step."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxserve.models.layers import Proj
from kernels_pallas import native_cpu

SHAPES = {   # every projection form of the Llama family: q/k/v, o, gate/up, down
    "td,dhk->thk": ((24, 3, 8), (3, 8)),
    "thk,hkd->td": ((3, 8, 24), (24,)),
    "td,df->tf": ((24, 40), (40,)),
    "tf,fd->td": ((40, 24), (24,)),
}


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("einsum_str", list(SHAPES))
def test_one_row_native_equals_einsum(einsum_str, dtype):
    assert native_cpu.available()
    kernel_shape, bias_shape = SHAPES[einsum_str]
    native = Proj(einsum_str, kernel_shape, bias_shape, dtype=dtype, param_dtype=dtype, rngs=nnx.Rngs(0),
                  native_rows=True)
    plain = Proj(einsum_str, kernel_shape, bias_shape, dtype=dtype, param_dtype=dtype, rngs=nnx.Rngs(0))
    native.bias[...] = plain.bias[...] = jnp.asarray(np.random.default_rng(1).standard_normal(bias_shape), dtype)
    assert native.native_rows
    in_shape = (1, *kernel_shape[:len(einsum_str.split(",")[0]) - 1])
    x = jnp.asarray(np.random.default_rng(2).standard_normal(in_shape), dtype)
    got = jax.jit(lambda x: native(x))(x)
    want = jax.jit(lambda x: plain(x))(x)
    assert got.dtype == dtype and got.shape == want.shape
    # float32: the same XLA einsum; bfloat16: both round a float32 sum to bf16 (1 ulp apart at most)
    tol = 1e-5 if dtype == jnp.float32 else 1e-2
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32), rtol=tol, atol=tol)
    lowered = jax.jit(lambda x: native(x)).lower(x).as_text()
    assert ("jaxserve_matvec" in lowered) == (dtype == jnp.bfloat16)
    assert "jaxserve_matvec" not in jax.jit(lambda x: native(jnp.concatenate([x, x]))).lower(x).as_text()


@pytest.mark.parametrize("transposed", [False, True], ids=["w[K,N]", "w[N,K]"])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_matvec_against_numpy(dtype, transposed):
    """The kernel itself on both layouts (the lm head is [N, K]), sizes not multiples of the unroll."""
    rng = np.random.default_rng(3)
    k, n = 75, 131
    x = rng.standard_normal(k).astype(np.float32)
    w = jnp.asarray(rng.standard_normal((n, k) if transposed else (k, n)), dtype)
    got = jax.jit(lambda x, w: native_cpu.matvec(x, w, transposed=transposed))(x, w)
    w64 = np.asarray(w.astype(jnp.float32), np.float64)
    want = w64 @ x if transposed else x @ w64
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="x has 74 elements"):
        native_cpu.matvec(x[:-1], w, transposed=transposed)
