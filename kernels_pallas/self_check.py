"""Start-up self-check: an attention kernel is trusted only after it gets a few random cases right.

What flows through: the engine calls `self_check(backend, dtype=..., page_size=...)` once
at start-up, on the caller's thread, after resolving `--attention-backend` to a backend in
`STARTUP_CHECKED` (the Pallas ones). It runs the backend through the dispatcher the models
use (`ragged_paged_attention`) on the default device, on small random batches (`cases`:
decodes, whole prefills, a mixed step, page boundaries), and compares each output on the
host with the float64 oracle (`oracle.attention_oracle`). A mismatch, or any exception
while compiling or running the backend, raises `KernelSelfCheckError` naming the case; the
engine then falls back to the reference ("auto") or refuses to start (an explicit backend).

Why the host oracle rather than `ragged_paged_attention_reference` on the device: it
compiles nothing (the reference's compile was a third of the check's cost on CPU), it is
exact whatever the device's float32 matmul precision (TF32 on GPUs, bf16 passes on TPUs),
and it is the same contract the reference is tested against.

One shape serves every case, so the backend compiles once; repeated checks in one
process (several engines) reuse that compile. It runs outside any mesh (one device, all
heads): tensor parallelism only splits heads between devices.
"""

from __future__ import annotations

import logging
import time

import jax
import jax.numpy as jnp
import numpy as np

from kernels_pallas.dispatch import kv_pool_dtype, ragged_paged_attention
from kernels_pallas.oracle import attention_oracle, make_batch, step_kv

logger = logging.getLogger(__name__)

# JAX platform each Pallas backend compiles for; elsewhere (CPU tests) it runs interpreted.
_PALLAS_PLATFORMS = {"pallas_gpu": "gpu", "pallas_tpu": "tpu"}
# Backends the engine checks at start-up: kernels compiled by Triton / Mosaic for a device no test
# ran on. Not "cpu": its check (it passes, tests/kernels/test_self_check.py) costs ~1.1-1.4 s
# cold (~0.4 s with a warm XLA cache) on a 2-core CPU, nearly all compiling the backend's
# program, against a budget of well under a second; its native kernel is tested on the CPU
# machines and, when it fails to build, falls back to jnp on its own (native_cpu.available).
STARTUP_CHECKED = tuple(_PALLAS_PLATFORMS)
# Against the float64 oracle on the same (dtype-rounded) inputs. float32: the kernels compute
# in float32 (the Pallas ones with exact, non-TF32 dots), so only rounding order differs:
# a few ulps over dots of <= 128 terms and softmax sums of a few hundred keys, ~1e-6.
# 16-bit: outputs are rounded to 16 bits (bf16: relative 2^-8) and the kernels feed 16-bit
# softmax weights into the P.V product, so 1e-2 is ~2.5 bf16 ulps. A wrong kernel is off by O(1).
_F32_TOL = dict(rtol=1e-5, atol=1e-5)
_16BIT_TOL = dict(rtol=1e-2, atol=1e-2)
_MAX_ERROR_CHARS = 1000   # of a compiler's error in the message (Triton / Mosaic ones can dump whole IR)


