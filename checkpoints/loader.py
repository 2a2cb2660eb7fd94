"""One entry point from a user's model argument to a `Checkpoint`.

None is the default model; a directory is a Hugging Face model folder or an Orbax
checkpoint written by `jaxserve convert`; a .gguf file is converted (once, cached) and
loaded. Nothing is ever fetched from a model hub.
"""

from __future__ import annotations

import os
from pathlib import Path

from checkpoints.base import Checkpoint, CheckpointError
from checkpoints.default_model import DEFAULT_MODEL_NAME, load_default_model
from checkpoints.gguf_file import load_gguf
from checkpoints.hf_folder import load_hf_folder
from checkpoints.orbax_folder import is_orbax_folder, load_orbax_folder

_EXPECTED = (
    "expected a Hugging Face model folder (config.json, *.safetensors, tokenizer.json), a .gguf file, "
    f"or no model for the default {DEFAULT_MODEL_NAME}; models are never downloaded from a hub"
)


def load_checkpoint(
    model: str | os.PathLike | None = None, *, cache_dir: str | os.PathLike | None = None
) -> Checkpoint:
    """Load `model` (None: the default model); `cache_dir` holds GGUF conversions (default: user cache)."""
    if model is None:
        return load_default_model(cache_dir=cache_dir)
    path = Path(model).expanduser()
    if path.is_dir():
        return load_orbax_folder(path) if is_orbax_folder(path) else load_hf_folder(path)
    if path.is_file() and path.suffix.lower() == ".gguf":
        return load_gguf(path, cache_dir=cache_dir)
    if not path.exists():
        raise CheckpointError(f"model {str(model)!r}: no such file or directory; {_EXPECTED}")
    raise CheckpointError(f"model {str(model)!r} is not a directory or a .gguf file; {_EXPECTED}")
