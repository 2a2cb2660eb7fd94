"""The `cpu` backend's native K/V write (`native_cpu.write_kv`, native/step_ops.cc) stores the same
bits as the jnp scatter `write_kv_cache`, in the donated pool's own buffer."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from kernels_pallas import native_cpu, write_kv_cache

KVH, NB, BS, D = 3, 9, 4, 8


def case(pool_dtype, kv_dtype, tokens, seed=0):
    """A random pool, K/V of `tokens` tokens, and distinct slots in scattered blocks plus slots the
    scatter drops (past the pool) or counts from the end (negative)."""
    rng = np.random.default_rng(seed)
    bits = rng.standard_normal((2, KVH, NB, BS, D)).astype(np.float32)
    if pool_dtype == jnp.uint16:
        pool = np.asarray(jnp.asarray(bits, kv_dtype)).view(np.uint16)
    else:
        pool = np.asarray(jnp.asarray(bits, pool_dtype))
    k, v = (jnp.asarray(rng.standard_normal((tokens, KVH, D)), kv_dtype) for _ in range(2))
    perm = rng.permutation(NB * BS).astype(np.int32)
    slots = perm[:tokens].copy()
    slots[1::7] = perm[tokens:tokens + len(slots[1::7])] - NB * BS    # unused slots, counted from the end
    slots[2::5] = NB * BS + 3 + np.arange(len(slots[2::5]))            # past the pool: dropped
    return jnp.asarray(pool), k, v, jnp.asarray(slots)


@pytest.mark.parametrize("pool_dtype,kv_dtype", [
    (jnp.float32, jnp.float32), (jnp.uint16, jnp.bfloat16), (jnp.uint16, jnp.float16), (jnp.float32, jnp.bfloat16),
    (jnp.bfloat16, jnp.bfloat16)], ids=["f32", "bf16-bits", "f16-bits", "bf16-into-f32", "bf16-pool"])
@pytest.mark.parametrize("tokens", [1, 7, 30])
def test_native_write_equals_the_scatter(pool_dtype, kv_dtype, tokens):
    assert native_cpu.available()
    pool, k, v, slots = case(pool_dtype, kv_dtype, tokens, seed=tokens)
    want = np.asarray(jax.jit(write_kv_cache)(pool, k, v, slots))
    got = np.asarray(jax.jit(native_cpu.write_kv)(pool, k, v, slots))
    assert got.dtype == want.dtype
    np.testing.assert_array_equal(got.view(np.uint8), want.view(np.uint8))
    assert (got != np.asarray(pool)).any()


def test_padding_tokens_all_writing_slot_zero_leave_the_rest_right():
    """The runner sends padding tokens to slot 0 (the null block), many of them: whichever wins
    there, every other slot holds what the scatter writes."""
    pool, k, v, slots = case(jnp.uint16, jnp.bfloat16, 20, seed=5)
    slots = jnp.asarray(np.where(np.arange(20) >= 12, 0, np.abs(np.asarray(slots)) % (NB * BS - BS) + BS), np.int32)
    want = np.asarray(jax.jit(write_kv_cache)(pool, k, v, slots))
    got = np.asarray(jax.jit(native_cpu.write_kv)(pool, k, v, slots))
    np.testing.assert_array_equal(got[:, :, 1:], want[:, :, 1:])


def test_native_write_updates_the_donated_pool_in_place():
    pool, k, v, slots = case(jnp.uint16, jnp.bfloat16, 7)
    before = pool.unsafe_buffer_pointer()
    write = jax.jit(native_cpu.write_kv, donate_argnums=0)
    out = write(pool, k, v, slots)
    assert out.unsafe_buffer_pointer() == before
    assert "copy(" not in write.lower(jnp.zeros_like(out), k, v, slots).compile().as_text().split("custom-call")[0]


@pytest.mark.parametrize("pool,k,v,slots,match", [
    (jnp.zeros((2, KVH, NB, BS, D)), jnp.zeros((4, KVH + 1, D)), jnp.zeros((4, KVH + 1, D)), jnp.zeros(4, jnp.int32),
     "from kv_cache"),
    (jnp.zeros((2, KVH, NB, BS, D), jnp.uint16), jnp.zeros((4, KVH, D)), jnp.zeros((4, KVH, D)),
     jnp.zeros(4, jnp.int32), "16-bit float bits"),
    (jnp.zeros((2, KVH, NB, BS, D)), jnp.zeros((4, KVH, D)), jnp.zeros((4, KVH, D)), jnp.zeros(3, jnp.int32),
     "slot_mapping length"),
    (jnp.zeros((2, KVH, NB, BS, D)), jnp.zeros((4, KVH, D)), jnp.zeros((4, KVH, D)), jnp.zeros(4), "int32"),
])
def test_native_write_refuses_what_the_scatter_refuses(pool, k, v, slots, match):
    for write in (native_cpu.write_kv, write_kv_cache):
        with pytest.raises(ValueError, match=match):
            write(pool, k, v, slots)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_attention_layer_writes_natively_on_the_cpu_backend(dtype, monkeypatch):
    """The `cpu` backend's attention lowers to the native write (no scatter); JAXSERVE_NATIVE_KV_WRITE=0
    keeps the scatter. bfloat16: the same cache and output bit for bit (RoPE rounds every step to
    bf16). float32: XLA fuses k's RoPE differently without the scatter (a multiply-add contracted or
    not), so a few K values move by an ulp."""
    from jaxserve.models.config import ModelConfig
    from jaxserve.models.layers import Attention
    from kernels_pallas.oracle import make_batch
    from jaxserve.models.metadata import AttentionMetadata
    config = ModelConfig.from_hf_config(dict(
        architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=64, hidden_size=32,
        intermediate_size=64, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=64))
    config = dataclasses.replace(config, attention_backend="cpu")
    attn = Attention(config, sliding_window=None, dtype=dtype, param_dtype=dtype, rngs=nnx.Rngs(0))
    _, cache, tables, ctx, qsl, num_seqs = make_batch([(9, 3), (5, 1)], num_kv_heads=2, head_dim=8, block_size=4)
    if dtype == jnp.bfloat16:
        cache = np.asarray(jnp.asarray(cache, jnp.bfloat16)).view(np.uint16)
    x = jnp.asarray(np.random.default_rng(3).standard_normal((4, 32)), dtype)
    positions = jnp.asarray([6, 7, 8, 4], jnp.int32)
    slots = jnp.asarray([tables[0][p // 4] * 4 + p % 4 for p in (6, 7, 8)] + [tables[1][1] * 4], jnp.int32)
    md = AttentionMetadata(slot_mapping=slots, block_tables=jnp.asarray(tables), context_lens=jnp.asarray(ctx),
                           query_start_loc=jnp.asarray(qsl), num_seqs=jnp.asarray(num_seqs))
    run = jax.jit(lambda x, cache: attn(x, positions, cache, md))
    assert "jaxserve_write_kv" in run.lower(x, jnp.asarray(cache)).as_text()
    got = run(x, jnp.asarray(cache))
    monkeypatch.setenv("JAXSERVE_NATIVE_KV_WRITE", "0")
    scatter = jax.jit(lambda x, cache: attn(x, positions, cache, md))
    assert "jaxserve_write_kv" not in scatter.lower(x, jnp.asarray(cache)).as_text()
    want = scatter(x, jnp.asarray(cache))
    for g, w in zip(got[::-1], want[::-1]):   # the cache, then the output
        if dtype == jnp.bfloat16:
            np.testing.assert_array_equal(np.asarray(g), np.asarray(w))
        else:
            np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-6, atol=1e-6)


def _rotated_by_xla(k, cos, sin):
    """What the model's jitted step writes for a bf16 k: `apply_rope`'s rotate-half, fused by XLA."""
    x1, x2 = jnp.split(k, 2, axis=-1)
    return k * cos[:, None, :] + jnp.concatenate([-x2, x1], axis=-1) * sin[:, None, :]


@pytest.mark.skipif(not native_cpu.gemm_available(), reason="no AVX-512 here")
@pytest.mark.parametrize("head_dim", [32, 64, 128])
def test_k_rotated_on_its_way_in_has_the_bits_of_xlas_rope(head_dim):
    """`write_kv(rope=(cos, sin))` rotates bf16 k inside the write: the pool gets what XLA's fusion of the
    rotate-half RoPE and the plain write store, bit for bit (specials included); V as it is."""
    from jaxserve.models.layers import rope_inv_freq, rope_tables
    from jaxserve.models.config import RopeScaling
    rng = np.random.default_rng(head_dim)
    tokens = 40
    pool = jnp.asarray(np.asarray(jnp.asarray(rng.standard_normal((2, KVH, NB * 2, BS, head_dim)),
                                              jnp.bfloat16)).view(np.uint16))
    k = rng.standard_normal((tokens, KVH, head_dim)).astype(np.float32) * 3
    k[0, 0, :4] = [np.nan, np.inf, -np.inf, 3e38]          # specials and a product past bf16's range
    k[1, 1, :3] = [1e-39, -2e-40, 6e-39]                    # subnormal inputs
    k, v = jnp.asarray(k, jnp.bfloat16), jnp.asarray(rng.standard_normal((tokens, KVH, head_dim)), jnp.bfloat16)
    positions = jnp.asarray(rng.integers(0, 40000, size=tokens), jnp.int32)
    cos, sin = rope_tables(positions, rope_inv_freq(head_dim, 10000.0, RopeScaling()), jnp.bfloat16)
    slots = jnp.asarray(rng.permutation(NB * 2 * BS)[:tokens], jnp.int32)
    want = jax.jit(lambda pool, k, v: native_cpu.write_kv(pool, _rotated_by_xla(k, cos, sin), v, slots))(pool, k, v)
    got = jax.jit(lambda pool, k, v: native_cpu.write_kv(pool, k, v, slots, rope=(cos, sin)))(pool, k, v)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    rotated = np.asarray(got)[0, 0].reshape(-1, head_dim)[np.asarray(slots)[0]]
    assert np.isnan(np.asarray(jnp.asarray(rotated.view(jnp.bfloat16), jnp.float32))).any()


def test_write_rope_refuses_what_it_cannot_rotate():
    pool, k, v, slots = case(jnp.float32, jnp.float32, 4)
    cos = sin = jnp.zeros((4, D), jnp.bfloat16)
    with pytest.raises(ValueError, match="bfloat16 k into a uint16 pool"):
        native_cpu.write_kv(pool, k, v, slots, rope=(cos, sin))
    if native_cpu.gemm_available():
        rng = np.random.default_rng(0)
        pool = jnp.zeros((2, KVH, NB, BS, 32), jnp.uint16)
        k = v = jnp.asarray(rng.standard_normal((4, KVH, 32)), jnp.bfloat16)
        with pytest.raises(ValueError, match=r"cos and sin \[T, D\] = \[4, 32\] bfloat16"):
            native_cpu.write_kv(pool, k, v, slots, rope=(jnp.zeros((4, 16), jnp.bfloat16),) * 2)


@pytest.mark.skipif(not native_cpu.gemm_available(), reason="no AVX-512 here")
@pytest.mark.parametrize("head_dim", [64, 128])
def test_attention_layer_rotates_q_and_k_natively_with_the_same_bits(head_dim, monkeypatch):
    """A bf16 layer on the `cpu` backend: k goes into the native write and q into the attention kernel
    unrotated, each rotated there; the cache and the output are those of JAXSERVE_NATIVE_ROPE=0 (XLA's
    RoPE) bit for bit. Head dim 128: q unscaled (the tiles scale the scores)."""
    from jaxserve.models.config import ModelConfig
    from jaxserve.models.layers import Attention
    from jaxserve.models.metadata import AttentionMetadata
    from kernels_pallas.oracle import make_batch
    config = dataclasses.replace(ModelConfig.from_hf_config(dict(
        architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=64, hidden_size=128,
        intermediate_size=64, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2, head_dim=head_dim,
        max_position_embeddings=64)), attention_backend="cpu")
    attn = Attention(config, sliding_window=None, dtype=jnp.bfloat16, param_dtype=jnp.bfloat16, rngs=nnx.Rngs(0))
    _, cache, tables, ctx, qsl, num_seqs = make_batch([(9, 3), (5, 1)], num_kv_heads=2, head_dim=head_dim,
                                                      block_size=16, num_blocks=8, max_blocks=2)
    cache = jnp.asarray(np.asarray(jnp.asarray(cache, jnp.bfloat16)).view(np.uint16))
    x = jnp.asarray(np.random.default_rng(3).standard_normal((4, 128)), jnp.bfloat16)
    positions = jnp.asarray([6, 7, 8, 4], jnp.int32)
    slots = jnp.asarray([tables[0][0] * 16 + p for p in (6, 7, 8)] + [tables[1][0] * 16 + 4], jnp.int32)
    md = AttentionMetadata(slot_mapping=slots, block_tables=jnp.asarray(tables), context_lens=jnp.asarray(ctx),
                           query_start_loc=jnp.asarray(qsl), num_seqs=jnp.asarray(num_seqs))
    results = {}
    for switch in ("1", "0"):
        monkeypatch.setenv("JAXSERVE_NATIVE_ROPE", switch)
        run = jax.jit(lambda x, cache: attn(x, positions, cache, md))
        hlo = run.lower(x, cache).as_text().splitlines()
        for target in ("@jaxserve_write_kv", "@jaxserve_paged_context"):
            calls = [line for line in hlo if target in line]
            assert len(calls) == 1 and ("rope = 1 : i64" in calls[0]) == (switch == "1"), target
        results[switch] = [np.asarray(a) for a in run(x, cache)]
    for got, want in zip(results["1"], results["0"]):   # the output, then the cache
        np.testing.assert_array_equal(got, want)
    assert (results["1"][1] != np.asarray(cache)).any()