def cases(page_size: int) -> dict[str, list[tuple[int, int]]]:
    """Named scenarios as (context_len, query_len) per sequence, placed relative to `page_size`."""
    p = page_size
    raw = {
        # a first decode, decodes ending just before / at / just after a page end, a longer context
        "decode": [(1, 1), (p - 1, 1), (p, 1), (p + 1, 1), (3 * p + 2, 1)],
        # whole prompts, one spanning more than a page
        "prefill": [(p + 3, p + 3), (5, 5)],
        # decodes, a first prefill chunk, a chunk continuing earlier context
        "mixed": [(p + 1, 1), (12, 12), (2 * p + 5, p // 2 + 3), (p, 1)],
        # a chunk starting and ending on page boundaries, a prefill one short of a page end
        "page_boundary": [(p, 1), (2 * p, p), (p + 1, 1), (p - 1, p - 1)],
    }
    # Tiny pages (block_size < 5) would make some contexts shorter than their queries.
    return {name: [(max(ctx, q, 1), max(q, 1)) for ctx, q in seqs] for name, seqs in raw.items()}


class KernelSelfCheckError(RuntimeError):
    """A backend disagreed with the oracle (or failed to compile or run) on a named self-check case."""

    def __init__(self, backend: str, case: str, detail: str):
        super().__init__(f"attention backend {backend!r} failed self-check case {case!r}: {detail}")
        self.backend, self.case, self.detail = backend, case, detail


def self_check(backend: str, *, dtype, page_size: int = 16, head_dim: int = 128, num_kv_heads: int = 2,
               group: int = 3, interpret: bool | None = None) -> None:
    """Run `backend` on every case on the default device; raise KernelSelfCheckError on the first failure.

    `dtype` is the model's (q and KV); `page_size` the engine's block size. The other
    shapes are fixed and small: `group` query heads per KV head (3: an odd GQA group, whose
    rows the Pallas kernels pad). `interpret` runs a Pallas backend in its interpreter
    (None: when the default device is not the backend's platform, i.e. in CPU tests).
    "reference" passes without running: it is the fallback, checked by the tests.
    """
    if backend == "reference":
        return
    if interpret is None:
        interpret = backend in _PALLAS_PLATFORMS and jax.devices()[0].platform != _PALLAS_PLATFORMS[backend]
    dtype = jnp.dtype(dtype)
    scenarios = cases(page_size)
    max_context = max(ctx for seqs in scenarios.values() for ctx, _ in seqs)
    max_pages = max(sum(-(-ctx // page_size) for ctx, _ in seqs) for seqs in scenarios.values())
    most_tokens = max(sum(q for _, q in seqs) for seqs in scenarios.values())
    shapes = dict(num_tokens=1 << most_tokens.bit_length(),   # a power of 2 > most_tokens: padding rows
                  num_seq_slots=8, block_size=page_size, num_blocks=max_pages + 8,
                  max_blocks=-(-max_context // page_size), num_kv_heads=num_kv_heads, group=group,
                  head_dim=head_dim)
    t0 = time.perf_counter()
    for seed, (name, seqs) in enumerate(scenarios.items()):
        _check_case(backend, name, make_batch(seqs, seed=seed, **shapes), dtype=dtype, interpret=interpret)
    logger.info("attention self-check: %s passed %d cases (%s, page %d) in %.2f s", backend, len(scenarios),
                dtype.name, page_size, time.perf_counter() - t0)


def _check_case(backend: str, name: str, batch, *, dtype, interpret: bool) -> None:
    """One case: the backend on the device (inputs rounded to `dtype` on the host) vs the oracle."""
    q, cache, *meta = batch
    q, cache = q.astype(dtype), cache.astype(dtype)
    k, v = (x.astype(dtype) for x in step_kv(batch))
    pool = cache.view(np.uint16) if kv_pool_dtype(dtype, backend) == jnp.uint16 else cache   # "cpu": 16-bit bits
    sm_scale = q.shape[-1] ** -0.5
    try:
        out = ragged_paged_attention(*map(jnp.asarray, (q, pool, *meta)), backend=backend, sm_scale=sm_scale,
                                     interpret=interpret, k=jnp.asarray(k), v=jnp.asarray(v))
        got = np.asarray(out).astype(np.float32)
    except Exception as e:  # noqa: BLE001 - any failure to compile or run means: not trusted
        text = str(e) if len(str(e)) <= _MAX_ERROR_CHARS else str(e)[:_MAX_ERROR_CHARS] + " [...]"
        raise KernelSelfCheckError(backend, name, f"{type(e).__name__}: {text}") from e   # the whole one: __cause__
    if got.shape != q.shape:
        raise KernelSelfCheckError(backend, name, f"output shape {got.shape} != q shape {q.shape}")
    want = attention_oracle(q.astype(np.float32), cache.astype(np.float32), *meta, sm_scale=sm_scale)
    tol = _F32_TOL if dtype == jnp.float32 else _16BIT_TOL
    error = np.abs(got - want)
    bad = ~(error <= tol["atol"] + tol["rtol"] * np.abs(want))   # NaN counts as bad
    if bad.any():
        row, head, _ = np.unravel_index(np.argmax(np.where(bad, np.nan_to_num(error, nan=np.inf), -1)), bad.shape)
        owned = int(meta[2][int(meta[3])])   # query_start_loc[num_seqs]: rows from here on are padding
        where = f"token row {row}" + (" (a padding row, must be 0)" if row >= owned else "")
        raise KernelSelfCheckError(
            backend, name, f"{int(bad.sum())} of {bad.size} outputs differ from the float64 oracle beyond rtol="
            f"{tol['rtol']}, atol={tol['atol']}; worst at {where}, head {head}: "
            f"got {_first(got[row, head])}, want {_first(want[row, head])}")


def _first(x, n: int = 3) -> str:
    return "[" + ", ".join(f"{v:.4g}" for v in x[:n]) + ", ...]"
