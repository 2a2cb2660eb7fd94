"""Projections pre-packed for the AMX tiles (`ModelRunner`, `pack_for_tiles`): bfloat16 kernels in
the tiles' layout serve the same tokens and logprobs, bit for bit, as the weights as they lie;
float32 kernels stored [N, K] (split into bf16 parts on the tiles) the same greedy tokens, with
logprobs within float32 rounding. The weights API (param_arrays, update_params, sleep) still
speaks of the model's own shapes."""

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxserve import LLM, SamplingParams
from kernels_pallas import native_cpu

pytestmark = pytest.mark.skipif(not native_cpu.gemm_amx(), reason="no AMX on this CPU (or JAXSERVE_AMX=0)")

OPTIONS = dict(max_num_batched_tokens=64, max_num_seqs=8, num_kv_blocks=64, max_model_len=128,
               token_buckets=(4, 16, 64))
PROMPTS = [[3, 4, 5, 6], list(range(10, 50)), [7]]
GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, logprobs=2)


def run(llm):
    return [(o.outputs[0].token_ids, o.outputs[0].logprobs)   # [{token: logprob}] a step
            for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]


def assert_same_outputs(got, want, dtype):
    """bfloat16: bit for bit. float32: the same tokens, logprobs within float32 rounding (the tiles'
    split products and the FMAs round differently)."""
    if dtype == "bfloat16":
        assert got == want
        return
    assert [tokens for tokens, _ in got] == [tokens for tokens, _ in want]
    for (_, a), (_, b) in zip(got, want):
        assert [d.keys() for d in a] == [d.keys() for d in b]
        np.testing.assert_allclose([v for d in a for v in d.values()], [v for d in b for v in d.values()],
                                   rtol=1e-4, atol=1e-5)


@pytest.fixture(scope="module")
def path(tiny_models):
    return str(tiny_models["llama"])


@pytest.fixture(scope="module", params=["bfloat16", "float32"])
def dtype(request):
    return request.param


@pytest.fixture(scope="module")
def unpacked(path, dtype):
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("JAXSERVE_PACKED_WEIGHTS", "0")
        llm = LLM(path, dtype=dtype, **OPTIONS)
    assert llm.engine.runner.packed_paths == ()
    return {"outputs": run(llm), "params": llm.engine.runner.param_arrays()}


@pytest.fixture(scope="module")
def llm(path, dtype):
    return LLM(path, dtype=dtype, **OPTIONS)


def test_every_projection_is_packed_and_serves_the_same_outputs(llm, unpacked, dtype):
    packed = llm.engine.runner.packed_paths
    # q, k, v, o, gate, up, down of each of the tiny model's layers
    assert len(packed) == 7 * llm.engine.runner.config.num_hidden_layers
    assert all(p[-1] == "kernel" and p[-2].endswith("_proj") for p in packed)
    stored = llm.engine.runner._stored_arrays()
    for p in packed:   # float32: [N, K]; bfloat16: [N / 32, K / 2, 32, 2]
        assert stored[p].ndim == (2 if dtype == "float32" else 4) and stored[p].dtype == jnp.dtype(dtype)
    assert_same_outputs(run(llm), unpacked["outputs"], dtype)
    assert llm.engine.runner.compiles_after_warmup == 0


def test_param_arrays_are_the_models_own_shapes_and_values(llm, unpacked):
    held = llm.engine.runner.param_arrays()
    assert held.keys() == unpacked["params"].keys()
    for path, want in unpacked["params"].items():
        assert held[path].shape == want.shape and held[path].dtype == want.dtype
        np.testing.assert_array_equal(np.asarray(held[path]), np.asarray(want))


def test_update_params_repacks_and_equals_a_fresh_engine(llm, path, unpacked, dtype):
    new = {k: (v * 1.5).astype(v.dtype) for k, v in unpacked["params"].items()}
    llm.update_params(nnx.traversals.unflatten_mapping(new))
    try:
        fresh = LLM(path, params=nnx.traversals.unflatten_mapping(new), dtype=dtype, **OPTIONS)
        assert fresh.engine.runner.packed_paths == ()   # a caller's arrays are served as they are
        updated = run(llm)
        assert_same_outputs(updated, run(fresh), dtype)
        assert updated != unpacked["outputs"]
        one = next(iter(llm.engine.runner.packed_paths))   # a subset of the packed ones alone
        llm.update_params(nnx.traversals.unflatten_mapping({one: unpacked["params"][one]}))
        held = llm.engine.runner.param_arrays()
        np.testing.assert_array_equal(np.asarray(held[one]), np.asarray(unpacked["params"][one]))
        assert llm.engine.runner.compiles_after_warmup == 0
    finally:
        llm.update_params(nnx.traversals.unflatten_mapping(unpacked["params"]))
    assert_same_outputs(run(llm), unpacked["outputs"], dtype)


def test_a_packed_kernel_of_a_wrong_shape_is_refused(llm, unpacked, dtype):
    one = next(iter(llm.engine.runner.packed_paths))
    kernel = unpacked["params"][one]
    other = jnp.bfloat16 if dtype == "float32" else jnp.float32
    for bad, message in [(kernel.reshape(-1), "shape"), (kernel[:-1], "shape"), (kernel.astype(other), "dtype"),
                         (kernel.reshape(kernel.shape[0], -1).T, "shape")]:   # float32's stored layout
        with pytest.raises(ValueError, match=message):
            llm.update_params(nnx.traversals.unflatten_mapping({one: bad}))
    assert_same_outputs(run(llm), unpacked["outputs"], dtype)


def test_sleep_with_the_weights_offloaded_and_wake_up_change_nothing(llm, unpacked, dtype):
    before = run(llm)
    llm.sleep(level=2)
    assert all(a is None for a in llm.engine.runner.param_arrays().values())
    llm.wake_up()
    assert_same_outputs(run(llm), before, dtype)   # (float32: a one-row step's dot products are not the tiles')
    assert_same_outputs(before, unpacked["outputs"], dtype)
    assert llm.engine.runner.compiles_after_warmup == 0
