"""The device mesh and the placement of params and the KV pool on it.

Axes are ("dp", "tp"). Each data-parallel replica runs on one row of the mesh (its own
(1, tp) sub-mesh, `replica_meshes`); params follow `sharding.rules.PARAM_RULES` and the KV
pool is split over KV heads on `tp`.
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


def replica_meshes(mesh: Mesh) -> list[Mesh]:
    """One ("dp", "tp") mesh of size (1, tp) per data-parallel replica (each row of `mesh`)."""
    return [Mesh(mesh.devices[i:i + 1], mesh.axis_names, axis_types=mesh.axis_types)
            for i in range(mesh.devices.shape[0])]
