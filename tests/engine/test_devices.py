"""What the device decides at start-up: `--dtype auto` and the KV pool's size (fake memory reports)."""

import pytest

from jaxserve.config import EngineConfig
from jaxserve.engine.devices import activation_bytes, kv_pool_bytes, resolve_dtype

GiB = 2**30


@pytest.mark.parametrize("platform,flags,want", [
    ("gpu", set(), "bfloat16"), ("tpu", set(), "bfloat16"), ("cuda", set(), "bfloat16"),
    ("cpu", {"avx2", "avx512f", "avx512_bf16"}, "bfloat16"), ("cpu", {"amx_bf16"}, "bfloat16"),
    ("cpu", {"avx2", "avx512f"}, "float32"), ("cpu", set(), "float32"),
])
def test_dtype_auto_by_device(platform, flags, want):
    assert resolve_dtype("auto", platform, flags) == want
    assert resolve_dtype("float16", platform, flags) == "float16"      # an explicit dtype is kept


def test_the_pool_takes_what_the_utilization_leaves():
    h100 = {"bytes_limit": 80 * GiB, "bytes_in_use": 16 * GiB}           # 16 GiB of weights placed
    budget, how = kv_pool_bytes(h100, gpu_memory_utilization=0.9, activations=2 * GiB, kv_cache_memory_gb=None)
    assert budget == int(0.9 * 80 * GiB) - 16 * GiB - 2 * GiB
    assert "--gpu-memory-utilization 0.9" in how
    smaller, _ = kv_pool_bytes(h100, gpu_memory_utilization=0.5, activations=2 * GiB, kv_cache_memory_gb=None)
    assert smaller == 40 * GiB - 18 * GiB


def test_an_explicit_budget_and_cpu_fall_back_and_no_room_is_refused():
    assert kv_pool_bytes({"bytes_limit": GiB}, gpu_memory_utilization=0.9, activations=0,
                         kv_cache_memory_gb=3.0)[0] == 3 * GiB
    assert kv_pool_bytes(None, gpu_memory_utilization=0.9, activations=0, kv_cache_memory_gb=None)[0] == GiB
    with pytest.raises(ValueError, match="leaves no room for a KV pool"):
        kv_pool_bytes({"bytes_limit": 10 * GiB, "bytes_in_use": 9 * GiB}, gpu_memory_utilization=0.9,
                      activations=GiB, kv_cache_memory_gb=None)


def test_activation_estimate_grows_with_the_budget_and_the_vocabulary():
    kw = dict(max_num_seqs=64, hidden_size=576, intermediate_size=1536, vocab_size=49152, itemsize=2)
    small, big = activation_bytes(max_num_batched_tokens=512, **kw), activation_bytes(max_num_batched_tokens=8192, **kw)
    assert 0 < small < big


def test_config_checks():
    assert EngineConfig().dtype == "auto" and EngineConfig().kv_cache_memory_gb is None
    for bad in (0, 1.5, -0.1):
        with pytest.raises(ValueError, match="gpu_memory_utilization"):
            EngineConfig(gpu_memory_utilization=bad)
    with pytest.raises(ValueError, match="dtype"):
        EngineConfig(dtype="int8")


def test_the_engine_resolves_auto_and_logs_the_pool(tiny_models, caplog):
    from jaxserve.engine.llm_engine import LLMEngine

    caplog.set_level("INFO")
    engine = LLMEngine.from_kwargs(str(tiny_models["llama"]), max_num_batched_tokens=16, max_num_seqs=4,
                                   max_model_len=64, kv_cache_memory_gb=0.001, token_buckets=(16,))
    assert engine.config.dtype in ("float32", "bfloat16")
    assert engine.config.dtype == resolve_dtype("auto", "cpu")
    assert "KV pool:" in caplog.text and "at most" in caplog.text and "--kv-cache-memory-gb 0.001" in caplog.text
