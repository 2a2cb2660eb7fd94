"""Device mesh and partition rules for params and the KV pool."""

from sharding.mesh import KV_CACHE_SPEC, kv_cache_sharding, make_mesh, replicated

__all__ = ["KV_CACHE_SPEC", "kv_cache_sharding", "make_mesh", "replicated"]
