"""Parity of the nnx Llama-family models with Hugging Face transformers (torch CPU, float32).

Each tiny model (see tests/fixtures/tiny_models.py) is loaded from its HF folder into
our model and run through a paged KV cache over the scenarios the engine produces: a
whole prefill, a chunked prefill, decode steps, a mixed flat batch of sequences at
different stages, and a prefix-cache hit that reuses another sequence's blocks. Every
logit row is compared with transformers' forward over that sequence alone.

Every step goes through one `jax.jit` over `nnx.split`/`nnx.merge` (the runner's hot
path) with fixed padded shapes, so each model compiles once.
"""

from __future__ import annotations

import json
from collections.abc import Callable
import dataclasses
from dataclasses import dataclass, field

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import safetensors.numpy
from flax import nnx

from jaxserve.models import AttentionMetadata, ModelConfig, get_model_class, load_weights
from tests.fixtures.tiny_models import TINY_MODEL_NAMES

BLOCK_SIZE = 4
NUM_BLOCKS = 40          # block 0 is the null block padding writes go to; never handed out
MAX_BLOCKS_PER_SEQ = 10  # 40 tokens per sequence
TOKEN_BUCKET = 32        # every step is padded to this many tokens ...
SEQ_BUCKET = 4           # ... and this many sequence rows, so nothing recompiles

# Tolerance. Both sides compute in float32 (attention softmax in float32 too), so the
# two differ only by summation order: a few ulps per op over 2 layers, ~1e-6 relative
# to the logit scale. Logits here are O(1)-O(10) (unit-variance hidden states times
# the lm head / unit-scale tied embeddings). rtol 1e-4 is the spec; atol covers logits
# that happen to sit near 0, where a relative bound is meaningless: 1e-4 of the logit
# scale (the rms of the reference logits), i.e. the same 1e-4 relative, measured
# against the scale the errors actually come from. Measured: max error ~3e-6 of scale.
RTOL = 1e-4
ATOL_OF_SCALE = 1e-4


def assert_logits_close(actual: np.ndarray, expected: np.ndarray) -> None:
    scale = float(np.sqrt(np.mean(np.square(expected))))
    np.testing.assert_allclose(actual, expected, rtol=RTOL, atol=ATOL_OF_SCALE * scale)


# --------------------------------------------------------------------------- models


@dataclass
class Loaded:
    """Our model (jitted forward) and the HF reference for one tiny model folder."""

    config: ModelConfig
    model: nnx.Module
    step: Callable      # (ids, positions, kv_caches, md) -> (logits [T, vocab], kv_caches)
    hf_model: object

    def hf_logits(self, tokens: np.ndarray) -> np.ndarray:
        """transformers' logits [len, vocab] for one sequence run alone."""
        import torch

        with torch.no_grad():
            out = self.hf_model(torch.as_tensor(np.asarray(tokens, np.int64))[None])
        return out.logits[0].float().numpy()

    def new_kv_caches(self) -> list[jax.Array]:
        shape = (2, self.config.num_key_value_heads, NUM_BLOCKS, BLOCK_SIZE, self.config.head_dim)
        return [jnp.zeros(shape, jnp.float32) for _ in range(self.config.num_hidden_layers)]


def load_model(path, attention_backend: str = "reference") -> nnx.Module:
    config = ModelConfig.from_hf_config(json.loads((path / "config.json").read_text()))
    config = dataclasses.replace(config, attention_backend=attention_backend)
    model = get_model_class(config)(config, dtype=jnp.float32, param_dtype=jnp.float32, rngs=nnx.Rngs(0))
    load_weights(model, safetensors.numpy.load_file(path / "model.safetensors"))
    return model


def jit_forward(model: nnx.Module):
    """The runner's hot-path pattern: jax.jit over nnx.split / nnx.merge, cache donated."""
    graphdef, state = nnx.split(model)

    @jax.jit
    def forward(state, input_ids, positions, kv_caches, md):
        m = nnx.merge(graphdef, state)
        hidden, kv_caches = m(input_ids, positions, kv_caches, md)
        return m.compute_logits(hidden), kv_caches

    def step(input_ids, positions, kv_caches, md):
        # "highest": keep float32 matmuls exact on GPUs too (TF32 would break 1e-4).
        with jax.default_matmul_precision("highest"):
            return forward(state, input_ids, positions, kv_caches, md)

    step.jitted = forward
    return step


_LOADED: dict[str, Loaded] = {}


