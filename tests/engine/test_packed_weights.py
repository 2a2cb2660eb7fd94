"""bfloat16 projections pre-packed for the AMX tiles (`ModelRunner`, `pack_for_tiles`): the same
tokens as the weights as they lie, and the weights API (param_arrays, update_params, sleep)
still speaks of the model's own shapes."""

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxserve import LLM, SamplingParams
from kernels_pallas import native_cpu

pytestmark = pytest.mark.skipif(not native_cpu.gemm_amx(), reason="no AMX on this CPU (or JAXSERVE_AMX=0)")

OPTIONS = dict(dtype="bfloat16", max_num_batched_tokens=64, max_num_seqs=8, num_kv_blocks=64, max_model_len=128,
               token_buckets=(4, 16, 64))
PROMPTS = [[3, 4, 5, 6], list(range(10, 50)), [7]]
GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, logprobs=2)


def run(llm):
    return [(o.outputs[0].token_ids, o.outputs[0].logprobs)   # [{token: logprob}] a step
            for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]


@pytest.fixture(scope="module")
def path(tiny_models):
    return str(tiny_models["llama"])


@pytest.fixture(scope="module")
def unpacked(path):
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("JAXSERVE_PACKED_WEIGHTS", "0")
        llm = LLM(path, **OPTIONS)
    assert llm.engine.runner.packed_paths == ()
    return {"outputs": run(llm), "params": llm.engine.runner.param_arrays()}


@pytest.fixture(scope="module")
def llm(path):
    return LLM(path, **OPTIONS)


def test_every_projection_is_packed_and_serves_the_same_bits(llm, unpacked):
    packed = llm.engine.runner.packed_paths
    # q, k, v, o, gate, up, down of each of the tiny model's layers
    assert len(packed) == 7 * llm.engine.runner.config.num_hidden_layers
    assert all(p[-1] == "kernel" and p[-2].endswith("_proj") for p in packed)
    assert run(llm) == unpacked["outputs"]       # tokens and logprobs, bit for bit
    assert llm.engine.runner.compiles_after_warmup == 0


def test_param_arrays_are_the_models_own_shapes_and_values(llm, unpacked):
    held = llm.engine.runner.param_arrays()
    assert held.keys() == unpacked["params"].keys()
    for path, want in unpacked["params"].items():
        assert held[path].shape == want.shape and held[path].dtype == want.dtype
        np.testing.assert_array_equal(np.asarray(held[path]), np.asarray(want))


def test_update_params_repacks_and_equals_a_fresh_engine(llm, path, unpacked):
    new = {k: (v * 1.5).astype(v.dtype) for k, v in unpacked["params"].items()}
    llm.update_params(nnx.traversals.unflatten_mapping(new))
    try:
        fresh = LLM(path, params=nnx.traversals.unflatten_mapping(new), **OPTIONS)
        assert fresh.engine.runner.packed_paths == ()   # a caller's arrays are served as they are
        assert run(llm) == run(fresh) != unpacked["outputs"]
        one = next(iter(llm.engine.runner.packed_paths))   # a subset of the packed ones alone
        llm.update_params(nnx.traversals.unflatten_mapping({one: unpacked["params"][one]}))
        held = llm.engine.runner.param_arrays()
        np.testing.assert_array_equal(np.asarray(held[one]), np.asarray(unpacked["params"][one]))
        assert llm.engine.runner.compiles_after_warmup == 0
    finally:
        llm.update_params(nnx.traversals.unflatten_mapping(unpacked["params"]))
    assert run(llm) == unpacked["outputs"]


def test_a_packed_kernel_of_a_wrong_shape_is_refused(llm, unpacked):
    one = next(iter(llm.engine.runner.packed_paths))
    kernel = unpacked["params"][one]
    for bad, message in [(kernel.reshape(-1), "shape"), (kernel[:-1], "shape"), (kernel.astype(jnp.float32), "dtype")]:
        with pytest.raises(ValueError, match=message):
            llm.update_params(nnx.traversals.unflatten_mapping({one: bad}))
    assert run(llm) == unpacked["outputs"]


def test_sleep_with_the_weights_offloaded_and_wake_up_change_nothing(llm, unpacked):
    llm.sleep(level=2)
    assert all(a is None for a in llm.engine.runner.param_arrays().values())
    llm.wake_up()
    assert run(llm) == unpacked["outputs"]
    assert llm.engine.runner.compiles_after_warmup == 0
