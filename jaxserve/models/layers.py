"""Layers shared by the Llama-family decoders: RMSNorm, RoPE, SwiGLU MLP, paged attention.

What flows through: one step's flat token batch `x` [T, hidden] (tokens of many
sequences back to back, see `AttentionMetadata`), absolute `positions` [T], and per
layer a paged KV cache [2, num_kv_heads, num_blocks, block_size, head_dim] that is
passed in and returned updated. Everything here runs inside the caller's jitted step.

Numerics follow Hugging Face transformers: RMSNorm is computed in float32 and cast back
before the weight multiplies; RoPE uses the rotate-half convention with cos/sin
computed in float32 from `positions * inv_freq`; attention runs in float32 inside the
kernel.

Parameter layout (the checkpoint name table in `registry.py` maps HF tensors onto it):
projections keep the head axis explicit, q_proj [hidden, heads, head_dim], o_proj
[heads, head_dim, hidden], so tensor-parallel rules can name the head axis.
"""

from __future__ import annotations

import functools
import math
import os

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxserve.models.config import ModelConfig, RopeScaling
from jaxserve.models.metadata import AttentionMetadata
from kernels_pallas import native_cpu, ragged_paged_attention, write_kv_cache


class Proj(nnx.Einsum):
    """A projection that accumulates in float32 and rounds its output once to the compute dtype.

    On XLA:CPU a bfloat16 x bfloat16 dot that returns bfloat16 takes a slow path (half the
    float32 rate), while the same dot asked for a float32 result runs the CPU's bf16
    dot-product instructions (~2x the float32 rate; benchmarks/RESULTS.md). Rounding the
    float32 result to bfloat16 is what a bf16 GEMM does anyway; for float32 models this is
    an ordinary einsum. Params keep nnx.Einsum's names (`kernel`, `bias`).

    With `native_rows` (the "cpu" attention backend), a one-row input (a batch-1 decode step) runs
    through the native CPU matvec, which streams the weight in place,
    and 2+ rows through the native register-tiled matmul (`native_cpu.matmul`, 1.1-2x XLA's
    rate at the model's shapes, most at decode-sized row counts; benchmarks/RESULTS.md).
    `packed` (set by `pack_for_tiles`): the kernel is laid out for the AMX tiles. bfloat16: every
    row count, one included, takes `native_cpu.matmuls_packed`; float32 (stored [N, K]): 2+ rows
    take `native_cpu.matmuls(transposed=True)` (the tiles, as three bf16 parts), one row
    `native_cpu.matvecs(transposed=True)`.
    """

    def __init__(self, einsum_str: str, kernel_shape, bias_shape=None, *, dtype, param_dtype, rngs: nnx.Rngs,
                 native_rows: bool = False):
        super().__init__(einsum_str, kernel_shape, bias_shape, dtype=dtype, param_dtype=param_dtype,
                         preferred_element_type=jnp.float32, rngs=rngs)
        lhs, rest = einsum_str.split(",")
        rhs, out = rest.split("->")
        # Only "t<c>,<c><o>->t<o>" contractions (every projection here) map onto x [K] . W [K, N].
        self.native_rows = native_rows and rhs.startswith(lhs[1:]) and out == "t" + rhs[len(lhs) - 1:]
        # Static: the kernel is laid out for the AMX tiles (`pack_for_tiles`), not kernel_shape.
        self.packed = False

    def __call__(self, x: jax.Array) -> jax.Array:
        if self.packed:
            return project_together([self], x)[0]
        kernel = self.kernel[...]
        if self.native_rows and (native_matvec_ok(x, kernel) or native_gemm_ok(x, kernel)):
            return project_together([self], x)[0]
        y = one_row_safe(super().__call__, x)
        return y.astype(self.dtype or x.dtype)

    def unrounded(self, x: jax.Array) -> jax.Array:
        """This projection with its rounding to the compute dtype left to the caller (e.g.
        `add_rms_norm`): the native float32 product plus the bias where the native matvec/matmul
        takes x; else the finished output (so also for a bias-free pre-packed projection, whose
        product comes rounded: `native_products`)."""
        ys = native_products([self], x)
        if ys is None:
            return self(x)
        return ys[0] if self.bias is None else ys[0] + self.bias[...].astype(jnp.float32)

    def finish(self, y: jax.Array, x_dtype) -> jax.Array:
        """A native float32 product -> this projection's output: plus the bias, in the compute dtype."""
        if self.bias is not None:
            y = y + self.bias[...].astype(jnp.float32)
        return y.astype(self.dtype or x_dtype)


