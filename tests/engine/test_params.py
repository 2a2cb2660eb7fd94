"""Generating with weights the program holds: LLM(params=...), update_params, sleep / wake_up."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from checkpoints import load_hf_folder
from jaxserve import LLM, SamplingParams

OPTIONS = dict(dtype="float32", max_num_batched_tokens=64, max_num_seqs=8, num_kv_blocks=64, max_model_len=128,
               token_buckets=(4, 16, 64))
PROMPTS = [[3, 4, 5, 6], list(range(10, 50))]
GREEDY = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
SEEDED = SamplingParams(max_tokens=8, temperature=1.0, seed=7, ignore_eos=True)


def tokens(llm, params=GREEDY):
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)]


@pytest.fixture(scope="module")
def path(tiny_models):
    return str(tiny_models["llama"])


@pytest.fixture(scope="module")
def llm(path):
    return LLM(path, **OPTIONS)


@pytest.fixture(scope="module")
def original(llm):
    return {"greedy": tokens(llm), "seeded": tokens(llm, SEEDED), "params": llm.engine.runner.param_arrays()}


def scaled(flat, factor):
    return {k: v * factor for k, v in flat.items()}


def test_update_params_equals_a_fresh_engine_and_compiles_nothing(llm, path, original):
    new = scaled(original["params"], 1.5)
    llm.update_params(nnx.traversals.unflatten_mapping(new))
    try:
        fresh = LLM(path, params=nnx.traversals.unflatten_mapping(new), **OPTIONS)
        assert tokens(llm) == tokens(fresh) != original["greedy"]
        assert tokens(llm, SEEDED) == tokens(fresh, SEEDED)
        assert llm.engine.runner.compiles_after_warmup == 0
    finally:
        llm.update_params(nnx.traversals.unflatten_mapping(original["params"]))
    assert tokens(llm) == original["greedy"] and tokens(llm, SEEDED) == original["seeded"]
    assert llm.engine.runner.compiles_after_warmup == 0


def test_params_already_in_place_are_shared_not_copied(llm, original):
    """Arrays on the engine's devices and shardings are held as they are, except the kernels the
    runner keeps pre-packed for the AMX tiles (`packed_paths`), which are laid out anew."""
    new = scaled(original["params"], 1.0)          # new arrays, on the engine's devices and shardings
    llm.update_params(nnx.traversals.unflatten_mapping(new))
    try:
        held, packed = llm.engine.runner.param_arrays(), set(llm.engine.runner.packed_paths)
        assert len(packed) < len(new) and all(held[k] is new[k] for k in new if k not in packed)
        for k in packed:
            np.testing.assert_array_equal(np.asarray(held[k]), np.asarray(new[k]))
    finally:
        llm.update_params(nnx.traversals.unflatten_mapping(original["params"]))


def test_hugging_face_names_and_a_partial_update(llm, path, original):
    tensors = dict(load_hf_folder(path).tensors)
    doubled_mlp = {k: jnp.asarray(v) * 2 for k, v in tensors.items() if ".mlp." in k}
    llm.update_params(doubled_mlp)                   # a subset: only the MLP projections
    try:
        full = {k: (np.asarray(v) * 2 if ".mlp." in k else np.asarray(v)) for k, v in tensors.items()}
        fresh = LLM(path, params=full, **OPTIONS)     # the whole model from HF names
        assert tokens(llm) == tokens(fresh) != original["greedy"]
    finally:
        llm.update_params(nnx.traversals.unflatten_mapping(original["params"]))


def test_a_bad_update_is_refused_and_the_old_weights_keep_serving(llm, original):
    flat = original["params"]
    first = next(iter(flat))
    cases = [
        ({**flat, first: flat[first][:-1]}, "shape"),
        ({**flat, first: flat[first].astype(jnp.bfloat16)}, "dtype"),
        ({("layers", 99, "mlp", "up_proj", "kernel"): flat[first]}, "does not have"),
    ]
    for params, message in cases:
        with pytest.raises(ValueError, match=message):
            llm.update_params(nnx.traversals.unflatten_mapping(params))
    with pytest.raises(ValueError, match="does not have"):
        llm.update_params({"model.layers.99.mlp.up_proj.weight": np.zeros((2, 2), np.float32)})
    deleted = jnp.array(flat[first])
    deleted.delete()
    with pytest.raises(ValueError, match="deleted"):
        llm.update_params(nnx.traversals.unflatten_mapping({first: deleted}))
    assert tokens(llm) == original["greedy"]


def test_weights_deleted_by_the_caller_after_an_update_give_a_clear_error(llm, original):
    mine = {k: v * 1.0 for k, v in original["params"].items()}        # the caller's arrays, shared
    llm.update_params(nnx.traversals.unflatten_mapping(mine))
    for a in mine.values():
        a.delete()                                                      # e.g. donated to a train step
    with pytest.raises(ValueError, match="deleted or donated"):
        llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()
    llm.update_params(nnx.traversals.unflatten_mapping(original["params"]))
    assert tokens(llm) == original["greedy"]


def test_updates_and_sleep_are_refused_while_requests_run(llm, original):
    engine = llm.engine
    engine.add_request("busy", [3, 4, 5], GREEDY)
    try:
        with pytest.raises(RuntimeError, match="1 request"):
            llm.update_params(nnx.traversals.unflatten_mapping(original["params"]))
        with pytest.raises(RuntimeError, match="idle"):
            llm.sleep()
    finally:
        engine.abort_request("busy")


def test_sleep_frees_the_kv_pool_and_wake_up_changes_nothing(llm, original):
    def live():
        return sum(a.nbytes for a in jax.live_arrays())
    pool = sum(a.nbytes for a in llm.engine.runner.kv_caches)
    before = live()
    assert llm.sleep() == pool
    assert before - live() >= pool
    with pytest.raises(RuntimeError, match="asleep"):
        llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    llm.wake_up()
    assert tokens(llm) == original["greedy"]
    llm.sleep(level=2)                                 # weights to host memory too
    assert llm.engine.runner.param_arrays()[next(iter(original["params"]))] is None
    llm.wake_up()
    assert tokens(llm) == original["greedy"] and tokens(llm, SEEDED) == original["seeded"]
    assert llm.engine.runner.compiles_after_warmup == 0
    with pytest.raises(ValueError, match="level"):
        llm.sleep(level=3)


@pytest.mark.parametrize("family", ["llama", "mistral", "qwen3"])   # GQA; a sliding window of 8; QK norm
def test_the_dense_training_forward_matches_the_engines_prompt_logprobs(tiny_models, family):
    from jaxserve.engine.builder import build_model

    path = str(tiny_models[family])
    model, _ = build_model(load_hf_folder(path), "float32")
    ids = list(range(10, 50))
    logprobs = jax.nn.log_softmax(jax.jit(lambda x: model.forward(x))(jnp.array(ids)), axis=-1)
    want = [float(logprobs[i - 1, ids[i]]) for i in range(1, len(ids))]
    engine = LLM(path, **OPTIONS)
    out = engine.generate([ids], SamplingParams(max_tokens=1, prompt_logprobs=0), use_tqdm=False)[0]
    got = [d[ids[i]] for i, d in enumerate(out.prompt_logprobs) if d is not None]
    np.testing.assert_allclose(got, want, atol=1e-4)
