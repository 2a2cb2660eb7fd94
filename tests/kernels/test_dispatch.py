"""kernels_pallas.dispatch: which backend a platform gets, and that each name reaches its kernel.

"Reaches its kernel" is checked by lowering the dispatcher for the kernel's platform on
this CPU-only machine and counting the Pallas custom calls; the kernels' numerics are
tested in test_pallas_gpu.py / test_pallas_tpu.py.
"""

from __future__ import annotations

import jax.numpy as jnp
import pytest

from kernels_pallas import ragged_paged_attention, resolve_attention_backend
from tests.kernels.pallas_cases import batch, lowered_text


@pytest.mark.parametrize("requested, platform, expected", [
    ("auto", "cpu", "cpu"),
    ("auto", "gpu", "pallas_gpu"),
    ("auto", "tpu", "pallas_tpu"),
    ("reference", "gpu", "reference"),
    ("reference", "cpu", "reference"),
    ("cpu", "gpu", "cpu"),
    ("pallas_gpu", "gpu", "pallas_gpu"),
    ("pallas_tpu", "tpu", "pallas_tpu"),
])
def test_resolve_attention_backend(requested, platform, expected):
    assert resolve_attention_backend(requested, platform) == expected


@pytest.mark.parametrize("requested, platform, message", [
    ("pallas_gpu", "cpu", "'pallas_gpu' needs an NVIDIA GPU, but JAX's devices here are 'cpu'; "
                          "available: 'auto', 'reference', 'cpu'$"),
    ("pallas_tpu", "gpu", "'pallas_tpu' needs a TPU, but JAX's devices here are 'gpu'; "
                          "available: 'auto', 'reference', 'cpu', 'pallas_gpu'$"),
    ("flash", "gpu", "attention_backend='flash' must be 'auto' or one of"),
])
def test_unavailable_backend_names_what_is_available(requested, platform, message):
    with pytest.raises(ValueError, match=message):
        resolve_attention_backend(requested, platform)


@pytest.mark.parametrize("backend, platform, custom_call, count", [
    ("reference", "cuda", "custom_call @__gpu$xla.gpu.triton", 0),
    ("pallas_gpu", "cuda", "custom_call @__gpu$xla.gpu.triton", 2),   # decode items + prefill tiles
    ("pallas_tpu", "tpu", "custom_call @tpu_custom_call", 2),
])
def test_backend_name_reaches_its_kernel(backend, platform, custom_call, count):
    args = batch("mixed", group=4, head_dim=128, dtype=jnp.bfloat16, page_size=16)
    text = lowered_text(ragged_paged_attention, args, platform, backend=backend, sm_scale=0.1)
    assert sum(custom_call in line for line in text.splitlines()) == count


def test_cpu_backend_needs_this_steps_keys():
    with pytest.raises(ValueError, match="backend='cpu' reads this step's keys in place: pass k= and v="):
        ragged_paged_attention(*batch("padding"), backend="cpu", sm_scale=0.1)


def test_unknown_backend_raises():
    with pytest.raises(ValueError, match="backend='flash' must be one of"):
        ragged_paged_attention(*batch("padding"), backend="flash", sm_scale=0.1)
