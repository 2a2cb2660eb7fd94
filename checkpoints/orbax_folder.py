"""Orbax checkpoints: params already in the model's layout, saved and restored sharded.

`jaxserve convert MODEL -o DIR` writes a folder that is a model folder in every way but
the weights: config.json, tokenizer.json, tokenizer_config.json (with the chat
template), generation_config.json, `params/` (an Orbax checkpoint of the model's param
tree) and `jaxserve_checkpoint.json` (format marker, source, dtype). Loading it reads only
the small files; the engine restores `params/` straight into each param's target
sharding, so no host copy of the weights and no conversion happens at start-up.

orbax and jax are imported inside the functions that need them: importing `checkpoints`
stays free of jax.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

from checkpoints.base import Checkpoint, CheckpointError
from checkpoints.hf_folder import folder_checkpoint, read_config, read_json

MARKER = "jaxserve_checkpoint.json"
FORMAT_VERSION = 1


def is_orbax_folder(path: Path) -> bool:
    return (path / MARKER).is_file()


def load_orbax_folder(path: str | os.PathLike) -> Checkpoint:
    folder = Path(path).expanduser()
    marker = read_json(folder / MARKER)
    if not isinstance(marker, dict) or marker.get("format") != "orbax" or marker.get("version") != FORMAT_VERSION:
        raise CheckpointError(f"{folder / MARKER}: not a jaxserve Orbax checkpoint of version {FORMAT_VERSION} "
                              f"(got {marker!r})")
    params = folder / "params"
    if not params.is_dir():
        raise CheckpointError(f"{params}: missing (the Orbax params of this checkpoint)")
    return folder_checkpoint(folder, config=read_config(folder), tensors={}, name=marker.get("name"),
                             params_path=str(params.resolve()))


def save_orbax_folder(path: str | os.PathLike, params: dict[str, Any], source: Checkpoint, *, dtype: str,
                      overwrite: bool = False) -> Path:
    """Write `params` (a nested dict of arrays, the model's layout) and `source`'s small files to `path`."""
    import orbax.checkpoint as ocp

    folder = Path(path).expanduser().resolve()
    if folder.exists():
        if not overwrite:
            raise CheckpointError(f"{folder}: already exists (pass --overwrite to replace it)")
        shutil.rmtree(folder)
    folder.mkdir(parents=True)
    checkpointer = ocp.StandardCheckpointer()
    checkpointer.save(folder / "params", params)
    checkpointer.wait_until_finished()
    checkpointer.close()
    shutil.copyfile(source.tokenizer_json, folder / "tokenizer.json")
    _write_json(folder / "config.json", source.config)
    _write_json(folder / "tokenizer_config.json", source.tokenizer_config)
    _write_json(folder / "generation_config.json", source.generation_config)
    _write_json(folder / MARKER, {"format": "orbax", "version": FORMAT_VERSION, "name": source.name,
                                  "source": source.path, "dtype": dtype})
    return folder


def restore_orbax_params(params_path: str, target):
    """Restore into `target`, a nested dict of jax.ShapeDtypeStruct carrying the wanted shardings.

    The stored tree is checked against `target` first (names and shapes), so a folder whose
    config.json does not match its params fails before any array is read.
    """
    import jax
    import orbax.checkpoint as ocp

    with ocp.StandardCheckpointer() as checkpointer:
        stored = checkpointer.metadata(params_path).item_metadata
        stored_shapes = {_dotted(p): tuple(m.shape) for p, m in jax.tree_util.tree_leaves_with_path(stored)}
        wanted_shapes = {_dotted(p): tuple(t.shape) for p, t in jax.tree_util.tree_leaves_with_path(target)}
        if stored_shapes != wanted_shapes:
            missing = sorted(set(wanted_shapes) - set(stored_shapes))
            extra = sorted(set(stored_shapes) - set(wanted_shapes))
            wrong = sorted(k for k in set(wanted_shapes) & set(stored_shapes) if wanted_shapes[k] != stored_shapes[k])
            detail = "; ".join(f"{what}: {', '.join(names[:3])}" for what, names in (
                ("missing", missing), ("unexpected", extra),
                ("shape", [f"{k} {stored_shapes[k]} != {wanted_shapes[k]}" for k in wrong])) if names)
            raise CheckpointError(f"{params_path}: does not fit the model built from its config.json ({detail})")
        return checkpointer.restore(params_path, target)


def _dotted(key_path) -> str:
    """'layers.0.mlp.up_proj.kernel' (stored trees key layers by "0", models by 0)."""
    return ".".join(str(getattr(k, "key", k)) for k in key_path)


def _write_json(path: Path, value: Any) -> None:
    path.write_text(json.dumps(value, indent=2, ensure_ascii=False), encoding="utf-8")
