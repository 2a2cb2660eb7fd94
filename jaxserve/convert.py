"""`jaxserve convert MODEL -o DIR`: any loadable model -> an Orbax checkpoint folder.

The folder (see checkpoints/orbax_folder.py) holds the params in the model's own layout,
so `LLM(model=DIR)` / `jaxserve serve DIR` restore them straight into their shardings,
skipping the GGUF dequantization or safetensors re-layout of every start.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

from flax import nnx

from checkpoints import CheckpointError, load_checkpoint, save_orbax_folder
from jaxserve.config import DTYPES
from jaxserve.engine.builder import build_model


def convert_to_orbax(model: str | os.PathLike | None, output: str | os.PathLike, *, dtype: str = "float32",
                     overwrite: bool = False) -> Path:
    """Write `model` (None: the default model) as an Orbax checkpoint folder at `output`."""
    if dtype not in DTYPES:
        raise ValueError(f"dtype={dtype!r} must be one of {DTYPES}")
    checkpoint = load_checkpoint(model)
    if checkpoint.params_path:
        raise CheckpointError(f"{checkpoint.path} is already an Orbax checkpoint")
    built, _ = build_model(checkpoint, dtype)
    return save_orbax_folder(output, nnx.to_pure_dict(nnx.state(built)), checkpoint, dtype=dtype,
                             overwrite=overwrite)


def main(model, output, *, dtype: str, overwrite: bool) -> int:
    t0 = time.perf_counter()
    folder = convert_to_orbax(model, output, dtype=dtype, overwrite=overwrite)
    print(f"wrote {folder} in {time.perf_counter() - t0:.1f} s; serve it with `jaxserve serve {folder}`")
    return 0
