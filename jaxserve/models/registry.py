"""Architecture -> model class, and HF checkpoint tensors -> model params.

`get_model_class(config)` picks the nnx class from the config's `architectures`.
`load_weights(model, tensors)` copies Hugging Face checkpoint tensors (numpy, torch
layout: Linear weights are (out, in)) into the model's params, driven by one name table
(`checkpoint_name_table`) from HF names to param paths and the reshape each needs.
Runs on the host, once, before the first step.
"""

from __future__ import annotations

from typing import Callable, Mapping

import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxserve.models.config import ModelConfig
from jaxserve.models.llama import LlamaForCausalLM
from jaxserve.models.mistral import MistralForCausalLM
from jaxserve.models.qwen2 import Qwen2ForCausalLM
from jaxserve.models.qwen3 import Qwen3ForCausalLM

MODEL_CLASSES: dict[str, type[LlamaForCausalLM]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": MistralForCausalLM,
    "Qwen2ForCausalLM": Qwen2ForCausalLM,
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
}

# Checkpoint tensors that carry no parameters (old Llama checkpoints store RoPE buffers).
_IGNORED_SUFFIXES = (".rotary_emb.inv_freq",)


def get_model_class(config: ModelConfig) -> type[LlamaForCausalLM]:
    """The model class for the first supported name in `config.architectures`."""
    for arch in config.architectures:
        if arch in MODEL_CLASSES:
            return MODEL_CLASSES[arch]
    raise ValueError(
        f"unsupported architecture {', '.join(config.architectures) or '(none)'}; "
        f"supported: {', '.join(sorted(MODEL_CLASSES))}"
    )


# How a torch-layout tensor becomes a param, given (tensor, config).
Transform = Callable[[np.ndarray, ModelConfig], np.ndarray]


def _same(w, c):
    return w


def _transpose(w, c):            # Linear (out, in) -> (in, out)
    return w.T


def _q_kernel(w, c):             # (heads * head_dim, hidden) -> [hidden, heads, head_dim]
    return w.reshape(c.num_attention_heads, c.head_dim, -1).transpose(2, 0, 1)


def _kv_kernel(w, c):            # (kv_heads * head_dim, hidden) -> [hidden, kv_heads, head_dim]
    return w.reshape(c.num_key_value_heads, c.head_dim, -1).transpose(2, 0, 1)


def _q_bias(w, c):               # (heads * head_dim,) -> [heads, head_dim]
    return w.reshape(c.num_attention_heads, c.head_dim)


def _kv_bias(w, c):              # (kv_heads * head_dim,) -> [kv_heads, head_dim]
    return w.reshape(c.num_key_value_heads, c.head_dim)


def _o_kernel(w, c):             # (hidden, heads * head_dim) -> [heads, head_dim, hidden]
    return w.reshape(-1, c.num_attention_heads, c.head_dim).transpose(1, 2, 0)


def checkpoint_name_table(config: ModelConfig) -> dict[str, tuple[str, Transform]]:
    """HF tensor name -> (dotted param path in the model, transform), for this config."""
    table: dict[str, tuple[str, Transform]] = {
        "model.embed_tokens.weight": ("embed_tokens.embedding", _same),
        "model.norm.weight": ("norm.weight", _same),
    }
    if not config.tie_word_embeddings:
        table["lm_head.weight"] = ("lm_head", _same)
    per_layer: dict[str, tuple[str, Transform]] = {
        "input_layernorm.weight": ("input_layernorm.weight", _same),
        "post_attention_layernorm.weight": ("post_attention_layernorm.weight", _same),
        "self_attn.q_proj.weight": ("self_attn.q_proj.kernel", _q_kernel),
        "self_attn.k_proj.weight": ("self_attn.k_proj.kernel", _kv_kernel),
        "self_attn.v_proj.weight": ("self_attn.v_proj.kernel", _kv_kernel),
        "self_attn.o_proj.weight": ("self_attn.o_proj.kernel", _o_kernel),
        "mlp.gate_proj.weight": ("mlp.gate_proj.kernel", _transpose),
        "mlp.up_proj.weight": ("mlp.up_proj.kernel", _transpose),
        "mlp.down_proj.weight": ("mlp.down_proj.kernel", _transpose),
    }
    if config.attention_bias:
        per_layer["self_attn.q_proj.bias"] = ("self_attn.q_proj.bias", _q_bias)
        per_layer["self_attn.k_proj.bias"] = ("self_attn.k_proj.bias", _kv_bias)
        per_layer["self_attn.v_proj.bias"] = ("self_attn.v_proj.bias", _kv_bias)
    if config.o_proj_bias:
        per_layer["self_attn.o_proj.bias"] = ("self_attn.o_proj.bias", _same)
    if config.mlp_bias:
        for proj in ("gate_proj", "up_proj", "down_proj"):
            per_layer[f"mlp.{proj}.bias"] = (f"mlp.{proj}.bias", _same)
    if config.qk_norm:
        per_layer["self_attn.q_norm.weight"] = ("self_attn.q_norm.weight", _same)
        per_layer["self_attn.k_norm.weight"] = ("self_attn.k_norm.weight", _same)
    for i in range(config.num_hidden_layers):
        for hf_suffix, (path, transform) in per_layer.items():
            table[f"model.layers.{i}.{hf_suffix}"] = (f"layers.{i}.{path}", transform)
    return table


def _param(model: nnx.Module, path: str) -> nnx.Variable:
    node = model
    for part in path.split("."):
        node = node[int(part)] if part.isdigit() else getattr(node, part)
    return node


def load_weights(model: LlamaForCausalLM, tensors: Mapping[str, np.ndarray]) -> None:
    """Copy HF checkpoint tensors into `model`'s params in place (cast to the param dtype).

    Raises ValueError naming missing, unexpected or wrongly shaped tensors. With tied
    embeddings the lm head is the embedding table, so a stored `lm_head.weight` is ignored.
    """
    config = model.config
    table = checkpoint_name_table(config)
    missing = sorted(set(table) - set(tensors))
    if missing:
        raise ValueError(f"checkpoint is missing {len(missing)} tensor(s): {', '.join(missing)}")
    ignorable = {"lm_head.weight"} if config.tie_word_embeddings else set()
    unexpected = sorted(
        name for name in tensors
        if name not in table and name not in ignorable and not name.endswith(_IGNORED_SUFFIXES)
    )
    if unexpected:
        raise ValueError(f"checkpoint has {len(unexpected)} unexpected tensor(s): {', '.join(unexpected)}")
    for name, (path, transform) in table.items():
        var = _param(model, path)
        try:
            value = transform(np.asarray(tensors[name]), config)
        except ValueError:  # a reshape that does not fit
            value = None
        if value is None or value.shape != var.shape:
            raise ValueError(
                f"checkpoint tensor {name} has shape {tuple(np.shape(tensors[name]))}, "
                f"which does not fit param {path} of shape {tuple(var.shape)}"
            )
        var.set_value(jnp.asarray(value, dtype=var.dtype))   # also fills an abstract (eval_shape) model
