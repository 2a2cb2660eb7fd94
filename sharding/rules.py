"""Where each param lives on the ("dp", "tp") mesh: a table of rules by logical role.

Tensor parallelism is Megatron-style, written as data: attention heads and MLP columns
are split over `tp` (column parallel), the output and down projections over their input
dimension (row parallel; XLA inserts the all-reduce), the embedding table over the
vocabulary (its gather and the tied lm head both stay exact), and norms replicated. The
KV pool is split over KV heads (`mesh.KV_CACHE_SPEC`).

When `tp` exceeds the model's KV head count, each KV head is replicated `tp // kv_heads`
times (`kv_head_replicas`), so every device holds one; `replicate_kv_heads` does it to the
k/v projection params after loading. Sizes that cannot be split evenly are refused by
`check_tensor_parallel` with the sizes that would work.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

# (pattern on the param path "layers.3.self_attn.q_proj.kernel", spec). First match wins.
PARAM_RULES: tuple[tuple[str, P], ...] = (
    (r"embed_tokens\.embedding$", P("tp", None)),             # [vocab, hidden]: vocab parallel
    (r"lm_head$", P("tp", None)),                              # [vocab, hidden]
    (r"self_attn\.[qkv]_proj\.kernel$", P(None, "tp", None)),  # [hidden, heads, head_dim]: heads
    (r"self_attn\.[qkv]_proj\.bias$", P("tp", None)),          # [heads, head_dim]
    (r"self_attn\.o_proj\.kernel$", P("tp", None, None)),      # [heads, head_dim, hidden]: row parallel
    (r"mlp\.(gate|up)_proj\.kernel$", P(None, "tp")),          # [hidden, intermediate]: columns
    (r"mlp\.(gate|up)_proj\.bias$", P("tp")),                  # [intermediate]
    (r"mlp\.down_proj\.kernel$", P("tp", None)),               # [intermediate, hidden]: row parallel
    (r".*", P()),                                              # norms, o/down biases: replicated
)


def spec_for(path: str, shape: tuple[int, ...], mesh: Mesh) -> P:
    """The rule's spec for one param, replicated along any dimension the axis does not divide."""
    for pattern, spec in PARAM_RULES:
        if re.search(pattern, path):
            break
    fitted = []
    for dim, axis in zip(shape, tuple(spec) + (None,) * (len(shape) - len(spec))):
        fitted.append(axis if axis is None or dim % mesh.shape[axis] == 0 else None)
    return P(*fitted)


def _path_str(key_path) -> str:
    parts = []
    for k in key_path:
        name = getattr(k, "key", getattr(k, "idx", getattr(k, "name", k)))
        if name != "value":   # nnx.Variable's own leaf
            parts.append(str(name))
    return ".".join(parts)


def param_shardings(params, mesh: Mesh):
    """A pytree like `params` (arrays or ShapeDtypeStructs) of NamedShardings by PARAM_RULES."""
    return jax.tree_util.tree_map_with_path(
        lambda kp, x: NamedSharding(mesh, spec_for(_path_str(kp), tuple(x.shape), mesh)), params)


def shard_params(params, mesh: Mesh):
    """Place params on `mesh` by PARAM_RULES (works across processes: each fills its own shards)."""
    shardings = param_shardings(params, mesh)
    if jax.process_count() == 1:
        return jax.device_put(params, shardings)

    def place(x, sharding):
        host = np.asarray(x)
        return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])
    return jax.tree.map(place, params, shardings)


def kv_head_replicas(num_key_value_heads: int, tensor_parallel_size: int) -> int:
    """How many copies of each KV head tensor parallelism needs (1 unless tp > KV heads)."""
    if tensor_parallel_size > num_key_value_heads:
        return tensor_parallel_size // num_key_value_heads
    return 1


def valid_tensor_parallel_sizes(num_attention_heads: int, num_key_value_heads: int, intermediate_size: int,
                                max_size: int) -> list[int]:
    return [tp for tp in range(1, max_size + 1)
            if num_attention_heads % tp == 0 and intermediate_size % tp == 0
            and (num_key_value_heads % tp == 0 or tp % num_key_value_heads == 0)]


def check_tensor_parallel(num_attention_heads: int, num_key_value_heads: int, intermediate_size: int,
                          tensor_parallel_size: int, num_devices: int) -> None:
    """ValueError unless heads, KV heads and MLP columns split evenly over `tensor_parallel_size`."""
    tp = tensor_parallel_size
    problems = []
    if num_attention_heads % tp:
        problems.append(f"{num_attention_heads} attention heads")
    if intermediate_size % tp:
        problems.append(f"intermediate_size {intermediate_size}")
    if num_key_value_heads % tp and tp % num_key_value_heads:
        problems.append(f"{num_key_value_heads} KV heads (tp must divide them or be a multiple of them)")
    if problems:
        valid = valid_tensor_parallel_sizes(num_attention_heads, num_key_value_heads, intermediate_size,
                                            max(num_devices, tp))
        raise ValueError(f"tensor_parallel_size={tp} does not split {', '.join(problems)} evenly; "
                         f"sizes that work for this model: {', '.join(map(str, valid))}")


def replicate_kv_heads(params: dict, replicas: int) -> dict:
    """Repeat every KV head `replicas` times in k/v projection params (a nested dict of arrays).

    Query head h reads KV head h // (heads // kv_heads); with each KV head repeated
    consecutively it reads copy h // (heads // (kv_heads * replicas)) of the same head.
    """
    if replicas == 1:
        return params

    def visit(node, path):
        if isinstance(node, dict):
            return {k: visit(v, path + (str(k),)) for k, v in node.items()}
        name = ".".join(path)
        if re.search(r"self_attn\.[kv]_proj\.kernel", name):
            return jnp.repeat(node, replicas, axis=1)      # [hidden, kv_heads, head_dim]
        if re.search(r"self_attn\.[kv]_proj\.bias", name):
            return jnp.repeat(node, replicas, axis=0)      # [kv_heads, head_dim]
        return node
    return visit(params, ())
