"""Llama-family decoders in flax nnx (Llama, Qwen2, Qwen3, Mistral) and their loading.

`ModelConfig.from_hf_config` reads config.json, `get_model_class` picks the class from
its architectures, `load_weights` copies HF checkpoint tensors into the params.
"""

from jaxserve.models.config import ModelConfig
from jaxserve.models.llama import LlamaForCausalLM
from jaxserve.models.metadata import AttentionMetadata
from jaxserve.models.mistral import MistralForCausalLM
from jaxserve.models.qwen2 import Qwen2ForCausalLM
from jaxserve.models.qwen3 import Qwen3ForCausalLM
from jaxserve.models.registry import MODEL_CLASSES, get_model_class, load_weights

__all__ = [
    "AttentionMetadata",
    "LlamaForCausalLM",
    "MODEL_CLASSES",
    "MistralForCausalLM",
    "ModelConfig",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
    "get_model_class",
    "load_weights",
]
