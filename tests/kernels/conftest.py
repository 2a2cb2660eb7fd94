"""The Pallas kernel tests' one switch: interpret mode (the default, on any machine) or the device.

`pytest tests/kernels/test_pallas_gpu.py --pallas-on-device` on a GPU (test_pallas_tpu.py on a
TPU) runs the same cases with the kernels compiled for the device; benchmarks/device_check.sh
does that. A module says which platform its kernel needs with `DEVICE_PLATFORM`.
"""

from __future__ import annotations

import jax
import pytest


@pytest.fixture(scope="module")
def pallas_interpret(request) -> bool:
    """True (interpret mode) unless --pallas-on-device; then the module's DEVICE_PLATFORM must be JAX's."""
    if not request.config.getoption("--pallas-on-device"):
        return True
    want, have = request.module.DEVICE_PLATFORM, jax.devices()[0].platform
    if have != want:
        pytest.fail(f"--pallas-on-device: {request.module.__name__} runs its kernel on a {want!r} device, "
                    f"but JAX's devices here are {have!r}", pytrace=False)
    return False
