"""The model's attention layers call the kernel named by `ModelConfig.attention_backend`.

Checked by lowering a whole (abstract, weightless) two-layer model step for CUDA / TPU
on this CPU-only machine: every layer must call the kernel's jitted entry (lowered once,
holding the two Pallas calls: decode items and prefill tiles), and the reference
and cpu backends no Pallas call at all (nor, off the CPU platform, a native CPU kernel).
head_dim is 64 here because the Pallas tuning tables start there (the tiny test models use 16).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import pytest
from flax import nnx

from jaxserve.models import AttentionMetadata, ModelConfig, get_model_class
from kernels_pallas import native_cpu

NUM_TOKENS, NUM_SEQS, NUM_BLOCKS, BLOCK_SIZE, MAX_BLOCKS = 32, 4, 16, 16, 4
# config.json of a 2-layer GQA decoder (4 heads over 2 KV heads, head_dim 64)
HF_CONFIGS = {
    "llama": dict(architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=512, hidden_size=64,
                  intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  head_dim=64, max_position_embeddings=256),
}
HF_CONFIGS["mistral"] = dict(HF_CONFIGS["llama"], architectures=["MistralForCausalLM"], model_type="mistral",
                             sliding_window=8)


def _lowered_step(model: str, backend: str, platform: str) -> tuple[str, nnx.Module]:
    """StableHLO of a whole (abstract, weightless) bf16 model step lowered for `platform`, and the model."""
    config = dataclasses.replace(ModelConfig.from_hf_config(HF_CONFIGS[model]), attention_backend=backend)
    abstract = nnx.eval_shape(lambda: get_model_class(config)(
        config, dtype=jnp.bfloat16, param_dtype=jnp.bfloat16, rngs=nnx.Rngs(0)))
    graphdef, state = nnx.split(abstract)

    @jax.jit
    def step(state, input_ids, positions, kv_caches, md):
        return nnx.merge(graphdef, state)(input_ids, positions, kv_caches, md)

    i32 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.int32)  # noqa: E731
    cache = jax.ShapeDtypeStruct((2, config.num_key_value_heads, NUM_BLOCKS, BLOCK_SIZE, 64), jnp.bfloat16)
    md = AttentionMetadata(slot_mapping=i32(NUM_TOKENS), block_tables=i32(NUM_SEQS, MAX_BLOCKS),
                           context_lens=i32(NUM_SEQS), query_start_loc=i32(NUM_SEQS + 1), num_seqs=i32())
    lowered = step.trace(state, i32(NUM_TOKENS), i32(NUM_TOKENS), [cache] * config.num_hidden_layers,
                         md).lower(lowering_platforms=(platform,))
    return lowered.as_text(), abstract


@pytest.mark.parametrize("model, backend, platform, entry, custom_call", [
    ("llama", "reference", "cuda", "@_ragged_paged_attention(", "custom_call @__gpu$xla.gpu.triton"),
    ("mistral", "cpu", "cuda", "@_ragged_paged_attention_cpu(", "custom_call @__gpu$xla.gpu.triton"),
    ("llama", "pallas_gpu", "cuda", "@_ragged_paged_attention_gpu(", "custom_call @__gpu$xla.gpu.triton"),
    ("mistral", "pallas_gpu", "cuda", "@_ragged_paged_attention_gpu(", "custom_call @__gpu$xla.gpu.triton"),
    ("llama", "pallas_tpu", "tpu", "@_ragged_paged_attention_tpu(", "custom_call @tpu_custom_call"),
])
def test_model_step_lowers_to_the_configured_kernel(model, backend, platform, entry, custom_call):
    text, abstract = _lowered_step(model, backend, platform)
    lines = text.splitlines()
    assert sum(f"call {entry}" in line for line in lines) == len(abstract.layers)
    assert sum(custom_call in line for line in lines) == (0 if backend in ("reference", "cpu") else 2)
    assert all(layer.self_attn.attention_backend == backend for layer in abstract.layers)


def test_cpu_backend_on_another_platform_calls_no_native_kernel(monkeypatch):
    """`--attention-backend cpu` on a GPU host: the native kernels are registered for the CPU platform
    only (XLA would refuse the step), so attention, K/V writes, norms and matmuls keep jnp and XLA's
    ops; with JAX's default backend the CPU, the same step calls them."""
    if not native_cpu.available():
        pytest.skip("the native CPU kernels are not built here")
    jax.clear_caches()   # jitted helpers traced with the kernels on would be reused
    on_cpu = _lowered_step("llama", "cpu", "cpu")[0]
    assert "jaxserve_paged_context" in on_cpu and "jaxserve_write_kv" in on_cpu
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    jax.clear_caches()
    assert not native_cpu.available()
    on_gpu = _lowered_step("llama", "cpu", "cuda")[0]
    assert "@_ragged_paged_attention_cpu(" in on_gpu and "jaxserve_" not in on_gpu
    jax.clear_caches()
