"""--attention-backend at engine start: resolution by platform, refusals, and the built engine's model.

The refusal of a Pallas backend on this CPU-only machine through `LLM(...)` is in
test_llm.py (test_options_not_built_yet_fail_loudly); here the resolution rules, with
the platform passed in so GPU and TPU machines can be described on a CPU.
"""

from __future__ import annotations

import pytest

from jaxserve.config import EngineConfig
from jaxserve.engine.builder import resolve_attention_backend


@pytest.mark.parametrize("requested, platform, tp, expected", [
    ("auto", None, 1, "cpu"),                   # this machine: CPU
    ("reference", None, 1, "reference"),
    ("auto", "gpu", 1, "pallas_gpu"),
    ("auto", "tpu", 1, "pallas_tpu"),
    ("pallas_gpu", "gpu", 1, "pallas_gpu"),
    ("auto", "gpu", 2, "pallas_gpu"),           # with tp the kernel runs per device over its heads
    ("pallas_tpu", "tpu", 4, "pallas_tpu"),
    ("reference", "tpu", 2, "reference"),
    ("cpu", "gpu", 1, "cpu"),
])
def test_resolution(requested, platform, tp, expected):
    # The rules only: the Pallas self-check (interpreted here) is tested in tests/kernels/test_self_check.py.
    config = EngineConfig(attention_backend=requested, tensor_parallel_size=tp, attention_self_check=False)
    assert resolve_attention_backend(config, platform) == expected


@pytest.mark.parametrize("requested, platform, tp, message", [
    ("pallas_gpu", None, 1, "'pallas_gpu' needs an NVIDIA GPU, but JAX's devices here are 'cpu'; "
                            "available: 'auto', 'reference', 'cpu'"),
    ("pallas_tpu", "gpu", 1, "'pallas_tpu' needs a TPU.* available: 'auto', 'reference', 'cpu', 'pallas_gpu'"),
])
def test_refusals_name_what_is_available(requested, platform, tp, message):
    config = EngineConfig(attention_backend=requested, tensor_parallel_size=tp)
    with pytest.raises(ValueError, match=message):
        resolve_attention_backend(config, platform)


def test_auto_engine_on_cpu_runs_the_cpu_path(tiny_engine):
    """The shared engine (attention_backend "auto") built its model with the CPU attention path."""
    assert tiny_engine.config.attention_backend == "auto"
    assert tiny_engine.model_config.attention_backend == "cpu"
