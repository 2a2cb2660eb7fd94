"""Loading a GGUF file (llama.cpp's format) as a Hugging Face-style `Checkpoint`.

`convert_gguf` reads the file with the `gguf` package, keeps F32/F16/BF16 tensors in
their own dtype (lossless) and dequantizes the others (Q8_0, Q4_K, ...) to float32,
renames each to its Hugging Face name in torch layout, undoes llama.cpp's rotary
permutation of the Llama Q/K projections, rebuilds config.json and the tokenizer from
metadata, and writes an HF folder. The engine casts the weights to its compute dtype
when it loads them, as for any HF checkpoint. `load_gguf` converts once per file into
the model cache (checkpoints.cache) and then loads the folder.
"""

from __future__ import annotations

import json
import math
import os
import re
from pathlib import Path
from typing import Any

import numpy as np

from checkpoints.base import Checkpoint, CheckpointError
from checkpoints.cache import cached_conversion
from checkpoints.gguf_tokenizer import build_tokenizer, eos_token_ids
from checkpoints.hf_folder import load_hf_folder
from checkpoints.safetensors_file import save_safetensors

# general.architecture -> (HF architecture, HF model_type)
ARCHITECTURES = {
    "llama": ("LlamaForCausalLM", "llama"),
    "qwen2": ("Qwen2ForCausalLM", "qwen2"),
    "qwen3": ("Qwen3ForCausalLM", "qwen3"),
}

_GLOBAL_TENSORS = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_LAYER_TENSORS = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_TENSOR_NAME = re.compile(r"(?:blk\.(?P<layer>\d+)\.)?(?P<role>\w+)\.(?P<kind>weight|bias)")
_QUANT_SUFFIX = re.compile(r"[.\-_](?:[Qq]\d|[Ii][Qq]\d|[Ff]16|[Ff]32|[Bb][Ff]16)\w*$")


def hf_tensor_name(gguf_name: str) -> str:
    """HF parameter name of a GGUF tensor, e.g. blk.3.attn_q.weight -> model.layers.3.self_attn.q_proj.weight."""
    m = _TENSOR_NAME.fullmatch(gguf_name)
    table = _LAYER_TENSORS if m and m["layer"] is not None else _GLOBAL_TENSORS
    if m is None or m["role"] not in table:
        raise CheckpointError(f"GGUF tensor {gguf_name!r} has no known Hugging Face name")
    prefix = f"model.layers.{m['layer']}." if m["layer"] is not None else ""
    return f"{prefix}{table[m['role']]}.{m['kind']}"