# Each family through the oracle attention and through the CPU production path.
@pytest.fixture(params=[f"{name}-{backend}" for name in TINY_MODEL_NAMES for backend in ("reference", "cpu")])
def loaded(request, tiny_models) -> Loaded:
    key = request.param
    if key not in _LOADED:
        import transformers

        name, backend = key.rsplit("-", 1)
        path = tiny_models[name]
        model = load_model(path, backend)
        hf_model = transformers.AutoModelForCausalLM.from_pretrained(
            path, dtype="float32", attn_implementation="eager"
        ).eval()
        _LOADED[key] = Loaded(model.config, model, jit_forward(model), hf_model)
    return _LOADED[key]


# --------------------------------------------------------------------- paged batches


class BlockAllocator:
    """Hands out block ids in a shuffled (non-contiguous) order, never the null block 0."""

    def __init__(self, seed: int):
        self.free = list(np.random.default_rng(seed).permutation(np.arange(1, NUM_BLOCKS)))

    def take(self) -> int:
        return int(self.free.pop())


@dataclass
class Seq:
    tokens: np.ndarray                             # every token of the sequence, known up front
    blocks: list[int] = field(default_factory=list)
    num_computed: int = 0                          # tokens whose K/V are in the cache


def run_step(lm: Loaded, kv_caches, alloc: BlockAllocator, work: list[tuple[Seq, int]]):
    """One flat step computing `n` more tokens of each `(seq, n)`; returns per-seq logits and caches."""
    ids, pos, slots, starts, ctx, tables = [], [], [], [0], [], []
    for seq, n in work:
        end = seq.num_computed + n
        while len(seq.blocks) * BLOCK_SIZE < end:
            seq.blocks.append(alloc.take())
        p = np.arange(seq.num_computed, end)
        ids += list(seq.tokens[p])
        pos += list(p)
        slots += [seq.blocks[i // BLOCK_SIZE] * BLOCK_SIZE + i % BLOCK_SIZE for i in p]
        starts.append(starts[-1] + n)
        ctx.append(end)
        tables.append(seq.blocks + [0] * (MAX_BLOCKS_PER_SEQ - len(seq.blocks)))
    num_tokens, num_seqs = len(ids), len(work)
    assert num_tokens <= TOKEN_BUCKET and num_seqs <= SEQ_BUCKET
    pad_t, pad_s = TOKEN_BUCKET - num_tokens, SEQ_BUCKET - num_seqs
    i32 = lambda x: jnp.asarray(np.asarray(x, np.int32))  # noqa: E731
    md = AttentionMetadata(
        slot_mapping=i32(slots + [0] * pad_t),
        block_tables=i32(tables + [[0] * MAX_BLOCKS_PER_SEQ] * pad_s),
        context_lens=i32(ctx + [0] * pad_s),
        query_start_loc=i32(starts + [num_tokens] * pad_s),
        num_seqs=i32(num_seqs),
    )
    logits, kv_caches = lm.step(i32(ids + [0] * pad_t), i32(pos + [0] * pad_t), kv_caches, md)
    logits = np.asarray(logits)
    per_seq = []
    for s, (seq, n) in enumerate(work):
        per_seq.append(logits[starts[s]:starts[s + 1]])
        seq.num_computed += n
    return per_seq, kv_caches


def random_tokens(seed: int, n: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(3, 512, size=n)


# ---------------------------------------------------------------------------- tests


def test_prefill_in_one_call(loaded):
    seq = Seq(random_tokens(1, 20))
    (logits,), _ = run_step(loaded, loaded.new_kv_caches(), BlockAllocator(1), [(seq, 20)])
    assert_logits_close(logits, loaded.hf_logits(seq.tokens))


def test_chunked_prefill_over_three_calls(loaded):
    seq = Seq(random_tokens(2, 20))
    kv, alloc, got = loaded.new_kv_caches(), BlockAllocator(2), []
    for n in (7, 6, 7):  # chunk edges fall mid-block
        (logits,), kv = run_step(loaded, kv, alloc, [(seq, n)])
        got.append(logits)
    assert_logits_close(np.concatenate(got), loaded.hf_logits(seq.tokens))


def test_decode_steps_after_prefill(loaded):
    seq = Seq(random_tokens(3, 18))
    kv, alloc = loaded.new_kv_caches(), BlockAllocator(3)
    (prefill,), kv = run_step(loaded, kv, alloc, [(seq, 13)])
    decoded = []
    for _ in range(5):  # crosses the block boundary at 16
        (logits,), kv = run_step(loaded, kv, alloc, [(seq, 1)])
        decoded.append(logits)
    expected = loaded.hf_logits(seq.tokens)
    assert_logits_close(prefill, expected[:13])
    assert_logits_close(np.concatenate(decoded), expected[13:])


def test_mixed_batch_of_three_stages(loaded):
    kv, alloc = loaded.new_kv_caches(), BlockAllocator(4)
    decoding, chunking, fresh = Seq(random_tokens(41, 11)), Seq(random_tokens(42, 15)), Seq(random_tokens(43, 9))
    _, kv = run_step(loaded, kv, alloc, [(decoding, 10), (chunking, 6)])
    (dec, chunk, new), kv = run_step(loaded, kv, alloc, [(decoding, 1), (chunking, 9), (fresh, 9)])
    assert_logits_close(dec, loaded.hf_logits(decoding.tokens)[10:])
    assert_logits_close(chunk, loaded.hf_logits(chunking.tokens)[6:])
    assert_logits_close(new, loaded.hf_logits(fresh.tokens))


def test_prefix_cache_hit_reuses_blocks(loaded):
    kv, alloc = loaded.new_kv_caches(), BlockAllocator(5)
    prefix = random_tokens(51, 12)  # three full blocks
    a = Seq(np.concatenate([prefix, random_tokens(52, 5)]))
    b = Seq(np.concatenate([prefix, random_tokens(53, 7)]))
    _, kv = run_step(loaded, kv, alloc, [(a, len(a.tokens))])
    b.blocks, b.num_computed = a.blocks[:3], 12  # the same physical blocks A wrote
    (tail,), kv = run_step(loaded, kv, alloc, [(b, 7)])
    assert set(b.blocks[3:]).isdisjoint(a.blocks)
    assert_logits_close(tail, loaded.hf_logits(b.tokens)[12:])


@pytest.mark.parametrize("loaded", ["mistral-reference", "mistral-cpu"], indirect=True)
def test_sliding_window_matters(loaded):
    """Mistral's window (8) changes the logits past position 8, so parity really checks it."""
    assert loaded.config.layer_sliding_windows == (8, 8)
    seq = Seq(random_tokens(1, 20))
    (ours,), _ = run_step(loaded, loaded.new_kv_caches(), BlockAllocator(1), [(seq, 20)])
    windowed = loaded.hf_logits(seq.tokens)
    loaded.hf_model.config.sliding_window = None  # HF reads it per forward
    try:
        full = loaded.hf_logits(seq.tokens)
    finally:
        loaded.hf_model.config.sliding_window = 8
    assert_logits_close(ours, windowed)
    np.testing.assert_allclose(full[:8], windowed[:8], rtol=1e-6, atol=1e-6)
    scale = np.sqrt(np.mean(np.square(windowed)))
    assert np.abs(full[8:] - windowed[8:]).max() > 1000 * ATOL_OF_SCALE * scale


def test_one_compile_serves_every_step(loaded):
    """All scenarios above used the same padded shapes: the jitted step compiled once."""
    seq = Seq(random_tokens(7, 3))
    run_step(loaded, loaded.new_kv_caches(), BlockAllocator(7), [(seq, 3)])
    assert loaded.step.jitted._cache_size() == 1


# --------------------------------------------------------------------------- errors


def test_unsupported_architecture_names_it(tiny_models):
    d = json.loads((tiny_models["llama"] / "config.json").read_text())
    config = ModelConfig.from_hf_config({**d, "architectures": ["GPT2LMHeadModel"]})
    with pytest.raises(ValueError, match=r"GPT2LMHeadModel.*supported: LlamaForCausalLM"):
        get_model_class(config)


def test_missing_and_unexpected_tensors_are_named(tiny_models):
    path = tiny_models["qwen2"]
    config = ModelConfig.from_hf_config(json.loads((path / "config.json").read_text()))
    model = get_model_class(config)(config, rngs=nnx.Rngs(0))
    tensors = safetensors.numpy.load_file(path / "model.safetensors")
    missing = {k: v for k, v in tensors.items() if k != "model.layers.1.self_attn.k_proj.bias"}
    with pytest.raises(ValueError, match=r"missing 1 tensor\(s\): model\.layers\.1\.self_attn\.k_proj\.bias"):
        load_weights(model, missing)
    extra = {**tensors, "model.layers.2.mlp.up_proj.weight": tensors["model.layers.0.mlp.up_proj.weight"]}
    with pytest.raises(ValueError, match=r"1 unexpected tensor\(s\): model\.layers\.2\.mlp\.up_proj\.weight"):
        load_weights(model, extra)
    bad = {**tensors, "model.norm.weight": np.ones(63, np.float32)}
    with pytest.raises(ValueError, match=r"model\.norm\.weight has shape \(63,\)"):
        load_weights(model, bad)
