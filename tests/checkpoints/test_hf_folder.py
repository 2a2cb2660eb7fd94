"""Hugging Face model folders: round trips through safetensors' own writer, and one clear error per broken file."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from checkpoints import Checkpoint, CheckpointError, load_checkpoint, load_hf_folder
from checkpoints.safetensors_file import save_safetensors

CONFIG = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 8, "vocab_size": 16}
TEMPLATE = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"


def _tensors(seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {
        "model.embed_tokens.weight": rng.standard_normal((16, 8)).astype(np.float32),
        "model.layers.0.self_attn.q_proj.weight": rng.standard_normal((8, 8)).astype(np.float16),
        "model.layers.0.mlp.down_proj.weight": rng.standard_normal((8, 12)).astype(np.float32),
        "model.norm.weight": np.ones(8, np.float32),
        "position_ids": np.arange(5, dtype=np.int64),
        "scalar": np.array(3.5, np.float32),
    }


def _write_common(folder, *, tokenizer_config=None, generation_config=None):
    folder.mkdir(exist_ok=True)
    (folder / "config.json").write_text(json.dumps(CONFIG))
    (folder / "tokenizer.json").write_text("{}")  # only its presence is checked when loading a folder
    (folder / "tokenizer_config.json").write_text(json.dumps(tokenizer_config or {"eos_token": "</s>"}))
    if generation_config is not None:
        (folder / "generation_config.json").write_text(json.dumps(generation_config))
    return folder


@pytest.fixture
def single(tmp_path):
    folder = _write_common(tmp_path / "Tiny-Model", generation_config={"eos_token_id": [2, 3]})
    tensors = _tensors()
    save_file(tensors, str(folder / "model.safetensors"))
    return folder, tensors


@pytest.fixture
def sharded(tmp_path):
    folder = _write_common(tmp_path / "sharded")
    tensors = _tensors(seed=1)
    names = sorted(tensors)
    shards = {"model-00001-of-00002.safetensors": names[:3], "model-00002-of-00002.safetensors": names[3:]}
    weight_map = {}
    for shard, shard_names in shards.items():
        save_file({n: tensors[n] for n in shard_names}, str(folder / shard))
        weight_map |= dict.fromkeys(shard_names, shard)
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return folder, tensors


def _assert_same_tensors(ckpt: Checkpoint, tensors: dict[str, np.ndarray]):
    assert set(ckpt.tensors) == set(tensors) and len(ckpt.tensors) == len(tensors)
    for name, expected in tensors.items():
        got = ckpt.tensors[name]
        assert got.dtype == expected.dtype and got.shape == expected.shape, name
        np.testing.assert_array_equal(got, expected, err_msg=name)


def test_single_file_round_trip(single):
    folder, tensors = single
    ckpt = load_hf_folder(folder)
    _assert_same_tensors(ckpt, tensors)
    assert ckpt.name == "Tiny-Model" and ckpt.path == str(folder)
    assert ckpt.config == CONFIG and ckpt.architecture == "LlamaForCausalLM"
    assert ckpt.tokenizer_json == str(folder / "tokenizer.json")
    assert ckpt.tokenizer_config == {"eos_token": "</s>"}
    assert ckpt.generation_config == {"eos_token_id": [2, 3]}


def test_sharded_round_trip(sharded):
    folder, tensors = sharded
    ckpt = load_hf_folder(folder, name="served-name")
    _assert_same_tensors(ckpt, tensors)
    assert ckpt.name == "served-name" and ckpt.generation_config == {}


def test_tensors_are_memory_mapped_and_private(single):
    folder, tensors = single
    ckpt = load_hf_folder(folder)
    array = ckpt.tensors["model.norm.weight"]
    array[0] = 42.0  # copy-on-write: the caller's copy changes, the file does not
    np.testing.assert_array_equal(load_hf_folder(folder).tensors["model.norm.weight"], tensors["model.norm.weight"])


def test_bfloat16_tensors_load_with_ml_dtypes(tmp_path):
    torch = pytest.importorskip("torch")
    from safetensors.torch import save_file as torch_save_file

    folder = _write_common(tmp_path / "bf16")
    weight = torch.randn(4, 6, dtype=torch.bfloat16)
    torch_save_file({"w": weight}, str(folder / "model.safetensors"))
    got = load_hf_folder(folder).tensors["w"]
    assert got.dtype.name == "bfloat16" and got.shape == (4, 6)
    np.testing.assert_array_equal(got.astype(np.float32), weight.float().numpy())


def test_save_safetensors_is_readable_by_safetensors(tmp_path):
    tensors = _tensors()
    save_safetensors(tmp_path / "out.safetensors", tensors, metadata={"format": "pt"})
    loaded = load_file(str(tmp_path / "out.safetensors"))
    assert set(loaded) == set(tensors)
    for name, expected in tensors.items():
        np.testing.assert_array_equal(loaded[name], expected)


def test_chat_template_files_take_precedence(single):
    folder, _ = single
    (folder / "tokenizer_config.json").write_text(json.dumps({"chat_template": "from tokenizer_config"}))
    assert load_hf_folder(folder).tokenizer_config["chat_template"] == "from tokenizer_config"
    (folder / "chat_template.json").write_text(json.dumps({"chat_template": "from json"}))
    assert load_hf_folder(folder).tokenizer_config["chat_template"] == "from json"
    (folder / "chat_template.jinja").write_text(TEMPLATE)
    assert load_hf_folder(folder).tokenizer_config["chat_template"] == TEMPLATE


def test_missing_architectures_is_filled_from_model_type(single):
    folder, _ = single
    (folder / "config.json").write_text(json.dumps({"model_type": "qwen2"}))
    assert load_hf_folder(folder).config["architectures"] == ["Qwen2ForCausalLM"]
    (folder / "config.json").write_text(json.dumps({"model_type": "mystery"}))
    with pytest.raises(CheckpointError, match=r"config\.json.*'mystery'"):
        load_hf_folder(folder)


def _remove(folder, name):
    (folder / name).unlink()


def _truncate(folder, name):
    path = folder / name
    data = path.read_bytes()
    path.write_bytes(data[: len(data) - 40])


def _corrupt_header(folder, name):
    path = folder / name
    data = bytearray(path.read_bytes())
    data[8:12] = b"\x00\xff\x00\xff"
    path.write_bytes(bytes(data))


@pytest.mark.parametrize(
    ("breakage", "file_name", "message"),
    [
        (lambda f: _remove(f, "config.json"), "config.json", "missing"),
        (lambda f: (f / "config.json").write_text('{"architectures": ['), "config.json", "cannot parse JSON"),
        (lambda f: (f / "config.json").write_text("[1, 2]"), "config.json", "expected a JSON object"),
        (lambda f: _truncate(f, "model.safetensors"), "model.safetensors", "truncated"),
        (lambda f: (f / "model.safetensors").write_bytes(b"\x01\x02"), "model.safetensors", "not a safetensors"),
        (lambda f: _corrupt_header(f, "model.safetensors"), "model.safetensors", "corrupt"),
        (lambda f: _remove(f, "model.safetensors"), "Tiny-Model", "no model.safetensors"),
        (lambda f: _remove(f, "tokenizer.json"), "tokenizer.json", "missing"),
        (lambda f: (f / "tokenizer_config.json").write_text("{oops"), "tokenizer_config.json", "cannot parse"),
        (lambda f: (f / "generation_config.json").write_text(""), "generation_config.json", "cannot parse"),
    ],
    ids=[
        "no-config",
        "bad-config-json",
        "config-not-object",
        "truncated-weights",
        "tiny-weights",
        "corrupt-header",
        "no-weights",
        "no-tokenizer",
        "bad-tokenizer-config",
        "empty-generation-config",
    ],
)
def test_broken_single_file_folder_names_the_file(single, breakage, file_name, message):
    folder, _ = single
    breakage(folder)
    with pytest.raises(CheckpointError, match=message) as info:
        load_hf_folder(folder)
    assert file_name in str(info.value)


def test_index_naming_a_missing_shard(sharded):
    folder, _ = sharded
    (folder / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(CheckpointError, match=r"model-00002-of-00002\.safetensors: missing.*index"):
        load_hf_folder(folder)


def test_index_naming_a_tensor_its_shard_lacks(sharded):
    folder, _ = sharded
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    index["weight_map"]["model.extra.weight"] = "model-00001-of-00002.safetensors"
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match=r"model-00001-of-00002\.safetensors: has no tensor 'model\.extra"):
        load_hf_folder(folder)


def test_truncated_shard_names_the_shard(sharded):
    folder, _ = sharded
    _truncate(folder, "model-00001-of-00002.safetensors")
    with pytest.raises(CheckpointError, match=r"model-00001-of-00002\.safetensors: truncated"):
        load_hf_folder(folder)


def test_load_checkpoint_dispatches_on_the_path(single, tmp_path):
    folder, tensors = single
    _assert_same_tensors(load_checkpoint(folder), tensors)
    _assert_same_tensors(load_checkpoint(str(folder)), tensors)
    with pytest.raises(CheckpointError, match=r"'HuggingFaceTB/SmolLM2-135M-Instruct': no such file.*never downloaded"):
        load_checkpoint("HuggingFaceTB/SmolLM2-135M-Instruct")
    other = tmp_path / "weights.bin"
    other.write_bytes(b"\0")
    with pytest.raises(CheckpointError, match=r"weights\.bin.*not a directory or a \.gguf file"):
        load_checkpoint(other)


def test_checkpoints_package_does_not_import_jax(single):
    code = (
        "import sys, checkpoints; checkpoints.load_checkpoint(sys.argv[1]); "
        "bad = sorted(m for m in ('jax', 'torch', 'transformers') if m in sys.modules); print(bad); sys.exit(bool(bad))"
    )
    repo_root = Path(__file__).resolve().parents[2]
    result = subprocess.run([sys.executable, "-c", code, str(single[0])], capture_output=True, text=True, cwd=repo_root)
    assert result.returncode == 0, result.stdout + result.stderr
