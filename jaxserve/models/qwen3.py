"""Qwen3 (dense) causal LM: Llama plus per-head RMSNorm on q and k before RoPE.

`from_hf_config` sets `qk_norm=True` for model_type "qwen3"; `layers.Attention` then
holds `q_norm` / `k_norm` (weights [head_dim]). Biases follow `attention_bias`.
"""

from __future__ import annotations

import jax.numpy as jnp
from flax import nnx

from jaxserve.models.config import ModelConfig
from jaxserve.models.llama import LlamaForCausalLM


class Qwen3ForCausalLM(LlamaForCausalLM):
    """Qwen3 dense decoder; same forward and interface as `LlamaForCausalLM`."""

    def __init__(self, config: ModelConfig, *, dtype=jnp.float32, param_dtype=jnp.float32, rngs: nnx.Rngs):
        if not config.qk_norm:
            raise ValueError(
                f"Qwen3ForCausalLM needs qk_norm=True (model_type 'qwen3'), got model_type {config.model_type!r}"
            )
        super().__init__(config, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