def project_together(projs: list[Proj], x: jax.Array) -> list[jax.Array]:
    """[p(x) for p in projs]; one native call for all of them (q/k/v, gate/up) when each would take
    the native matvec (one row) or matmul: one work split instead of several small ones."""
    ys = native_products(projs, x)
    if ys is None:
        return [p(x) for p in projs]
    return [p.finish(y, x.dtype) for p, y in zip(projs, ys)]


def native_products(projs: list[Proj], x: jax.Array) -> list[jax.Array] | None:
    """The products x W of `projs` (no bias) from one native call, or None when one of them would
    not take the native matvec (one row) or matmul here: float32 sums, or for pre-packed bias-free
    bf16 projections the sums already rounded to bfloat16 (what every consumer does to them
    first: `Proj.finish`, `add_rms_norm`, `silu_mul`), at half the bytes written."""
    kernels = [p.kernel[...] for p in projs]
    rows, depth = x.shape[0], x[0].size
    if any(p.packed for p in projs):   # `pack_for_tiles` packs a group whole
        if not all(p.packed for p in projs) or x.dtype != kernels[0].dtype:
            raise ValueError("pre-packed projections take x of their own dtype, and are called together only "
                             "with each other")
        if x.dtype == jnp.float32:   # [N, K] kernels: the tiles at 2+ rows, dot products at one
            x2 = x.reshape(rows, depth)
            ys = (native_cpu.matvecs(x2[0], kernels, transposed=True) if rows == 1
                  else native_cpu.matmuls(x2, kernels, transposed=True))
        else:
            rounded = all(p.bias is None and (p.dtype or x.dtype) == jnp.bfloat16 for p in projs)
            ys = native_cpu.matmuls_packed(x.reshape(rows, depth), kernels, jnp.bfloat16 if rounded else jnp.float32)
        return [y.reshape(rows, *p.kernel_shape[x.ndim - 1:]) for y, p in zip(ys, projs)]
    flat = [k.reshape(depth, -1) for k in kernels]
    if all(p.native_rows and native_matvec_ok(x, k) for p, k in zip(projs, kernels)) and len(set(
            k.dtype for k in kernels)) == 1:     # one row (batch-1 decode): one native matvec call
        ys = native_cpu.matvecs(x, flat)
    elif all(p.native_rows and native_gemm_ok(x, k) for p, k in zip(projs, kernels)):
        ys = native_cpu.matmuls(x.reshape(rows, depth), flat)
    else:
        return None
    return [y.reshape(rows, *k.shape[x.ndim - 1:]) for y, k in zip(ys, kernels)]


def pack_for_tiles(model: nnx.Module) -> int:
    """Lay the projections' kernels of `model` out for the native AMX matmuls (`pack_kernel`) and mark
    them `packed`; returns how many were packed. Each group called together (q/k/v, gate/up; o and
    down alone) is packed whole or not at all.

    bfloat16: a decode step's few rows on AMX tiles spent most of their time packing the weight
    panels (strided weight rows, 512 bytes at a time); packed once here, the tiles read each weight
    as one contiguous stream, at the same bits. float32 (where `native_cpu.f32_tiles()`): each
    kernel stored [N, K], whose rows the tiles split into bf16 parts (`native_cpu.matmul`'s
    `f32_tiles`), and whose one-row products are dot products (benchmarks/RESULTS.md). The caller
    (`ModelRunner`) decides when: unsharded, on a CPU with AMX, a model whose arrays it owns.
    Mutates `model`.
    """
    groups = []
    for _, node in nnx.iter_graph(model):
        if isinstance(node, Attention):
            groups += [[node.q_proj, node.k_proj, node.v_proj], [node.o_proj]]
        elif isinstance(node, MLP):
            groups += [[node.gate_proj, node.up_proj], [node.down_proj]]
    count = 0
    for group in groups:
        if not all(p.native_rows and not p.packed and _packable(p) for p in group):
            continue
        for p in group:
            p.kernel.set_value(pack_kernel(p.kernel[...], contracted_size(p)))
            p.packed = True
        count += len(group)
    return count


