"""Qwen2 / Qwen2.5 causal LM: Llama with q/k/v biases (o_proj has none).

The differences are resolved into `ModelConfig` fields by `from_hf_config`
(`attention_bias=True`, `o_proj_bias=False`, and, only with `use_sliding_window`, a
sliding window on layers from `max_window_layers` on), so the Llama body serves as is.
"""

from __future__ import annotations

from jaxserve.models.llama import LlamaForCausalLM


class Qwen2ForCausalLM(LlamaForCausalLM):
    """Qwen2-family decoder; same forward and interface as `LlamaForCausalLM`."""
