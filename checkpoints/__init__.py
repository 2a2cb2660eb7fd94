"""Checkpoint loading: Hugging Face folders, GGUF files, the default model and Orbax folders.

`load_checkpoint(model)` is the entry point; everything returns a `Checkpoint`. This
package never imports jax, so loading is cheap and testable on its own.
"""

from checkpoints.base import Checkpoint, CheckpointError
from checkpoints.default_model import DEFAULT_MODEL_NAME, default_model_path, load_default_model
from checkpoints.gguf_file import convert_gguf, load_gguf
from checkpoints.hf_folder import load_hf_folder
from checkpoints.loader import load_checkpoint
from checkpoints.orbax_folder import load_orbax_folder, restore_orbax_params, save_orbax_folder

__all__ = [
    "DEFAULT_MODEL_NAME",
    "Checkpoint",
    "CheckpointError",
    "convert_gguf",
    "default_model_path",
    "load_checkpoint",
    "load_default_model",
    "load_gguf",
    "load_hf_folder",
    "load_orbax_folder",
    "restore_orbax_params",
    "save_orbax_folder",
]