def _packable(proj: Proj) -> bool:
    kernel = proj.kernel[...]
    if kernel.dtype != (proj.dtype or proj.param_dtype):
        return False
    if kernel.dtype == jnp.float32:
        return native_cpu.f32_tiles()
    return native_cpu.packable(kernel.reshape(contracted_size(proj), -1))


def contracted_size(proj: Proj) -> int:
    """K of a projection: the size of the kernel axes it contracts with x."""
    lhs = proj.einsum_str.split(",")[0]
    return math.prod(proj.kernel_shape[:len(lhs) - 1])


@functools.partial(jax.jit, static_argnums=1)
def pack_kernel(kernel: jax.Array, depth: int) -> jax.Array:
    """A projection's kernel in its own shape (the first axes, `depth` elements, contracted with x)
    as `pack_for_tiles` stores it, at load and on an update: bfloat16 laid out by
    `native_cpu.pack_weight`, float32 as [N, K]. `unpack_kernel` inverts it."""
    flat = kernel.reshape(depth, -1)
    return flat.T if kernel.dtype == jnp.float32 else native_cpu.pack_weight(flat)


@functools.partial(jax.jit, static_argnums=1)
def unpack_kernel(packed: jax.Array, shape: tuple[int, ...]) -> jax.Array:
    """The kernel of shape `shape` that `pack_kernel` laid out as `packed`."""
    flat = packed.T if packed.dtype == jnp.float32 else native_cpu.unpack_weight(packed)
    return flat.reshape(shape)


def native_matvec_ok(x: jax.Array, weight: jax.Array) -> bool:
    """True when x is one row, the weight float32 or bfloat16, and `native_cpu.matvec` can take it
    here (static checks). bf16 weights are read in place at half the bytes (XLA's one-row bf16 dot
    converts the whole weight first); a chain of the model's float32 one-row products streams
    ~1.1x faster natively than through XLA's dots (benchmarks/RESULTS.md).
    """
    if x.shape[0] != 1 or weight.dtype not in (jnp.float32, jnp.bfloat16):
        return False
    return native_here()


def native_gemm_ok(x: jax.Array, weight: jax.Array) -> bool:
    """True when x has 2+ rows of the weight's dtype (float32 or bfloat16) and `native_cpu.matmul`
    can take them here (static checks: unsharded, the CPU has AVX-512 BF16)."""
    if x.shape[0] < 2 or x.dtype != weight.dtype or weight.dtype not in (jnp.float32, jnp.bfloat16):
        return False
    return native_here() and native_cpu.gemm_enabled() and native_cpu.gemm_available()


def native_kv_write_ok() -> bool:
    """True when the `cpu` backend can write K/V natively here (`native_cpu.write_kv`: no transposing
    copy before the scatter; unsharded). JAXSERVE_NATIVE_KV_WRITE=0 keeps the jnp scatter (A/B)."""
    return native_here("JAXSERVE_NATIVE_KV_WRITE")


def native_silu_mul_ok(projs: list[Proj], x: jax.Array) -> bool:
    """True when gate/up are bfloat16 without biases: the native SwiGLU (`native_cpu.silu_mul`) then
    gives XLA's bits from their float32 products at ~3.5x XLA's rate in the step (benchmarks/RESULTS.md).
    JAXSERVE_NATIVE_SILU=0 keeps XLA's (A/B benchmarks)."""
    return (all(p.bias is None and (p.dtype or x.dtype) == jnp.bfloat16 for p in projs)
            and native_here("JAXSERVE_NATIVE_SILU") and native_cpu.silu_table_ready())


def native_here(switch: str | None = None) -> bool:
    """The native CPU kernels may run in the step being traced: `switch` (an environment variable,
    read when a step is traced; "0" turns that kernel off for A/B benchmarks) is on, no mesh axis is
    sharded (a sharded step's matmuls and their collectives are left to XLA), and the kernels run
    here (`native_cpu.available()`: built, on JAX's CPU platform)."""
    return ((switch is None or os.environ.get(switch, "1") != "0") and _unsharded()
            and native_cpu.available())


