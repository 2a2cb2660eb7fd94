"""Weights a caller already holds, in the engine's layout: for `LLM(params=...)` and `update_params`.

A caller's params come as one of
- an nnx Module or State of the engine's model classes (`nnx.state(model)`),
- a pure dict of it (`nnx.to_pure_dict(state)`: {"layers": {0: {"mlp": ...}}, ...}),
- a flat dict of Hugging Face names ("model.layers.0.mlp.up_proj.weight": array, torch layout),
and become {param path: array} in the engine's layout. Arrays stay where they are: a
Hugging Face tensor is reshaped by jnp ops (on its device), and placing the result on
the engine's sharding is `jax.device_put`, which copies nothing when it is already there.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxserve.models import ModelConfig
from jaxserve.models.registry import checkpoint_name_table

Path = tuple[str | int, ...]


def path_name(path: Path) -> str:
    return ".".join(str(p) for p in path)


def flat_params(params: Any, model_config: ModelConfig) -> dict[Path, Any]:
    """{param path: array} of a caller's params, in any of the module's accepted forms."""
    if isinstance(params, nnx.Module):
        params = nnx.state(params, nnx.Param)
    if isinstance(params, nnx.State):
        params = nnx.to_pure_dict(params)
    if not isinstance(params, Mapping) or not params:
        raise ValueError(f"params must be an nnx Module or State, a dict of them, or a dict of Hugging Face tensor "
                         f"names; got {type(params).__name__}{' (empty)' if isinstance(params, Mapping) else ''}")
    if all(isinstance(k, str) and "." in k for k in params):
        return _from_hf_names(params, model_config)
    flat = nnx.traversals.flatten_mapping(params)
    return {tuple(int(p) if isinstance(p, str) and p.isdigit() else p for p in path): v for path, v in flat.items()}


def _from_hf_names(tensors: Mapping[str, Any], config: ModelConfig) -> dict[Path, Any]:
    table = checkpoint_name_table(config)
    ignorable = {"lm_head.weight"} if config.tie_word_embeddings else set()
    unknown = sorted(n for n in tensors if n not in table and n not in ignorable)
    if unknown:
        raise ValueError(f"params name {len(unknown)} tensor(s) the model does not have: {', '.join(unknown[:5])}")
    out = {}
    for name, value in tensors.items():
        if name in ignorable:
            continue
        path, transform = table[name]
        out[tuple(int(p) if p.isdigit() else p for p in path.split("."))] = transform(_array(name, value), config)
    return out


def _array(name: str, value: Any):
    if isinstance(value, jax.Array):
        if value.is_deleted():
            raise ValueError(f"param {name} is a deleted jax.Array (donated or deleted by the caller); pass arrays "
                             "that are still alive")
        return value
    if isinstance(value, np.ndarray) or np.isscalar(value):
        return np.asarray(value)
    raise ValueError(f"param {name} is a {type(value).__name__}, not an array")


def checked_update(current: dict[Path, jax.Array | jax.ShapeDtypeStruct], new: dict[Path, Any], *,
                   cast: bool) -> dict[Path, jax.Array]:
    """`new` checked against `current` (known paths, same shapes; same dtypes unless `cast`) and
    placed on each current array's sharding (left where it is when that is None). Raises ValueError
    naming the first mismatch; nothing is placed before everything was checked."""
    for path, value in new.items():
        name = path_name(path)
        if path not in current:
            raise ValueError(f"params have {name}, which the model does not have")
        value = _array(name, value)
        old = current[path]
        if tuple(value.shape) != tuple(old.shape):
            raise ValueError(f"param {name} has shape {tuple(value.shape)}; the model's is {tuple(old.shape)}")
        if not cast and value.dtype != old.dtype:
            raise ValueError(f"param {name} has dtype {value.dtype}; the engine's is {old.dtype} "
                             "(an update keeps shapes and dtypes)")
        new[path] = value
    placed = {}
    for path, value in new.items():
        target = current[path]
        if value.dtype != target.dtype:
            value = value.astype(target.dtype)
        if target.sharding is not None:
            value = jax.device_put(value, target.sharding)
        elif not isinstance(value, jax.Array):
            value = jnp.asarray(value)     # host arrays go to the default device (the runner places them)
        placed[path] = value
    return placed
