"""Loading a Hugging Face model folder into a `Checkpoint`.

A folder holds config.json, the weights (one model.safetensors, or shards listed in
model.safetensors.index.json), tokenizer.json, tokenizer_config.json (the chat template
may instead be in chat_template.jinja or chat_template.json) and, optionally,
generation_config.json. Weights are memory-mapped, so loading reads only headers.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from checkpoints.base import Checkpoint, CheckpointError
from checkpoints.safetensors_file import LazyTensors, SafetensorsFile

# model_type -> architecture, for config.json files that omit "architectures".
_ARCHITECTURE_BY_MODEL_TYPE = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
}


def read_json(path: Path, *, required: bool = True) -> Any:
    """Parsed JSON of `path`; a missing optional file is None; errors name the file."""
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except FileNotFoundError:
        if required:
            raise CheckpointError(f"{path}: missing (a model folder needs it)") from None
        return None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{path}: cannot parse JSON: {e}") from e


def _read_json_object(path: Path, *, required: bool = True) -> dict | None:
    value = read_json(path, required=required)
    if value is not None and not isinstance(value, dict):
        raise CheckpointError(f"{path}: expected a JSON object, got {type(value).__name__}")
    return value


def read_config(folder: Path) -> dict:
    path = folder / "config.json"
    config = _read_json_object(path)
    if not config.get("architectures"):
        architecture = _ARCHITECTURE_BY_MODEL_TYPE.get(config.get("model_type"))
        if architecture is None:
            raise CheckpointError(
                f"{path}: no 'architectures' list and unknown model_type {config.get('model_type')!r}"
            )
        config["architectures"] = [architecture]
    return config


def _load_weights(folder: Path) -> LazyTensors:
    index_path = folder / "model.safetensors.index.json"
    if index_path.is_file():
        index = _read_json_object(index_path)
        weight_map = index.get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise CheckpointError(f"{index_path}: no 'weight_map' object naming the shard of each tensor")
        shards = {}
        for shard_name in sorted(set(weight_map.values())):
            shard_path = folder / shard_name
            if not shard_path.is_file():
                raise CheckpointError(f"{shard_path}: missing (listed in {index_path.name})")
            shards[shard_name] = SafetensorsFile(shard_path)
        for tensor, shard_name in weight_map.items():
            if tensor not in shards[shard_name]:
                raise CheckpointError(f"{folder / shard_name}: has no tensor {tensor!r} (listed in {index_path.name})")
        return LazyTensors({tensor: shards[shard_name] for tensor, shard_name in weight_map.items()})
    single = folder / "model.safetensors"
    if single.is_file():
        weights = SafetensorsFile(single)
        return LazyTensors({name: weights for name in weights.keys()})
    others = sorted(p.name for p in folder.glob("*.safetensors")) + sorted(p.name for p in folder.glob("*.bin"))
    raise CheckpointError(
        f"{folder}: no model.safetensors or model.safetensors.index.json"
        + (f" (found {', '.join(others[:5])}; only safetensors named like that are read)" if others else "")
    )


def _read_chat_template(folder: Path, tokenizer_config: dict) -> Any:
    """The chat template: chat_template.jinja, else chat_template.json, else tokenizer_config's."""
    jinja_path = folder / "chat_template.jinja"
    if jinja_path.is_file():
        try:
            return jinja_path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise CheckpointError(f"{jinja_path}: cannot read: {e}") from e
    json_path = folder / "chat_template.json"
    if json_path.is_file():
        template = _read_json_object(json_path).get("chat_template")
        if template is None:
            raise CheckpointError(f"{json_path}: no 'chat_template' entry")
        return template
    return tokenizer_config.get("chat_template")


def load_hf_folder(path: str | os.PathLike, *, name: str | None = None) -> Checkpoint:
    """Load a Hugging Face model folder; `name` defaults to the folder's name."""
    folder = Path(path).expanduser()
    if not folder.is_dir():
        raise CheckpointError(f"{folder}: not a directory (expected a Hugging Face model folder)")
    config = read_config(folder)
    return folder_checkpoint(folder, config=config, tensors=_load_weights(folder), name=name)


def folder_checkpoint(folder: Path, *, config: dict, tensors, name: str | None = None,
                      params_path: str = "") -> Checkpoint:
    """A Checkpoint of `folder`'s tokenizer files, generation config and the given weights."""
    tokenizer_json = folder / "tokenizer.json"
    if not tokenizer_json.is_file():
        raise CheckpointError(f"{tokenizer_json}: missing (only fast tokenizers in tokenizer.json are supported)")
    tokenizer_config = _read_json_object(folder / "tokenizer_config.json", required=False) or {}
    chat_template = _read_chat_template(folder, tokenizer_config)
    if chat_template is not None:
        tokenizer_config["chat_template"] = chat_template
    generation_config = _read_json_object(folder / "generation_config.json", required=False) or {}
    return Checkpoint(
        name=name or folder.resolve().name,
        config=config,
        tensors=tensors,
        tokenizer_json=str(tokenizer_json),
        tokenizer_config=tokenizer_config,
        generation_config=generation_config,
        path=str(folder),
        params_path=params_path,
    )
