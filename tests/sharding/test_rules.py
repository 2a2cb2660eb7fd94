"""Partition rules, tensor-parallel size checks and KV-head replication (one device; no jax mesh needed)."""

import numpy as np
import pytest
from jax.sharding import AbstractMesh, PartitionSpec as P

from jaxserve.config import EngineConfig
from sharding import PARAM_RULES, check_tensor_parallel, kv_head_replicas, replicate_kv_heads, spec_for
from sharding.rules import valid_tensor_parallel_sizes

MESH4 = AbstractMesh((1, 4), ("dp", "tp"))


@pytest.mark.parametrize("path,shape,spec", [
    ("embed_tokens.embedding", (512, 64), P("tp", None)),
    ("lm_head", (512, 64), P("tp", None)),
    ("layers.0.self_attn.q_proj.kernel", (64, 8, 16), P(None, "tp", None)),
    ("layers.1.self_attn.k_proj.kernel", (64, 4, 16), P(None, "tp", None)),
    ("layers.1.self_attn.v_proj.bias", (4, 16), P("tp", None)),
    ("layers.0.self_attn.o_proj.kernel", (8, 16, 64), P("tp", None, None)),
    ("layers.0.self_attn.o_proj.bias", (64,), P(None)),
    ("layers.0.mlp.gate_proj.kernel", (64, 128), P(None, "tp")),
    ("layers.0.mlp.up_proj.bias", (128,), P("tp")),
    ("layers.0.mlp.down_proj.kernel", (128, 64), P("tp", None)),
    ("layers.0.input_layernorm.weight", (64,), P(None)),
    ("layers.0.self_attn.k_norm.weight", (16,), P(None)),
    ("norm.weight", (64,), P(None)),
])
def test_each_param_role_gets_its_rule(path, shape, spec):
    assert spec_for(path, shape, MESH4) == spec


def test_a_dimension_the_axis_does_not_divide_is_replicated():
    assert spec_for("embed_tokens.embedding", (49153, 576), MESH4) == P(None, None)   # odd vocab
    assert spec_for("layers.0.self_attn.k_proj.kernel", (64, 2, 16), MESH4) == P(None, None, None)


def test_the_last_rule_replicates_everything_else():
    assert PARAM_RULES[-1] == (r".*", P())


def test_sizes_that_do_not_split_the_model_are_refused_with_the_ones_that_work():
    # The default model: 9 heads over 3 KV heads, MLP 1536.
    with pytest.raises(ValueError, match=r"tensor_parallel_size=2 does not split 9 attention heads.*"
                                         r"sizes that work for this model: 1, 3$"):
        check_tensor_parallel(9, 3, 1536, 2, num_devices=8)
    with pytest.raises(ValueError, match="3 KV heads"):
        check_tensor_parallel(12, 3, 1536, 2, num_devices=8)
    check_tensor_parallel(9, 3, 1536, 3, num_devices=8)
    assert valid_tensor_parallel_sizes(32, 8, 14336, 16) == [1, 2, 4, 8, 16]


def test_kv_heads_are_replicated_only_beyond_their_count():
    assert [kv_head_replicas(2, tp) for tp in (1, 2, 4, 8)] == [1, 1, 2, 4]


def test_replicated_kv_heads_serve_the_same_query_heads():
    heads, kv_heads, replicas = 8, 2, 2
    rng = np.random.default_rng(0)
    k = rng.standard_normal((64, kv_heads, 16)).astype(np.float32)
    bias = rng.standard_normal((kv_heads, 16)).astype(np.float32)
    params = {"layers": {0: {"self_attn": {"k_proj": {"kernel": k, "bias": bias},
                                            "q_proj": {"kernel": np.zeros((64, heads, 16))}}}}}
    out = replicate_kv_heads(params, replicas)["layers"][0]["self_attn"]
    wide_k, wide_bias = np.asarray(out["k_proj"]["kernel"]), np.asarray(out["k_proj"]["bias"])
    assert wide_k.shape == (64, kv_heads * replicas, 16)
    assert out["q_proj"]["kernel"].shape == (64, heads, 16)     # untouched
    for h in range(heads):   # query head h reads KV head h // (heads // kv_heads) before and after
        np.testing.assert_array_equal(wide_k[:, h // (heads // (kv_heads * replicas))], k[:, h // (heads // kv_heads)])
        np.testing.assert_array_equal(wide_bias[h // (heads // (kv_heads * replicas))], bias[h // (heads // kv_heads)])


@pytest.mark.parametrize("options,match", [
    (dict(num_processes=2), "needs coordinator_address"),
    (dict(num_processes=2, process_id=2, coordinator_address="127.0.0.1:1"), r"process_id=2 must be in \[0, "),
    (dict(num_processes=0), "num_processes=0 must be a positive integer"),
    (dict(num_processes=2, coordinator_address="127.0.0.1:1", data_parallel_size=2), "one replica spanning"),
    (dict(data_parallel_size=0), "data_parallel_size=0 must be a positive integer"),
])
def test_bad_parallel_options_are_refused(options, match):
    with pytest.raises(ValueError, match=match):
        EngineConfig(**options)


def test_more_devices_than_exist_fail_at_start(tiny_models):
    from jaxserve import LLM

    with pytest.raises(ValueError, match=r"tensor_parallel_size=2 x data_parallel_size=3 needs 6 devices, "
                                         r"but only 1 cpu device\(s\) are available"):
        LLM(str(tiny_models["llama"]), tensor_parallel_size=2, data_parallel_size=3)
