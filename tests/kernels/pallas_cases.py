"""Scenarios and helpers shared by the Pallas kernel tests (GPU and TPU kernels, interpret mode).

Each kernel is compared with `ragged_paged_attention_reference` (itself checked against
a float64 oracle in test_ragged_paged_attention.py) on small caches: 48 pages of 8
tokens, 2 KV heads, 64 token rows and 8 sequence slots, so an interpreted call takes
~0.05 s (GPU kernel) to ~1.5 s (TPU kernel, whose interpreter simulates every DMA).
Every configuration (shapes, dtype, static knobs) is compiled once and shared by its
scenarios, at XLA optimisation level 0, which halves the compile time of these
interpreted programs; the reference outputs are shared by the GPU and TPU tests.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from kernels_pallas.oracle import make_batch
from kernels_pallas.ragged_paged_attention import ragged_paged_attention_reference

PAGE = 8          # tokens per page (TPU f32 needs a multiple of 8)
SHAPES = dict(num_tokens=64, num_seq_slots=8, num_blocks=48, max_blocks=12, num_kv_heads=2)

# (context_len, query_len) per sequence; contexts up to 80 keys = 10 pages.
SCENARIOS = {
    "decode_only": [(1, 1), (2, 1), (9, 1), (16, 1), (17, 1), (31, 1), (40, 1), (80, 1)],
    "prefill_only": [(20, 20), (7, 7), (33, 33)],
    # decodes, a first prefill chunk, a chunk continuing earlier context, a 2-token step
    "mixed": [(17, 1), (12, 12), (48, 16), (9, 1), (30, 2), (64, 1), (70, 19)],
    # prefix-cache hits: the step's queries start mid-context
    "prefix_hit": [(48, 5), (33, 1), (64, 17), (40, 3), (9, 8)],
    # contexts and chunks that end / start exactly at page (8) and KV-block (16) boundaries
    "page_boundary": [(16, 1), (15, 1), (17, 1), (32, 16), (31, 15), (33, 9), (64, 8), (8, 8)],
    # sequences of length 1: a one-token prompt and a first decode
    "seq_len_1": [(1, 1), (1, 1), (2, 1), (1, 1)],
    # 2 real sequences out of 8 slots, 4 real tokens out of 64 rows
    "padding": [(10, 1), (20, 3)],
}

# Batch options shared by the GPU and TPU tests (so they share reference outputs).
GQA_1 = {"group": 1}
GQA_3 = {"group": 3}                                  # 3 q heads per KV head, padded to 4 rows per token
GQA_8_HEAD_DIM_128 = {"group": 8, "head_dim": 128}
BF16 = {"group": 4, "head_dim": 128, "dtype": jnp.bfloat16, "page_size": 16}  # TPU bf16 pages: 16 rows
LARGE_LOGITS = {"q_scale": 4.0}                       # logits reach ~10, where a soft cap of 2.5 bends them hard
WINDOW_SOFT_CAP = {"sliding_window": 11, "soft_cap": 2.5}  # Gemma-2 style: both at once

# float32: both sides compute in float32 (kernels: exact, non-TF32 dots), differing by rounding order only.
F32_TOL = dict(rtol=1e-5, atol=1e-5)
# bf16: outputs are rounded to bf16 (relative 2^-8) and the kernels feed bf16 softmax
# weights into the P.V product (another 2^-9 relative per weight, averaged over keys),
# so 1e-2 is ~2.5 bf16 ulps.
BF16_TOL = dict(rtol=1e-2, atol=1e-2)


def batch(scenario: str, *, group: int = 2, head_dim: int = 64, dtype=jnp.float32, seed: int = 0,
          page_size: int = PAGE, q_scale: float = 1.0):
    """Random inputs (see make_batch) for a scenario, q (times q_scale) and cache in `dtype`."""
    q, cache, *rest = make_batch(SCENARIOS[scenario], seed=seed, block_size=page_size, group=group,
                                 head_dim=head_dim, **SHAPES)
    return (jnp.asarray(q * np.float32(q_scale), dtype), jnp.asarray(cache, dtype), *map(jnp.asarray, rest))


_EXECUTABLES = {}


def run_compiled(fn, args, **static):
    """fn(*args, **static), compiled once per configuration (at XLA -O0 on a CPU, where only compile time matters)."""
    key = (fn, tuple(sorted(static.items())), tuple((a.shape, a.dtype.name) for a in args))
    if key not in _EXECUTABLES:
        jitted = jax.jit(functools.partial(fn, **static))
        options = {"xla_backend_optimization_level": 0} if jax.devices()[0].platform == "cpu" else None
        _EXECUTABLES[key] = jitted.lower(*args).compile(options)
    return _EXECUTABLES[key](*args)


def check_against_reference(got, scenario: str, options: dict, *, sm_scale, sliding_window=None, soft_cap=None):
    """got ~ the reference on the same (dtype-rounded) inputs, computed in float32; padding rows 0."""
    q, *_, query_start_loc, num_seqs = batch(scenario, **options)
    want = _reference(scenario, tuple(sorted(options.items())), sm_scale, sliding_window, soft_cap)
    assert got.shape == q.shape and got.dtype == q.dtype
    tol = F32_TOL if q.dtype == jnp.float32 else BF16_TOL
    np.testing.assert_allclose(np.asarray(got, np.float32), want, **tol)
    owned = int(query_start_loc[int(num_seqs)])
    assert owned < q.shape[0], "every scenario has padding rows"
    assert not np.asarray(got[owned:], np.float32).any(), "rows of padding tokens must be 0"


@functools.cache
def _reference(scenario, options, sm_scale, sliding_window, soft_cap) -> np.ndarray:
    """The reference's float32 output; cached, since the GPU and TPU tests share their batches.

    At "highest" matmul precision: on a GPU / TPU (--pallas-on-device) the default float32 dot
    rounds its inputs (TF32 / bf16 passes), far beyond F32_TOL; a CPU computes float32 either way.
    """
    q, cache, *rest = batch(scenario, **dict(options))
    args = (q.astype(jnp.float32), cache.astype(jnp.float32), *rest)
    with jax.default_matmul_precision("highest"):
        return np.asarray(run_compiled(ragged_paged_attention_reference, args, sm_scale=sm_scale,
                                       sliding_window=sliding_window, soft_cap=soft_cap))


def lowered_text(kernel, args, platform: str, **static) -> str:
    """StableHLO of kernel(*args) lowered for `platform` on this (CPU-only) machine."""
    return jax.jit(functools.partial(kernel, **static)).trace(*args).lower(lowering_platforms=(platform,)).as_text()