def _unsharded() -> bool:
    """False inside a mesh with a sharded axis: the matmul (and its collectives) is left to XLA."""
    mesh = jax.sharding.get_abstract_mesh()
    return mesh.empty or all(size == 1 for size in mesh.shape.values())


def one_row_safe(matmul, x: jax.Array) -> jax.Array:
    """`matmul(x)` for x [T, ...]; a single 16-bit row is computed as two.

    XLA:CPU runs a one-row bf16 dot by converting the whole weight matrix to float32 first
    (a batch-1 decode step took ~10x longer than in float32); with two rows it takes the
    bf16 dot path. T is static, so this costs nothing for other shapes.
    """
    if x.shape[0] != 1 or jnp.dtype(x.dtype).itemsize != 2:
        return matmul(x)
    return matmul(jnp.concatenate([x, x]))[:1]


class RMSNorm(nnx.Module):
    """x / rms(x) * weight over the last axis, computed in float32 (as HF does)."""

    def __init__(self, dim: int, *, eps: float, dtype, param_dtype, rngs: nnx.Rngs):
        del rngs  # initialised to ones, like HF
        self.eps = eps
        self.dtype = dtype
        self.weight = nnx.Param(jnp.ones((dim,), param_dtype))  # [dim]

    def __call__(self, x: jax.Array) -> jax.Array:
        x32 = x.astype(jnp.float32)                                      # [..., dim]
        variance = jnp.mean(jnp.square(x32), axis=-1, keepdims=True)     # [..., 1]
        normed = (x32 * jax.lax.rsqrt(variance + self.eps)).astype(x.dtype)
        return self.weight[...].astype(self.dtype) * normed.astype(self.dtype)


def add_norm(norm: RMSNorm, x: jax.Array, delta: jax.Array | None, native: bool) -> tuple[jax.Array, jax.Array]:
    """(x + delta, norm(x + delta)): a sublayer's output added to the residual stream and the next
    norm (delta None: (x, norm(x))). `native` (`native_norm_ok`): one native call
    (`native_cpu.add_rms_norm`) that keeps the stream in float32 and takes delta unrounded, which
    is what XLA's fusions compute for a bf16 model (it drops the rounding of the bf16 adds); else
    the jnp ops, delta being the sublayer's finished output."""
    if native:
        return native_cpu.add_rms_norm(x, delta, norm.weight[...], norm.eps)
    if delta is not None:
        x = x + delta
    return x, norm(x)


def native_norm_ok(norm: RMSNorm, md: AttentionMetadata | None, cpu_backend: bool) -> bool:
    """True when `add_norm` may take the native call: a bfloat16 or float32 norm (weight of the same
    dtype) in the engine's step (`md`: the training forward stays jnp, differentiable) on the `cpu`
    attention backend. A row's norm then takes the same sums whatever the step's shape (XLA's
    reduction of a float32 step's sums of squares follows its token bucket, so a prefix-cache hit
    moved a row's last bits). JAXSERVE_NATIVE_NORM=0 keeps XLA's fusions (A/B benchmarks)."""
    dtype = norm.weight[...].dtype
    return (cpu_backend and md is not None and dtype in (jnp.bfloat16, jnp.float32) and norm.dtype == dtype
            and native_here("JAXSERVE_NATIVE_NORM"))


def log_softmax(logits: jax.Array, cpu_backend: bool) -> jax.Array:
    """jax.nn.log_softmax of logits [S, V] over the vocabulary. On the `cpu` attention backend one
    native call (`native_cpu.log_softmax`): each row's sum of exponentials in a fixed order, so a
    row's logprobs do not depend on the step's row count (XLA's fused reduction follows it).
    JAXSERVE_NATIVE_LOG_SOFTMAX=0 keeps XLA's."""
    if (cpu_backend and logits.ndim == 2 and logits.dtype == jnp.float32
            and native_here("JAXSERVE_NATIVE_LOG_SOFTMAX")):
        return native_cpu.log_softmax(logits)
    return jax.nn.log_softmax(logits, axis=-1)


