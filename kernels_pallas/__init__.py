"""Attention kernels for jaxserve: ragged paged attention over a paged KV cache.

Kernels take arrays and static knobs and never import `jaxserve`. One op, three
backends: the pure-jnp reference (the CPU production path and the oracle), a Pallas
GPU kernel (`ragged_paged_attention_gpu`, Triton lowering, H100/H200) and a Pallas TPU
kernel (`ragged_paged_attention_tpu`); `ragged_paged_attention(..., backend=...)`
dispatches by name. Block sizes live in `tuning`; `work_items` is what the two Pallas
kernels share.
"""

from kernels_pallas.dispatch import (ATTENTION_BACKENDS, kv_pool_dtype, ragged_paged_attention,
                                     resolve_attention_backend)
from kernels_pallas.ragged_paged_attention import (
    check_ragged_paged_attention_inputs,
    ragged_paged_attention_reference,
    write_kv_cache,
)

__all__ = [
    "ATTENTION_BACKENDS",
    "check_ragged_paged_attention_inputs",
    "kv_pool_dtype",
    "ragged_paged_attention",
    "ragged_paged_attention_reference",
    "resolve_attention_backend",
    "write_kv_cache",
]
