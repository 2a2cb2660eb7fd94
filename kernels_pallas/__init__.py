"""Attention kernels for jaxserve: ragged paged attention over a paged KV cache.

Kernels take arrays and static knobs and never import `jaxserve`. For now this holds the
pure-jnp reference, which is also the CPU production path.
"""

from kernels_pallas.ragged_paged_attention import (
    check_ragged_paged_attention_inputs,
    ragged_paged_attention_reference,
    write_kv_cache,
)

__all__ = [
    "check_ragged_paged_attention_inputs",
    "ragged_paged_attention_reference",
    "write_kv_cache",
]
