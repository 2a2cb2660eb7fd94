"""Ragged paged attention by backend name, and which backend a platform gets.

What flows through: the engine resolves its `--attention-backend` once at start-up
(`resolve_attention_backend`, on the caller's thread); the model then calls
`ragged_paged_attention(..., backend=...)` inside its jitted step with that static
name. The Pallas modules are imported only when their backend is traced, so the CPU
path never loads them. Under a mesh with a "tp" axis (tensor parallelism) every backend
runs per device over that device's heads (shard_map), so no device gathers the cache.

Backends: "reference" (pure jnp; the kernels' oracle), "cpu" (the CPU production path:
decodes through a native FFI kernel that reads pages in place, longer runs in jnp that read
this step's keys without pages; `ragged_paged_attention_cpu`), "pallas_gpu"
(Triton-lowered Pallas kernel, NVIDIA GPUs), "pallas_tpu" (Mosaic Pallas kernel, TPUs).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from kernels_pallas.ragged_paged_attention import ragged_paged_attention_reference
from kernels_pallas.ragged_paged_attention_cpu import ragged_paged_attention_cpu

ATTENTION_BACKENDS = ("reference", "cpu", "pallas_gpu", "pallas_tpu")
# Mesh axis that splits attention heads (tensor parallelism). Traced under a mesh with this
# axis (the runner sets its mesh), the op runs per device on its heads through shard_map.
KV_HEAD_AXIS = "tp"
# JAX platform name -> the backend "auto" picks there; anything else gets "cpu" (pure jnp).
_PLATFORM_BACKENDS = {"gpu": "pallas_gpu", "tpu": "pallas_tpu"}


def resolve_attention_backend(requested: str, platform: str) -> str:
    """'auto' -> the backend for `platform` (a JAX platform: "cpu", "gpu", "tpu"); others checked against it.

    Raises ValueError naming the request and what this platform offers when a Pallas
    backend is asked for on a machine without its device.
    """
    available = ["reference", "cpu"] + ([_PLATFORM_BACKENDS[platform]] if platform in _PLATFORM_BACKENDS else [])
    if requested == "auto":
        return available[-1]
    if requested not in ATTENTION_BACKENDS:
        raise ValueError(f"attention_backend={requested!r} must be 'auto' or one of {ATTENTION_BACKENDS}")
    if requested not in available:
        device = {"pallas_gpu": "an NVIDIA GPU", "pallas_tpu": "a TPU"}[requested]
        raise ValueError(f"attention_backend={requested!r} needs {device}, but JAX's devices here are "
                         f"{platform!r}; available: 'auto', {', '.join(repr(b) for b in available)}")
    return requested


def kv_pool_dtype(dtype, backend: str):
    """The dtype the KV pool is stored in for `backend`, given the model's KV `dtype`.

    The pure-jnp backends store 16-bit floats as their uint16 bits: XLA:CPU has no bfloat16
    scatter or gather and would convert every layer's whole pool to float32 twice a step.
    It reads and writes those bits as the queries' own float type. Pallas backends keep
    the float type.
    """
    dtype = jnp.dtype(dtype)
    if backend in ("reference", "cpu") and jnp.issubdtype(dtype, jnp.floating) and dtype.itemsize == 2:
        return jnp.dtype(jnp.uint16)
    return dtype


def ragged_paged_attention(
    q,                # [T, num_q_heads, head_dim]
    kv_cache,         # [2, num_kv_heads, num_blocks, block_size, head_dim], holds this step's K/V
    block_tables,     # [S, max_blocks_per_seq] int32
    context_lens,     # [S] int32
    query_start_loc,  # [S + 1] int32
    num_seqs,         # [] int32
    *,
    backend: str,
    sm_scale: float,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
    interpret: bool = False,
    k=None,           # [T, num_kv_heads, head_dim] this step's keys: needed by "cpu", ignored by the others
    v=None,           # [T, num_kv_heads, head_dim] this step's values
    q_rope=None,      # (q before RoPE, cos, sin): "cpu" may rotate q itself (unsharded); the others ignore it
) -> jax.Array:
    """The backend's ragged paged attention -> [T, num_q_heads, head_dim] (same contract for all).

    `interpret` runs a Pallas backend in its interpreter (CPU tests); the others ignore it.
    `q_rope` (q's values before the rotate-half RoPE [T, num_q_heads, head_dim], cos and sin
    [T, head_dim]; `q` is what they give): the `cpu` backend's native kernel may take these instead
    of q (a bf16 q rotated on its way in, the same bits: `ragged_paged_attention_cpu`).
    """
    if backend == "cpu" and (k is None or v is None):
        raise ValueError("backend='cpu' reads this step's keys in place: pass k= and v= ([T, num_kv_heads, head_dim])")
    if k is None:
        k = v = jnp.zeros((q.shape[0], kv_cache.shape[1], 0), q.dtype)   # unused by this backend
    args = (q, k, v, kv_cache, block_tables, context_lens, query_start_loc, num_seqs)
    mesh = jax.sharding.get_abstract_mesh()
    sharded = not mesh.empty and mesh.shape.get(KV_HEAD_AXIS, 1) > 1
    kernel = functools.partial(_one_shard, backend=backend, sm_scale=sm_scale, sliding_window=sliding_window,
                               soft_cap=soft_cap, interpret=interpret,
                               q_rope=q_rope if backend == "cpu" and not sharded else None)
    if sharded:
        # Tensor parallel: each device attends with its own query heads over its own KV heads
        # (heads are split into contiguous groups, so a device's query heads read only its KV heads).
        heads = P(None, KV_HEAD_AXIS, None)
        kernel = jax.shard_map(kernel, mesh=mesh,
                               in_specs=(heads, heads, heads, P(None, KV_HEAD_AXIS), P(), P(), P(), P()),
                               out_specs=heads, check_vma=False)
    return kernel(*args)


def _one_shard(q, k, v, kv_cache, block_tables, context_lens, query_start_loc, num_seqs, *, backend, sm_scale,
               sliding_window, soft_cap, interpret, q_rope=None):
    args = (q, kv_cache, block_tables, context_lens, query_start_loc, num_seqs)
    masks = dict(sm_scale=sm_scale, sliding_window=sliding_window, soft_cap=soft_cap)
    if backend == "reference":
        return ragged_paged_attention_reference(*args, **masks)
    if backend == "cpu":
        return ragged_paged_attention_cpu(q, k, v, *args[1:], **masks, q_rope=q_rope)
    if backend == "pallas_gpu":
        from kernels_pallas.ragged_paged_attention_gpu import ragged_paged_attention_gpu
        return ragged_paged_attention_gpu(*args, **masks, interpret=interpret)
    if backend == "pallas_tpu":
        from kernels_pallas.ragged_paged_attention_tpu import ragged_paged_attention_tpu
        return ragged_paged_attention_tpu(*args, **masks, interpret=interpret)
    raise ValueError(f"backend={backend!r} must be one of {ATTENTION_BACKENDS}")
