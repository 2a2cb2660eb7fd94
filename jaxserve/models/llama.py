"""Llama (2, 3, 3.x) causal LM in flax nnx; the base the other families reuse.

One call runs the decoder over a step's flat token batch: input_ids [T] and absolute
positions [T] in, the final-norm hidden states [T, hidden] and the per-layer KV caches
(passed in, returned updated) out. `compute_logits` maps the hidden rows the runner
samples from to float32 logits. Layers are unrolled in Python (on XLA-CPU this ran ~2x
faster than `lax.scan` over stacked weights).

The runner jits it as `jax.jit` over `nnx.split` / `nnx.merge` (cheaper per call than
`nnx.jit`): the module holds only params and static config, no mutable state.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from jaxserve.models.config import ModelConfig
from jaxserve.models.layers import (DecoderLayer, RMSNorm, add_norm, native_gemm_ok, native_matvec_ok,
                                    native_norm_ok, one_row_safe)
from kernels_pallas import native_cpu
from jaxserve.models.metadata import AttentionMetadata


class LlamaForCausalLM(nnx.Module):
    """Embedding, `num_hidden_layers` decoder layers, final RMSNorm, (tied or own) lm head."""

    def __init__(self, config: ModelConfig, *, dtype=jnp.float32, param_dtype=jnp.float32, rngs: nnx.Rngs):
        self.config = config
        common = dict(dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        self.embed_tokens = nnx.Embed(config.vocab_size, config.hidden_size, **common)
        self.layers = nnx.List(
            [DecoderLayer(config, layer_idx=i, **common) for i in range(config.num_hidden_layers)]
        )
        self.norm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps, **common)
        if config.tie_word_embeddings:
            self.lm_head = None
        else:  # [vocab, hidden], the same layout as the embedding table (and HF's lm_head.weight)
            self.lm_head = nnx.Param(
                nnx.initializers.normal(0.02)(rngs.params(), (config.vocab_size, config.hidden_size), param_dtype)
            )

    def __call__(
        self,
        input_ids: jax.Array,          # [T] int32
        positions: jax.Array,          # [T] int32, absolute positions in each sequence
        kv_caches: list[jax.Array],    # per layer [2, num_kv_heads, num_blocks, block_size, head_dim]
        md: AttentionMetadata,
    ) -> tuple[jax.Array, list[jax.Array]]:
        if len(kv_caches) != len(self.layers):
            raise ValueError(f"got {len(kv_caches)} KV caches for {len(self.layers)} layers")
        x, pending = self.embed_tokens(input_ids), None    # [T, hidden]; each layer's MLP output waits for
        new_caches = []                                    # the next norm (`add_norm`)
        for layer, kv_cache in zip(self.layers, kv_caches):
            x, pending, kv_cache = layer(x, positions, kv_cache, md, pending)
            new_caches.append(kv_cache)
        native = native_norm_ok(self.norm, md, self.config.attention_backend == "cpu")   # as each layer decides
        return add_norm(self.norm, x, pending, native)[1], new_caches                   # [T, hidden]

    def forward(self, input_ids: jax.Array) -> jax.Array:
        """[T] token ids of one sequence -> [T, vocab] float32 logits, by dense causal attention and
        no KV cache: the differentiable path for training the same params the engine serves."""
        x = self.embed_tokens(input_ids)
        positions = jnp.arange(input_ids.shape[0], dtype=jnp.int32)
        pending = None
        for layer in self.layers:
            x, pending, _ = layer(x, positions, None, None, pending)
        return self.compute_logits(add_norm(self.norm, x, pending, native=False)[1])

    def compute_logits(self, hidden: jax.Array, num_rows: jax.Array | None = None) -> jax.Array:
        """[N, hidden] -> [N, vocab] float32 logits. `num_rows` (int32 scalar): only the first rows
        are wanted (a step's sampling rows; the rest is padding), which the native CPU matmul
        leaves at 0 instead of computing; other paths compute every row."""
        weight = self.embed_tokens.embedding[...] if self.lm_head is None else self.lm_head[...]  # [vocab, hidden]
        if self.config.native_rows and native_matvec_ok(hidden, weight):
            return native_cpu.matvec(hidden, weight, transposed=True)[None]    # batch-1 decode: native
        if self.config.native_rows and native_gemm_ok(hidden, weight):    # 2+ rows: x w^T, native
            return native_cpu.matmul(hidden, weight, transposed=True, rows=num_rows)
        weight = weight.astype(hidden.dtype)
        return one_row_safe(lambda h: jnp.einsum("nd,vd->nv", h, weight, preferred_element_type=jnp.float32), hidden)
