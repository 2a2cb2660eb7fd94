"""ModelConfig.from_hf_config over the config.json variants real checkpoints ship, and RoPE tables."""

from __future__ import annotations

import numpy as np
import pytest

from jaxserve.models.config import ModelConfig, RopeScaling

BASE = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "vocab_size": 512,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "rms_norm_eps": 1e-5,
    "max_position_embeddings": 256,
    "bos_token_id": 1,
    "eos_token_id": 2,
}

# The rope block of Llama-3.1/3.2 config.json files (transformers < 5 style).
LLAMA31_ROPE = {
    "rope_theta": 500000.0,
    "rope_scaling": {
        "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192, "rope_type": "llama3",
    },
}


def test_llama_defaults():
    c = ModelConfig.from_hf_config(BASE)
    assert (c.head_dim, c.num_queries_per_kv, c.rope_theta) == (16, 2, 10000.0)
    assert c.rope_scaling == RopeScaling()
    assert (c.attention_bias, c.o_proj_bias, c.mlp_bias, c.qk_norm) == (False, False, False, False)
    assert c.layer_sliding_windows == (None, None) and c.sliding_window is None
    assert (c.bos_token_id, c.eos_token_ids, c.tie_word_embeddings) == (1, (2,), False)


def test_rope_theta_from_top_level_or_rope_parameters():
    old = ModelConfig.from_hf_config({**BASE, "rope_theta": 1e5})
    new = ModelConfig.from_hf_config({**BASE, "rope_parameters": {"rope_type": "default", "rope_theta": 1e5}})
    assert old.rope_theta == new.rope_theta == 1e5


def test_llama3_scaling_from_rope_scaling_or_rope_parameters():
    old = ModelConfig.from_hf_config({**BASE, **LLAMA31_ROPE, "eos_token_id": [128001, 128008, 128009]})
    params = {**LLAMA31_ROPE["rope_scaling"], "rope_theta": 500000.0}
    new = ModelConfig.from_hf_config({**BASE, "rope_parameters": params})
    assert old.rope_scaling == new.rope_scaling == RopeScaling("llama3", 8.0, 1.0, 4.0, 8192)
    assert old.rope_theta == new.rope_theta == 500000.0
    assert old.eos_token_ids == (128001, 128008, 128009)


def test_llama3_inv_freq_matches_transformers():
    import torch  # noqa: F401  (transformers' rope functions return torch tensors)
    import transformers
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from jaxserve.models.layers import rope_inv_freq

    hf = transformers.LlamaConfig(
        hidden_size=4096, num_attention_heads=32, head_dim=128,
        rope_parameters={**LLAMA31_ROPE["rope_scaling"], "rope_theta": 500000.0},
    )
    expected, attention_factor = ROPE_INIT_FUNCTIONS["llama3"](hf)
    ours = ModelConfig.from_hf_config({**BASE, **LLAMA31_ROPE, "hidden_size": 4096, "num_attention_heads": 32,
                                       "num_key_value_heads": 8})
    assert attention_factor == 1.0
    # HF computes in float32, we in float64 then round: a few ulps apart.
    np.testing.assert_allclose(rope_inv_freq(128, ours.rope_theta, ours.rope_scaling), expected.numpy(), rtol=1e-6)


def test_qwen2_biases_and_disabled_sliding_window():
    qwen2 = {**BASE, "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2",
             "use_sliding_window": False, "sliding_window": 32768, "max_window_layers": 1}
    c = ModelConfig.from_hf_config(qwen2)
    assert (c.attention_bias, c.o_proj_bias) == (True, False)
    assert c.sliding_window is None and c.layer_sliding_windows == (None, None)
    on = ModelConfig.from_hf_config({**qwen2, "use_sliding_window": True, "sliding_window": 16})
    assert on.layer_sliding_windows == (None, 16)  # only layers >= max_window_layers


def test_qwen3_qk_norm_and_mistral_window():
    q3 = ModelConfig.from_hf_config({**BASE, "model_type": "qwen3", "attention_bias": True})
    assert q3.qk_norm and q3.attention_bias and q3.o_proj_bias
    mistral = {**BASE, "architectures": ["MistralForCausalLM"], "model_type": "mistral"}
    assert ModelConfig.from_hf_config({**mistral, "sliding_window": 8}).layer_sliding_windows == (8, 8)
    assert ModelConfig.from_hf_config({**mistral, "sliding_window": None}).sliding_window is None


def test_head_dim_null_means_hidden_over_heads():
    assert ModelConfig.from_hf_config({**BASE, "head_dim": None}).head_dim == 16
    assert ModelConfig.from_hf_config({**BASE, "head_dim": 32}).head_dim == 32


@pytest.mark.parametrize(
    "change, field",
    [
        ({"hidden_size": None}, "hidden_size"),
        ({"vocab_size": -1}, "vocab_size"),
        ({"num_key_value_heads": 3}, "num_key_value_heads"),
        ({"architectures": []}, "architectures"),
        ({"hidden_act": "gelu"}, "hidden_act"),
        ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0}}, "yarn"),
        ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, "low_freq_factor"),
        ({"tie_word_embeddings": "yes"}, "tie_word_embeddings"),
        ({"eos_token_id": "2"}, "eos_token_id"),
    ],
)
def test_invalid_fields_are_named(change, field):
    d = {**BASE, **change}
    d = {k: v for k, v in d.items() if not (k == "hidden_size" and v is None)}
    with pytest.raises(ValueError, match=field):
        ModelConfig.from_hf_config(d)
