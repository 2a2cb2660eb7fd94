"""What the device decides at start-up: `--dtype auto` and the KV pool's size.

- dtype "auto": bfloat16 on GPUs and TPUs; on a CPU, bfloat16 when it has bf16 dot
  instructions (AVX512-BF16 or AMX-BF16: there XLA:CPU runs the default model's
  workloads 1.3-1.5x faster in bfloat16, benchmarks/RESULTS.md issue 12), else float32.
- KV pool: `--num-kv-blocks` or `--kv-cache-memory-gb` when given; else, on a device
  that reports its memory (GPU, TPU), `--gpu-memory-utilization` x its memory minus
  what is already in use (the weights) and an estimate of the step's activations, as
  vLLM sizes it; else (CPU) 1 GiB.
"""

from __future__ import annotations

import logging
from pathlib import Path

logger = logging.getLogger(__name__)

CPU_POOL_GB = 1.0
_BF16_CPU_FLAGS = ("avx512_bf16", "amx_bf16")


def cpu_flags() -> set[str]:
    """The CPU's feature flags (Linux /proc/cpuinfo; empty where unknown)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def resolve_dtype(dtype: str, platform: str, flags: set[str] | None = None) -> str:
    """A concrete dtype for `dtype` ("auto" or one) on `platform` ("cpu", "gpu", "tpu", ...)."""
    if dtype != "auto":
        return dtype
    if platform != "cpu":
        return "bfloat16"
    flags = cpu_flags() if flags is None else flags
    return "bfloat16" if any(f in flags for f in _BF16_CPU_FLAGS) else "float32"


def activation_bytes(*, max_num_batched_tokens: int, max_num_seqs: int, hidden_size: int, intermediate_size: int,
                     vocab_size: int, itemsize: int) -> int:
    """A generous estimate of one step's transient memory: a few [tokens, hidden] and
    [tokens, intermediate] buffers per layer in flight, and float32 logits of every sequence."""
    per_token = (6 * hidden_size + 3 * intermediate_size) * itemsize
    return max_num_batched_tokens * per_token + 3 * max_num_seqs * vocab_size * 4


def kv_pool_bytes(memory_stats: dict | None, *, gpu_memory_utilization: float, activations: int,
                  kv_cache_memory_gb: float | None) -> tuple[int, str]:
    """(bytes for the KV pool, how that was decided) for one device.

    `memory_stats` is `device.memory_stats()` (None on CPU), read after the weights are
    placed, so `bytes_in_use` counts them.
    """
    if kv_cache_memory_gb is not None:
        return int(kv_cache_memory_gb * 2**30), f"--kv-cache-memory-gb {kv_cache_memory_gb:g}"
    if not memory_stats or "bytes_limit" not in memory_stats:
        return int(CPU_POOL_GB * 2**30), f"{CPU_POOL_GB:g} GiB (the device reports no memory size)"
    limit, in_use = memory_stats["bytes_limit"], memory_stats.get("bytes_in_use", 0)
    budget = int(gpu_memory_utilization * limit) - in_use - activations
    if budget <= 0:
        raise ValueError(f"--gpu-memory-utilization {gpu_memory_utilization:g} of {limit / 2**30:.1f} GiB leaves no "
                         f"room for a KV pool: {in_use / 2**30:.2f} GiB are in use (weights) and the step needs "
                         f"~{activations / 2**30:.2f} GiB; raise it, lower --max-num-batched-tokens, or give "
                         "--num-kv-blocks")
    return budget, (f"--gpu-memory-utilization {gpu_memory_utilization:g} x {limit / 2**30:.1f} GiB - "
                    f"{in_use / 2**30:.2f} GiB in use - ~{activations / 2**30:.2f} GiB for the step")
