"""The device mesh and the placement of params and the KV pool on it.

Axes are ("dp", "tp"). Placement is data: a table of PartitionSpecs by logical role. With
one device every spec is trivially satisfied; tensor parallelism only adds rules here.
"""

from __future__ import annotations

import jax
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P

# KV pool per layer: [2, num_kv_heads, num_blocks, block_size, head_dim], split on KV heads.
KV_CACHE_SPEC = P(None, "tp", None, None, None)


def make_mesh(tensor_parallel_size: int = 1, data_parallel_size: int = 1, devices=None) -> Mesh:
    devices = list(jax.devices() if devices is None else devices)
    needed = tensor_parallel_size * data_parallel_size
    if needed > len(devices):
        raise ValueError(
            f"tensor_parallel_size={tensor_parallel_size} x data_parallel_size={data_parallel_size} needs "
            f"{needed} devices, but only {len(devices)} {devices[0].platform} device(s) are available")
    return jax.make_mesh((data_parallel_size, tensor_parallel_size), ("dp", "tp"),
                         axis_types=(AxisType.Auto, AxisType.Auto), devices=devices[:needed])


def kv_cache_sharding(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, KV_CACHE_SPEC)


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, P())