def rope_inv_freq(head_dim: int, theta: float, scaling: RopeScaling) -> np.ndarray:
    """Inverse frequencies [head_dim // 2] float32, with linear or Llama-3 scaling.

    Computed on the host in float64 then rounded once, so they are compile-time constants.
    """
    inv_freq = 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    if scaling.rope_type == "linear":
        inv_freq = inv_freq / scaling.factor
    elif scaling.rope_type == "llama3":
        old_len = scaling.original_max_position_embeddings
        low_freq_wavelen = old_len / scaling.low_freq_factor
        high_freq_wavelen = old_len / scaling.high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        # Long wavelengths are divided by factor, short ones kept, the band between blended.
        scaled = np.where(wavelen > low_freq_wavelen, inv_freq / scaling.factor, inv_freq)
        smooth = (old_len / wavelen - scaling.low_freq_factor) / (
            scaling.high_freq_factor - scaling.low_freq_factor
        )
        smoothed = (1 - smooth) * scaled / scaling.factor + smooth * scaled
        is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
        inv_freq = np.where(is_medium, smoothed, scaled)
    elif scaling.rope_type != "default":
        raise ValueError(f"unsupported rope_type {scaling.rope_type!r}")
    return inv_freq.astype(np.float32)


def apply_rope(x: jax.Array, positions: jax.Array, inv_freq: np.ndarray) -> jax.Array:
    """Rotate-half RoPE of x [T, heads, head_dim] at absolute positions [T].

    cos and sin are taken of the head_dim // 2 frequencies and then doubled (the same values
    as of the doubled frequencies). Taken of the doubled ones, a float32 model's cos fed every
    layer's RoPE loop directly, and XLA fused it into each of them, evaluating sincos per
    head of every layer (3% of a float32 prefill step's CPU time). Now XLA computes them once.
    """
    return rotate(x, *rope_tables(positions, inv_freq, x.dtype))


