"""Device mesh and partition rules for params and the KV pool."""

from sharding.mesh import KV_CACHE_SPEC, kv_cache_sharding, make_mesh, replica_meshes, replicated
from sharding.rules import (PARAM_RULES, check_tensor_parallel, kv_head_replicas, param_shardings,
                            replicate_kv_heads, shard_params, spec_for)

__all__ = ["KV_CACHE_SPEC", "PARAM_RULES", "check_tensor_parallel", "kv_cache_sharding", "kv_head_replicas",
           "make_mesh", "param_shardings", "replica_meshes", "replicate_kv_heads", "replicated", "shard_params",
           "spec_for"]
