"""One-row projections through the native CPU matvec equal the XLA einsum (the `cpu` backend's batch-1 path)."""

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
    # float32: summation order only; bfloat16: both round one float32 result to bf16 (1 ulp apart at most)
    tol = 1e-5 if dtype == jnp.float32 else 1e-2
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32), rtol=tol, atol=tol)
    lowered = jax.jit(lambda x: native(x)).lower(x).as_text()
    assert "jaxserve_matvec" in lowered
    assert "jaxserve_matvec" not in jax.jit(lambda x: native(jnp.concatenate([x, x]))).lower(x).as_text()