def unpermute_rotary(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's per-head interleaving of rotary rows in a Q or K projection (rows, ...)."""
    rows = w.shape[0]
    return w.reshape(n_heads, rows // n_heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def model_name_from_path(path: str | os.PathLike) -> str:
    """File stem without a quantization suffix: SmolLM2-135M-Instruct.Q4_1.gguf -> SmolLM2-135M-Instruct."""
    stem = Path(path).stem
    return _QUANT_SUFFIX.sub("", stem) or stem


def _float(value) -> float:
    """A float32 metadata value as the decimal it was written from (9.99999975e-06 -> 1e-05)."""
    return float(str(np.float32(value)))


def _llama3_rope_scaling(rope_freqs: np.ndarray, head_dim: int, theta: float, source: str) -> dict:
    """Recover Llama 3.1-style rope_scaling from llama.cpp's precomputed rope_freqs factors."""
    factor, low, high, original = float(np.max(rope_freqs)), 1.0, 4.0, 8192
    inv_freq = 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    wavelen = 2 * math.pi / inv_freq
    smooth = (original / wavelen - low) / (high - low)
    expected = np.where(
        wavelen < original / high,
        1.0,
        np.where(wavelen > original / low, factor, 1.0 / ((1 - smooth) / factor + smooth)),
    )
    if rope_freqs.shape != expected.shape or not np.allclose(rope_freqs, expected, rtol=1e-3):
        raise CheckpointError(f"{source}: rope_freqs.weight does not match Llama 3 RoPE scaling; not supported")
    return {
        "rope_type": "llama3",
        "factor": factor,
        "low_freq_factor": low,
        "high_freq_factor": high,
        "original_max_position_embeddings": original,
    }


def _config(meta: dict[str, Any], tensors: dict[str, Any], source: str) -> dict[str, Any]:
    arch = meta["general.architecture"]  # checked by convert_gguf

    def get(key, default=None):
        value = meta.get(f"{arch}.{key}", default)
        if value is None:
            raise CheckpointError(f"{source}: metadata {arch}.{key} is missing")
        if isinstance(value, list):
            raise CheckpointError(f"{source}: per-layer metadata {arch}.{key} is not supported")
        return value

    hidden, heads = int(get("embedding_length")), int(get("attention.head_count"))
    architecture, model_type = ARCHITECTURES[arch]
    config = {
        "architectures": [architecture],
        "model_type": model_type,
        "vocab_size": int(tensors["model.embed_tokens.weight"].shape[0]),
        "hidden_size": hidden,
        "intermediate_size": int(get("feed_forward_length")),
        "num_hidden_layers": int(get("block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(get("attention.head_count_kv", heads)),
        "head_dim": int(get("attention.key_length", hidden // heads)),
        "max_position_embeddings": int(get("context_length")),
        "rms_norm_eps": _float(get("attention.layer_norm_rms_epsilon")),
        "rope_theta": _float(get("rope.freq_base", 10000.0)),
        "rope_scaling": None,
        "hidden_act": "silu",
        "tie_word_embeddings": "lm_head.weight" not in tensors,
        "torch_dtype": _main_dtype(tensors),
    }
    if model_type == "llama":
        config["attention_bias"] = "model.layers.0.self_attn.q_proj.bias" in tensors
        config["mlp_bias"] = False
    if model_type == "qwen3":
        config["attention_bias"] = False
    if model_type in ("qwen2", "qwen3"):
        config["use_sliding_window"] = False
    scaling = meta.get(f"{arch}.rope.scaling.type", "none")
    if scaling == "linear":
        config["rope_scaling"] = {"rope_type": "linear", "factor": _float(get("rope.scaling.factor"))}
    elif scaling != "none":
        raise CheckpointError(f"{source}: RoPE scaling type {scaling!r} is not supported")
    for key in ("bos", "eos", "padding"):
        token_id = meta.get(f"tokenizer.ggml.{key}_token_id")
        if token_id is not None:
            config[f"{'pad' if key == 'padding' else key}_token_id"] = int(token_id)
    return config


def read_gguf_metadata(reader) -> dict[str, Any]:
    """All key/value metadata of a GGUFReader as Python values (strings, numbers, lists)."""
    return {key: field.contents() for key, field in reader.fields.items() if not key.startswith("GGUF.")}


def _main_dtype(tensors: dict[str, np.ndarray]) -> str:
    """The dtype holding most of the weights (F16 files keep their norms in F32)."""
    counts: dict[str, int] = {}
    for array in tensors.values():
        counts[array.dtype.name] = counts.get(array.dtype.name, 0) + array.size
    return max(counts, key=counts.get)


def _stored_array(t, source: str) -> np.ndarray:
    """A GGUF tensor in torch layout: F32/F16/BF16 as they are, quantized types dequantized to float32."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    shape = tuple(int(d) for d in reversed(t.shape))  # GGUF dims are (in, out); row-major reverses to (out, in)
    if t.tensor_type in (GGMLQuantizationType.F32, GGMLQuantizationType.F16):
        return np.ascontiguousarray(t.data).reshape(shape)  # the reader already typed these
    if t.tensor_type == GGMLQuantizationType.BF16:  # the reader hands raw bytes
        import ml_dtypes

        return np.ascontiguousarray(t.data).reshape(-1).view(ml_dtypes.bfloat16).reshape(shape)
    try:
        array = dequantize(t.data, t.tensor_type)
    except NotImplementedError as e:
        raise CheckpointError(f"{source}: tensor {t.name}: {e}") from e
    return np.ascontiguousarray(array, dtype=np.float32).reshape(shape)


def _converted_tensors(reader, arch: str, meta: dict, source: str) -> tuple[dict[str, np.ndarray], np.ndarray | None]:
    if f"{arch}.attention.head_count" not in meta:
        raise CheckpointError(f"{source}: metadata {arch}.attention.head_count is missing")
    heads = int(meta[f"{arch}.attention.head_count"])
    kv_heads = int(meta.get(f"{arch}.attention.head_count_kv", heads))
    tensors, rope_freqs = {}, None
    for t in reader.tensors:
        array = _stored_array(t, source)
        if t.name == "rope_freqs.weight":
            rope_freqs = array.astype(np.float32)
            continue
        name = hf_tensor_name(t.name)
        if arch == "llama" and ".attn_q." in t.name:
            array = unpermute_rotary(array, heads)
        elif arch == "llama" and ".attn_k." in t.name:
            array = unpermute_rotary(array, kv_heads)
        tensors[name] = array
    return tensors, rope_freqs


def open_gguf(path: str | os.PathLike):
    """A `gguf.GGUFReader` over a plain-ndarray view of the file's memory map.

    The reader slices its `np.memmap` once per metadata value and per quantized row group,
    and numpy's memmap subclass hooks cost ~1 us a slice: ~1.3 s of a ~5 s conversion of the
    default model (its vocabulary alone is ~250k slices). A plain view reads the same mapping.
    """
    import gguf

    class _Reader(gguf.GGUFReader):
        @property
        def data(self) -> np.ndarray:
            return self._data

        @data.setter
        def data(self, value: np.ndarray) -> None:
            self._data = value.view(np.ndarray)   # its base, the memmap, keeps the mapping open

    return _Reader(path)


def convert_gguf(path: str | os.PathLike, out_dir: str | os.PathLike) -> None:
    """Write the GGUF file at `path` as a Hugging Face model folder into `out_dir` (dtypes: module docstring)."""
    source = str(path)
    try:
        reader = open_gguf(path)
    except (OSError, ValueError, IndexError, KeyError) as e:  # what GGUFReader raises on bad or cut-off bytes
        raise CheckpointError(f"{source}: cannot read GGUF file (corrupt or truncated?): {e}") from e
    meta = read_gguf_metadata(reader)
    arch = meta.get("general.architecture")
    if arch not in ARCHITECTURES:
        raise CheckpointError(
            f"{source}: GGUF architecture {arch!r} is not supported (supported: {', '.join(ARCHITECTURES)})"
        )
    tokenizer, tokenizer_config = build_tokenizer(meta, source)
    tensors, rope_freqs = _converted_tensors(reader, arch, meta, source)
    config = _config(meta, tensors, source)
    if rope_freqs is not None:
        config["rope_scaling"] = _llama3_rope_scaling(
            rope_freqs.reshape(-1), config["head_dim"], config["rope_theta"], source
        )
    generation_config = {k: config[k] for k in ("bos_token_id", "pad_token_id") if k in config}
    eos = eos_token_ids(meta)
    if eos:
        generation_config["eos_token_id"] = eos[0] if len(eos) == 1 else eos

    out = Path(out_dir)
    save_safetensors(out / "model.safetensors", tensors, metadata={"format": "pt", "source": Path(path).name})
    tokenizer.save(str(out / "tokenizer.json"))
    for file_name, content in (
        ("config.json", config),
        ("tokenizer_config.json", tokenizer_config),
        ("generation_config.json", generation_config),
    ):
        (out / file_name).write_text(json.dumps(content, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def load_gguf(
    path: str | os.PathLike, *, name: str | None = None, cache_dir: str | os.PathLike | None = None
) -> Checkpoint:
    """Load a GGUF file, converting it into the model cache on first use; later loads read the cache."""
    path = Path(path).expanduser()
    if not path.is_file():
        raise CheckpointError(f"{path}: no such GGUF file")
    name = name or model_name_from_path(path)
    folder, _ = cached_conversion(path, name, lambda out: convert_gguf(path, out), cache_dir)
    try:
        checkpoint = load_hf_folder(folder, name=name)
    except CheckpointError as e:
        raise CheckpointError(f"{e} (in the cached conversion of {path}; delete {folder} to convert again)") from e
    return checkpoint
