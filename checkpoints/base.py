"""What every loader returns: a `Checkpoint`, plain numpy tensors under Hugging Face names.

Loaders (HF folder, GGUF file, the default model) all end in a `Checkpoint`; the runner
turns its tensors into device arrays and the tokenizer wrapper reads its tokenizer files.
Nothing here imports jax.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import numpy as np


class CheckpointError(ValueError):
    """A model path, file or its contents cannot be loaded; the message names the file."""


@dataclasses.dataclass(frozen=True)
class Checkpoint:
    name: str  # model name, e.g. "SmolLM2-135M-Instruct" (served model name default)
    config: dict[str, Any]  # HF config.json contents; always has "architectures"
    tensors: Mapping[str, np.ndarray]  # HF parameter names -> arrays in torch layout (out, in); may be memory-mapped
    tokenizer_json: str  # path of a `tokenizers` tokenizer.json
    tokenizer_config: dict[str, Any]  # tokenizer_config.json (chat_template, bos_token, eos_token, ...)
    generation_config: dict[str, Any] = dataclasses.field(default_factory=dict)  # may be empty
    path: str = ""  # folder the checkpoint was read from (for a GGUF: its converted folder)
    params_path: str = ""  # an Orbax checkpoint's params (already in the model's layout); tensors is then empty

    @property
    def architecture(self) -> str:
        """The first entry of config["architectures"], e.g. "LlamaForCausalLM"."""
        return self.config["architectures"][0]