def rotate(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """`apply_rope` of x [T, heads, head_dim] with its tables (`rope_tables`: [T, head_dim] each)."""
    x1, x2 = jnp.split(x, 2, axis=-1)                                      # [T, heads, head_dim // 2] each
    rotated = jnp.concatenate([-x2, x1], axis=-1)                          # [T, heads, head_dim]
    return x * cos[:, None, :] + rotated * sin[:, None, :]


def rope_tables(positions: jax.Array, inv_freq: np.ndarray, dtype) -> tuple[jax.Array, jax.Array]:
    """(cos, sin) [T, head_dim] in `dtype` at absolute positions [T]: `apply_rope`'s factors."""
    freqs = positions.astype(jnp.float32)[:, None] * inv_freq[None, :]   # [T, head_dim // 2]
    cos, sin = jnp.cos(freqs), jnp.sin(freqs)
    return (jnp.concatenate([cos, cos], axis=-1).astype(dtype), jnp.concatenate([sin, sin], axis=-1).astype(dtype))


def paged_attention(
    q: jax.Array,                # [T, num_heads, head_dim]
    k: jax.Array,                # [T, num_kv_heads, head_dim] this step's keys (the "cpu" backend reads them)
    v: jax.Array,                # [T, num_kv_heads, head_dim] this step's values
    kv_cache: jax.Array,         # [2, num_kv_heads, num_blocks, block_size, head_dim], holds this step's K/V
    md: AttentionMetadata,
    *,
    backend: str,
    sm_scale: float,
    sliding_window: int | None,
    q_rope: tuple[jax.Array, jax.Array, jax.Array] | None = None,
) -> jax.Array:
    """Ragged paged attention over the cache: [T, num_heads, head_dim].

    The one place the models call an attention kernel: `backend` ("reference", "cpu",
    "pallas_gpu", "pallas_tpu"; static, from `ModelConfig.attention_backend`) picks it.
    `q_rope` (q before RoPE, cos, sin): what `q` was made from, for a backend that rotates q itself.
    """
    return ragged_paged_attention(
        q, kv_cache, md.block_tables, md.context_lens, md.query_start_loc, md.num_seqs,
        backend=backend, sm_scale=sm_scale, sliding_window=sliding_window, k=k, v=v, q_rope=q_rope,
    )


def dense_causal_attention(q: jax.Array, k: jax.Array, v: jax.Array, *, sm_scale: float,
                           sliding_window: int | None) -> jax.Array:
    """Causal GQA attention of one whole sequence, no cache: [T, num_heads, head_dim].

    The models' training-time path (`LlamaForCausalLM.forward`): plain jnp, differentiable.
    """
    group = q.shape[1] // k.shape[1]
    k, v = jnp.repeat(k, group, axis=1), jnp.repeat(v, group, axis=1)           # [T, heads, head_dim]
    scores = jnp.einsum("qhd,khd->hqk", q, k, preferred_element_type=jnp.float32) * sm_scale
    pos = jnp.arange(q.shape[0])
    allowed = pos[None, :] <= pos[:, None]                                       # [Tq, Tk]
    if sliding_window is not None:
        allowed &= pos[None, :] > pos[:, None] - sliding_window
    weights = jax.nn.softmax(jnp.where(allowed, scores, -jnp.inf), axis=-1)
    return jnp.einsum("hqk,khd->qhd", weights.astype(v.dtype), v)


class Attention(nnx.Module):
    """GQA self-attention with RoPE, optional q/k/v/o biases and Qwen3's per-head QK norm."""

    def __init__(
        self, config: ModelConfig, *, sliding_window: int | None, dtype, param_dtype, rngs: nnx.Rngs
    ):
        hidden, heads, kv_heads, head_dim = (
            config.hidden_size, config.num_attention_heads, config.num_key_value_heads, config.head_dim,
        )
        self.num_heads = heads
        self.num_kv_heads = kv_heads
        self.head_dim = head_dim
        self.sliding_window = sliding_window
        self.attention_backend = config.attention_backend  # static: part of the graphdef, not a param
        self.sm_scale = head_dim ** -0.5
        self.rope_theta = config.rope_theta
        self.rope_scaling = config.rope_scaling
        common = dict(dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        q_bias = (heads, head_dim) if config.attention_bias else None
        kv_bias = (kv_heads, head_dim) if config.attention_bias else None
        o_bias = (hidden,) if config.o_proj_bias else None
        native = dict(native_rows=config.native_rows)
        self.q_proj = Proj("td,dhk->thk", (hidden, heads, head_dim), q_bias, **common, **native)
        self.k_proj = Proj("td,dhk->thk", (hidden, kv_heads, head_dim), kv_bias, **common, **native)
        self.v_proj = Proj("td,dhk->thk", (hidden, kv_heads, head_dim), kv_bias, **common, **native)
        self.o_proj = Proj("thk,hkd->td", (heads, head_dim, hidden), o_bias, **common, **native)
        if config.qk_norm:
            self.q_norm = RMSNorm(head_dim, eps=config.rms_norm_eps, **common)
            self.k_norm = RMSNorm(head_dim, eps=config.rms_norm_eps, **common)
        else:
            self.q_norm = self.k_norm = None

    def __call__(
        self, x: jax.Array, positions: jax.Array, kv_cache: jax.Array | None, md: AttentionMetadata | None,
        unrounded: bool = False,
    ) -> tuple[jax.Array, jax.Array | None]:
        """(o_proj's output [T, hidden], the updated cache); `unrounded`: o_proj as `Proj.unrounded`."""
        # [T, heads, head_dim], [T, kv_heads, head_dim] x 2
        q, k, v = project_together([self.q_proj, self.k_proj, self.v_proj], x)
        if self.q_norm is not None:                         # Qwen3: per-head RMSNorm before RoPE
            q = self.q_norm(q)
            k = self.k_norm(k)
        inv_freq = rope_inv_freq(self.head_dim, self.rope_theta, self.rope_scaling)  # [head_dim // 2]
        cos_sin = rope_tables(positions, inv_freq, q.dtype)                         # [T, head_dim] each
        q_unrotated, q = q, rotate(q, *cos_sin)
        k_rotated = rotate(k, *cos_sin)
        if kv_cache is None:                                # one whole sequence, no cache (training)
            out = dense_causal_attention(q, k_rotated, v, sm_scale=self.sm_scale, sliding_window=self.sliding_window)
            return self.o_proj(out), None
        if self.attention_backend == "cpu" and native_kv_write_ok():
            if native_cpu.rope_applies(k, kv_cache):  # k rotated on its way into the pool, the same bits
                kv_cache = native_cpu.write_kv(kv_cache, k, v, md.slot_mapping, rope=cos_sin)
            else:
                kv_cache = native_cpu.write_kv(kv_cache, k_rotated, v, md.slot_mapping)
        else:
            kv_cache = write_kv_cache(kv_cache, k_rotated, v, md.slot_mapping)
        k = k_rotated   # the attention's in-step keys (XLA drops them where the native kernel takes every run)
        # The `cpu` backend's native kernel may rotate q itself (the same bits; XLA then drops q's rotation).
        q_rope = (q_unrotated, *cos_sin) if self.attention_backend == "cpu" and native_here() else None
        out = paged_attention(q, k, v, kv_cache, md, backend=self.attention_backend, sm_scale=self.sm_scale,
                              sliding_window=self.sliding_window, q_rope=q_rope)
        return (self.o_proj.unrounded(out) if unrounded else self.o_proj(out)), kv_cache   # [T, hidden]


class MLP(nnx.Module):
    """SwiGLU: down(silu(gate(x)) * up(x))."""

    def __init__(
        self, hidden: int, intermediate: int, *, use_bias: bool, dtype, param_dtype, rngs: nnx.Rngs,
        native_rows: bool = False,
    ):
        common = dict(dtype=dtype, param_dtype=param_dtype, rngs=rngs, native_rows=native_rows)
        up_bias = (intermediate,) if use_bias else None
        down_bias = (hidden,) if use_bias else None
        self.gate_proj = Proj("td,df->tf", (hidden, intermediate), up_bias, **common)
        self.up_proj = Proj("td,df->tf", (hidden, intermediate), up_bias, **common)
        self.down_proj = Proj("tf,fd->td", (intermediate, hidden), down_bias, **common)

    def __call__(self, x: jax.Array, unrounded: bool = False) -> jax.Array:
        """[T, hidden]; `unrounded`: down_proj as `Proj.unrounded`."""
        projs = [self.gate_proj, self.up_proj]
        ys = native_products(projs, x)
        if ys is not None and native_silu_mul_ok(projs, x):
            h = native_cpu.silu_mul(*ys)                      # [T, intermediate], the same bits as below
        else:
            gate, up = [p(x) for p in projs] if ys is None else [p.finish(y, x.dtype) for p, y in zip(projs, ys)]
            h = jax.nn.silu(gate) * up                        # [T, intermediate]
        return self.down_proj.unrounded(h) if unrounded else self.down_proj(h)   # [T, hidden]


class DecoderLayer(nnx.Module):
    """Pre-norm block: x + attn(norm(x)), then x + mlp(norm(x))."""

    def __init__(self, config: ModelConfig, *, layer_idx: int, dtype, param_dtype, rngs: nnx.Rngs):
        common = dict(dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        self.input_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps, **common)
        self.self_attn = Attention(config, sliding_window=config.layer_sliding_windows[layer_idx], **common)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps, **common)
        self.mlp = MLP(config.hidden_size, config.intermediate_size, use_bias=config.mlp_bias,
                       native_rows=config.native_rows, **common)

    def __call__(
        self, x: jax.Array, positions: jax.Array, kv_cache: jax.Array | None, md: AttentionMetadata | None,
        pending: jax.Array | None = None,
    ) -> tuple[jax.Array, jax.Array, jax.Array | None]:
        """x [T, hidden] plus `pending` (the layer before's MLP output, not yet added: the add goes
        with this layer's first norm) -> (x after attention, this layer's MLP output, still to be
        added, e.g. by `add_norm` with the next norm; the updated cache)."""
        native = native_norm_ok(self.input_layernorm, md, self.self_attn.attention_backend == "cpu")
        x, h = add_norm(self.input_layernorm, x, pending, native)                     # [T, hidden] x 2
        attn_out, kv_cache = self.self_attn(h, positions, kv_cache, md, unrounded=native)
        x, h = add_norm(self.post_attention_layernorm, x, attn_out, native)
        return x, self.mlp(h, unrounded=native), kv_cache
