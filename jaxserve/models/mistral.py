"""Mistral causal LM: Llama with sliding-window attention on every layer.

`from_hf_config` puts the window (`sliding_window`, null for none) on every layer;
attention then lets a query at position p see keys at positions p - window + 1 .. p,
as Hugging Face's sliding-window causal mask does.
"""

from __future__ import annotations

from jaxserve.models.llama import LlamaForCausalLM


class MistralForCausalLM(LlamaForCausalLM):
    """Mistral decoder; same forward and interface as `LlamaForCausalLM`."""
