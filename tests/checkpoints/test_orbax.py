"""Orbax checkpoint folders: `jaxserve convert`, identical params after a round trip, bad folders."""

import json
import shutil

import jax
import numpy as np
import pytest
from flax import nnx

from checkpoints import CheckpointError, load_checkpoint
from jaxserve import LLM, SamplingParams
from jaxserve.cli import main as cli_main
from jaxserve.convert import convert_to_orbax
from jaxserve.engine.builder import build_model

ENGINE = dict(max_num_batched_tokens=16, max_num_seqs=4, num_kv_blocks=64, max_model_len=64, token_buckets=(16,))


@pytest.fixture(scope="module")
def converted(tiny_models, tmp_path_factory):
    # qwen3: QK norm params; qwen2 would add biases. Both layouts go through the same tree.
    return convert_to_orbax(tiny_models["qwen3"], tmp_path_factory.mktemp("orbax") / "qwen3")


def _params(checkpoint):
    model, _ = build_model(checkpoint, "float32")
    return nnx.to_pure_dict(nnx.state(model))


def test_round_trip_gives_identical_params(tiny_models, converted):
    checkpoint = load_checkpoint(converted)
    assert checkpoint.params_path and not checkpoint.tensors
    original, restored = _params(load_checkpoint(tiny_models["qwen3"])), _params(checkpoint)
    flat_o, flat_r = jax.tree_util.tree_leaves_with_path(original), jax.tree_util.tree_leaves_with_path(restored)
    assert [p for p, _ in flat_o] == [p for p, _ in flat_r]
    for (path, a), (_, b) in zip(flat_o, flat_r):
        assert a.dtype == b.dtype, path
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=str(path))


def test_an_orbax_folder_serves_like_its_source(tiny_models, converted):
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    source = LLM(str(tiny_models["qwen3"]), **ENGINE).generate(["Once upon a time"], params, use_tqdm=False)
    restored_llm = LLM(str(converted), **ENGINE)
    restored = restored_llm.generate(["Once upon a time"], params, use_tqdm=False)
    assert restored[0].outputs[0].token_ids == source[0].outputs[0].token_ids
    assert restored_llm.engine.model_name == "qwen3"          # the source's name, not the folder's
    assert restored[0].outputs[0].text == source[0].outputs[0].text   # tokenizer travelled with it


def test_cli_convert_and_refusal_to_overwrite(tiny_models, tmp_path, capsys):
    out = tmp_path / "llama-orbax"
    assert cli_main(["convert", str(tiny_models["llama"]), "-o", str(out)]) == 0
    assert {p.name for p in out.iterdir()} >= {"params", "config.json", "tokenizer.json", "tokenizer_config.json",
                                               "jaxserve_checkpoint.json"}
    assert cli_main(["convert", str(tiny_models["llama"]), "-o", str(out)]) == 2
    assert "already exists (pass --overwrite" in capsys.readouterr().err
    assert cli_main(["convert", str(tiny_models["llama"]), "-o", str(out), "--overwrite"]) == 0
    assert cli_main(["convert", str(out), "-o", str(tmp_path / "again")]) == 2
    assert "is already an Orbax checkpoint" in capsys.readouterr().err


def test_bad_orbax_folders_are_refused_naming_the_file(converted, tmp_path):
    wrong_version = shutil.copytree(converted, tmp_path / "v2")
    marker = wrong_version / "jaxserve_checkpoint.json"
    marker.write_text(json.dumps({**json.loads(marker.read_text()), "version": 2}))
    with pytest.raises(CheckpointError, match="jaxserve_checkpoint.json: not a jaxserve Orbax checkpoint of version 1"):
        load_checkpoint(wrong_version)

    no_params = shutil.copytree(converted, tmp_path / "no_params")
    shutil.rmtree(no_params / "params")
    with pytest.raises(CheckpointError, match=r"params: missing \(the Orbax params of this checkpoint\)"):
        load_checkpoint(no_params)

    other_shape = shutil.copytree(converted, tmp_path / "other_shape")
    config = json.loads((other_shape / "config.json").read_text())
    (other_shape / "config.json").write_text(json.dumps({**config, "intermediate_size": 96}))
    with pytest.raises(CheckpointError, match=r"does not fit the model built from its config.json \(shape: "
                                              r"layers.0.mlp.down_proj.kernel \(128, 64\) != \(96, 64\)"):
        build_model(load_checkpoint(other_shape), "float32")
