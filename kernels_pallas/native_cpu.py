"""Native CPU kernels: built on first use, registered with XLA's FFI, called in the step.

What flows through: `paged_context_native(...)` (attention of every run, `native/paged_context.cc`,
reads the K/V pages in place), `matvec(...)` (one-row matmuls, `native/matvec.cc`) and
`matmul(...)` (the projections of steps with 2+ rows, `native/gemm.cc`; needs AVX-512 BF16),
`silu_mul(...)` (a bf16 SwiGLU's elementwise half) and `write_kv(...)` (the step's K/V into the
pool in place; both `native/step_ops.cc`) are traced inside the caller's jitted step and each becomes one XLA custom call; they split
their work over XLA's own intra-op threads (`native/parallel.h`). The shared library is
compiled once per machine with the system C++ compiler
(`c++ -O3 -march=native -fopenmp-simd`, jaxlib's FFI headers) into the user's cache folder,
keyed by the source, the compiler flags and the jaxlib version; `available()` does that
on the caller's thread (the engine calls it at start-up) and says False, after one
warning naming the reason, when there is no compiler or the build fails. The pure-jnp
`paged_context_attention` computes the same thing: it is the kernel's oracle in the
tests and the fallback.

Why native: XLA:CPU cannot read a page where it lies. The jnp path gathers (copies) every
page before its small batched dots, ~5-8 GB/s, and each loop trip costs a fixed ~0.1 ms;
for decodes, which only read, that is most of the attention time.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import threading
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from kernels_pallas.ragged_paged_attention import check_kv_write

logger = logging.getLogger(__name__)

SOURCES = tuple(Path(__file__).with_name("native") / name
                for name in ("paged_context.cc", "matvec.cc", "gemm.cc", "step_ops.cc"))
HEADERS = tuple(Path(__file__).with_name("native") / name for name in ("amx.h", "bits.h", "parallel.h", "simd.h"))
TARGET = "jaxserve_paged_context"
MATVEC_TARGET = "jaxserve_matvec"
GEMM_TARGET = "jaxserve_gemm"
GEMM_ROWS_TARGET = "jaxserve_gemm_valid_rows"
GEMM_PACKED_TARGET = "jaxserve_gemm_packed"
SILU_MUL_TARGET = "jaxserve_silu_mul"
WRITE_KV_TARGET = "jaxserve_write_kv"
ADD_RMS_NORM_TARGET = "jaxserve_add_rms_norm"
LOG_SOFTMAX_TARGET = "jaxserve_log_softmax"
# No exceptions, RTTI or unwind tables: nothing here throws or catches (a throw from a handler would
# end the process either way) and the kernels' code is the same; the build then takes ~15% less CPU.
_FLAGS = ("-O3", "-march=native", "-fopenmp-simd", "-shared", "-fPIC", "-std=c++17", "-fno-exceptions", "-fno-rtti",
          "-fno-asynchronous-unwind-tables")
_STALE_BUILD_SECONDS = 600   # a build folder this old belongs to a process that is gone
_BITS = {np.dtype(np.float32): 0, np.dtype(jnp.bfloat16): 1, np.dtype(np.float16): 2}


def cache_dir() -> Path:
    root = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(root) / "jaxserve" / "native"


def _cpu_signature() -> str:
    """The CPU's model and flags: a library built with -march=native only runs where it was built."""
    try:
        info = Path("/proc/cpuinfo").read_text()
        lines = [ln for ln in info.splitlines() if ln.startswith(("flags", "model name"))][:2]
        return "\n".join(lines)
    except OSError:
        return platform.processor()


def _library_path() -> Path:
    key = hashlib.sha256(b"".join(src.read_bytes() for src in SOURCES + HEADERS) + " ".join(_FLAGS).encode()
                         + jax.__version__.encode() + _cpu_signature().encode()).hexdigest()[:16]
    return cache_dir() / f"jaxserve_cpu-{key}.so"


def build(path: Path | None = None) -> Path:
    """Compile the kernel (if not already built) and return the shared library's path; raises on failure."""
    path = path or _library_path()
    if path.exists():
        return path
    compiler = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")
    if compiler is None:
        raise RuntimeError("no C++ compiler (c++ or g++) on PATH")
    path.parent.mkdir(parents=True, exist_ok=True)
    _remove_stale_builds(path.parent)
    with tempfile.TemporaryDirectory(prefix=".build-", dir=path.parent) as tmp:
        tmp_lib = Path(tmp) / path.name
        # One compiler per source, all at once (~3.5-4 s each here), then a link (~0.05 s).
        objects = [Path(tmp) / f"{src.stem}.o" for src in SOURCES]
        jobs = [[compiler, *_FLAGS, f"-I{jax.ffi.include_dir()}", "-c", str(src), "-o", str(obj)]
                for src, obj in zip(SOURCES, objects)]
        procs = [subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True) for cmd in jobs]
        errors = [proc.communicate()[1] for proc in procs]   # every one finished before any is judged
        for cmd, proc, stderr in zip(jobs, procs, errors):
            _check(cmd, proc.returncode, stderr)
        cmd = [compiler, *_FLAGS, *map(str, objects), "-o", str(tmp_lib)]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        _check(cmd, proc.returncode, proc.stderr)
        os.replace(tmp_lib, path)   # atomic: concurrent builders never see half a library
    return path


def _remove_stale_builds(folder: Path) -> None:
    """Remove the build folders of processes that exited mid-build (the build runs on a daemon
    thread, so a start-up that fails meanwhile leaves its folder); a build takes seconds."""
    for stale in folder.glob(".build-*"):
        try:
            if time.time() - stale.stat().st_mtime > _STALE_BUILD_SECONDS:
                shutil.rmtree(stale, ignore_errors=True)
        except OSError:
            pass  # removed meanwhile by another process


def _check(cmd: list[str], returncode: int, stderr: str) -> None:
    if returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{stderr[-2000:]}")


_LOCK = threading.Lock()


def available() -> bool:
    """True when the kernels may run in this process's computations: JAX's default backend is the CPU
    (the targets are registered for the CPU platform only, so a `cpu` attention backend chosen on a
    GPU or TPU host keeps its jnp paths and XLA's dots) and they built, loaded and registered (tried
    once per process).

    Thread-safe: the runner compiles its token buckets on several threads at once.
    """
    if jax.default_backend() != "cpu":
        return False
    with _LOCK:
        return _load() is not None


@functools.cache
def build_in_background() -> None:
    """Start `available()` on a daemon thread (once a process): the kernels compile (~7 s on a
    new machine, then cached) while the caller loads a model; the first step traced waits."""
    threading.Thread(target=available, daemon=True, name="jaxserve-native-build").start()


@functools.cache
def _load() -> ctypes.CDLL | None:
    """The built library with its targets registered, or None (after one warning)."""
    try:
        path = build()
        lib = ctypes.cdll.LoadLibrary(str(path))
        jax.ffi.register_ffi_target(TARGET, jax.ffi.pycapsule(lib.JaxservePagedContext), platform="cpu")
        jax.ffi.register_ffi_target(MATVEC_TARGET, jax.ffi.pycapsule(lib.JaxserveMatvec), platform="cpu")
        jax.ffi.register_ffi_target(GEMM_TARGET, jax.ffi.pycapsule(lib.JaxserveGemm), platform="cpu")
        jax.ffi.register_ffi_target(GEMM_ROWS_TARGET, jax.ffi.pycapsule(lib.JaxserveGemmValidRows), platform="cpu")
        jax.ffi.register_ffi_target(GEMM_PACKED_TARGET, jax.ffi.pycapsule(lib.JaxserveGemmPacked), platform="cpu")
        jax.ffi.register_ffi_target(SILU_MUL_TARGET, jax.ffi.pycapsule(lib.JaxserveSiluMul), platform="cpu")
        jax.ffi.register_ffi_target(WRITE_KV_TARGET, jax.ffi.pycapsule(lib.JaxserveWriteKv), platform="cpu")
        jax.ffi.register_ffi_target(ADD_RMS_NORM_TARGET, jax.ffi.pycapsule(lib.JaxserveAddRmsNorm), platform="cpu")
        jax.ffi.register_ffi_target(LOG_SOFTMAX_TARGET, jax.ffi.pycapsule(lib.JaxserveLogSoftmax), platform="cpu")
        try:
            silu_table()   # now, outside any trace (see silu_table)
        except Exception as e:  # noqa: BLE001 - the other kernels do not need it
            logger.warning("the native SwiGLU's silu table could not be computed (%s); a bf16 MLP keeps XLA's", e)
    except Exception as e:  # noqa: BLE001 - any failure means: use the jnp path
        logger.warning("native CPU kernels unavailable (%s); attention uses pure jnp and matmuls XLA's dots", e)
        return None
    logger.info("native CPU kernels loaded from %s", path)
    return lib


def lane_block_pages() -> int:
    """16-row blocks times pages the attention kernel has folded with rows in lanes (shared pages,
    prefill blocks) since it loaded: how the tests see that path ran. Call `available()` first."""
    lib = _load()
    fn = lib.JaxserveLaneBlockPages
    fn.restype = ctypes.c_int64
    return int(fn())


def amx_attention_folds() -> int:
    """Blocks of up to 16 query rows times 16 keys the attention kernel has folded on AMX tiles since
    it loaded: how the tests see that path ran. Call `available()` first."""
    fn = _load().JaxserveAmxAttentionFolds
    fn.restype = ctypes.c_int64
    return int(fn())


def gemm_available() -> bool:
    """True when `matmul` can run here: the kernels loaded and were built with AVX-512 BF16."""
    return available() and bool(_load().JaxserveGemmSupported())


def gemm_amx() -> bool:
    """bfloat16 matmuls run on AMX tiles (an Intel CPU with AMX-BF16, the process allowed to use
    them; JAXSERVE_AMX=0 keeps the AVX-512 BF16 vector path)."""
    return gemm_available() and bool(_load().JaxserveGemmAmx())


def gemm_enabled() -> bool:
    """False when JAXSERVE_NATIVE_GEMM=0: steps traced from then on keep XLA's dots (A/B benchmarks)."""
    return os.environ.get("JAXSERVE_NATIVE_GEMM", "1") != "0"


def prefill_enabled() -> bool:
    """False when JAXSERVE_NATIVE_PREFILL=0: the `cpu` attention traced from then on sends only
    decodes to the native kernel and longer runs to the jnp tiles (A/B benchmarks)."""
    return os.environ.get("JAXSERVE_NATIVE_PREFILL", "1") != "0"


def paged_context_native(qs, kv_cache, block_tables, context_lens, query_start_loc, num_seqs, *,
                         bits_dtype, max_q_len: int, sliding_window: int | None, soft_cap: float | None,
                         q_bf16: bool = False, min_lane_fill: int | None = None, amx: bool | None = None,
                         score_scale: float = 1.0, out_dtype=jnp.float32, rope=None, q_scale: float = 1.0):
    """Sequences with 1..`max_q_len` queries over their whole paged context (causal; this step's keys
    included): short runs in groups walked page by page, longer ones in blocks of 16 queries.

    `qs` [T, QH, D] float32 queries already scaled by sm_scale; `kv_cache` float32, or uint16
    holding `bits_dtype` bits. `q_bf16`: the caller vouches that every value of `qs` is a
    bfloat16 exactly (a bf16 model's q times a power-of-two scale); then the scores against a
    bf16 pool come from the CPU's bf16 dot products on the K pages as they lie. `min_lane_fill`:
    runs of a group that share pool pages (a prefix; a prefill block's rows share every page)
    fold those pages 16 query rows at a time when their rows fill the 16-row blocks with at
    least this many on average; 0 never. The numbers are the same either way (None:
    `lane_fill_setting()`). `amx` (None: `attention_amx()`): a bf16 q (`q_bf16`) against a bf16
    pool with head dim 64 or 128, pages of a multiple of 16 keys and no soft cap runs on AMX
    tiles, where the CPU has them: scores and P x V from `tdpbf16ps`, the softmax weights
    rounded to bf16 for P x V (as HF's and vLLM's bf16 attention have them). `score_scale`: on
    that path only (`amx_attention_applies`), the scores are multiplied by it, so a bf16 q can
    come unscaled when its softmax scale is no power of two (a scaled one would not be bf16).
    Returns (out [T, QH, D] in `out_dtype`, lse [T, QH] float32); rows of other sequences are (0, -inf).
    `out_dtype` bfloat16: out rounded as `.astype(jnp.bfloat16)` rounds it, written so by the kernel
    (the same bits, without another pass over it). `rope` (cos, sin) [T, D] bfloat16 (where
    `rope_supported`): `qs` is a bf16 q before its rotate-half RoPE, which the kernel applies with the
    roundings XLA's fusion of a bf16 model's RoPE takes (each product rounded to bf16, their sum
    kept in float32), times `q_scale`: the queries XLA would have passed, bit for bit. Call
    `available()` first.
    """
    if out_dtype not in (jnp.float32, jnp.bfloat16):
        raise ValueError(f"paged_context_native returns float32 or bfloat16, got {out_dtype}")
    if rope is not None and (qs.dtype != jnp.bfloat16 or qs.shape[2] % 32):
        raise ValueError(f"paged_context_native's rope takes a bfloat16 q [T, QH, D] (D a multiple of 32), got q "
                         f"{qs.dtype}{list(qs.shape)}")
    cos, sin = _rope_tables("paged_context_native", qs, rope)
    if rope is None:
        qs = qs.astype(jnp.float32)
    num_tokens, num_q_heads, head_dim = qs.shape
    bits = 0 if kv_cache.dtype == jnp.float32 else _BITS.get(np.dtype(bits_dtype))
    if bits is None or (bits == 0) != (kv_cache.dtype == jnp.float32):
        raise ValueError(f"native CPU attention reads float32 pools or uint16 bits of bfloat16/float16, "
                         f"got a {kv_cache.dtype} pool of {bits_dtype}")
    call = jax.ffi.ffi_call(
        TARGET, (jax.ShapeDtypeStruct((num_tokens, num_q_heads, head_dim), out_dtype),
                 jax.ShapeDtypeStruct((num_tokens, num_q_heads), jnp.float32)))
    return call(qs, kv_cache, block_tables, context_lens, query_start_loc, jnp.asarray(num_seqs, jnp.int32), cos, sin,
                rope=np.int64(rope is not None), q_scale=np.float32(q_scale),
                bits_dtype=np.int64(bits), max_q_len=np.int64(max_q_len),
                sliding_window=np.int64(sliding_window or 0), soft_cap=np.float32(soft_cap or 0.0),
                q_bf16=np.int64(bool(q_bf16)), min_lane_fill=np.int64(lane_fill_setting(min_lane_fill)),
                amx=np.int64(attention_amx() if amx is None else bool(amx)), score_scale=np.float32(score_scale))


def amx_attention_applies(head_dim: int, block_size: int, soft_cap: float | None) -> bool:
    """A bf16 q against a bf16 pool of this shape runs on AMX tiles (the kernel's own conditions)."""
    return attention_amx() and head_dim in (64, 128) and block_size % 16 == 0 and not soft_cap


def attention_amx() -> bool:
    """bf16 attention runs on AMX tiles (`gemm_amx()`; JAXSERVE_AMX_ATTENTION=0 keeps the vector folds)."""
    return os.environ.get("JAXSERVE_AMX_ATTENTION", "1") != "0" and gemm_amx()


MIN_LANE_FILL = 10   # fewer rows per 16-row block fold faster one by one (benchmarks/RESULTS.md)


def lane_fill_setting(value: int | None = None) -> int:
    """`value`, checked; None: JAXSERVE_MIN_LANE_FILL when set (the A/B switch), else MIN_LANE_FILL."""
    if value is None:
        value = int(os.environ.get("JAXSERVE_MIN_LANE_FILL", MIN_LANE_FILL))
    if not 0 <= value <= 16:
        raise ValueError(f"min_lane_fill must be in 0..16 (rows per 16-row block; 0: never), got {value}")
    return value


def matvec(x, w, *, transposed: bool = False):
    """One-row matmul on the CPU: x [K] float32 times w [K, N] (or [N, K] when `transposed`,
    y = w @ x), w float32 or bfloat16 -> y [N] float32. Call `available()` first."""
    return matvecs(x, [w], transposed=transposed)[0]


def matvecs(x, ws, *, transposed: bool = False):
    """[x w for w in ws] for one row x [K] and weights [K, N_i] of one dtype (q/k/v, gate/up): one
    call, one fan-out to the threads; with `transposed`, weights [N_i, K] (x w^T). As `matvec` otherwise."""
    ws = tuple(ws)
    for w in ws:
        if w.ndim != 2 or w.dtype not in (jnp.float32, jnp.bfloat16):
            raise ValueError(f"matvec takes a float32 or bfloat16 matrix, got {w.dtype}{list(w.shape)}")
        k = w.shape[1] if transposed else w.shape[0]
        if x.size != k:
            raise ValueError(f"x has {x.size} elements, w {list(w.shape)} needs {k}")
    if not ws or len({w.dtype for w in ws}) != 1:
        raise ValueError(f"matvecs takes weights of one dtype, got "
                         f"{[f'{w.dtype}{list(w.shape)}' for w in ws]}")
    outs = tuple(jax.ShapeDtypeStruct((w.shape[0] if transposed else w.shape[1],), jnp.float32) for w in ws)
    call = jax.ffi.ffi_call(MATVEC_TARGET, outs)
    return list(call(x.reshape(x.size).astype(jnp.float32), *ws, transposed=np.int64(transposed)))


def matmul(x, w, *, transposed: bool = False, rows=None, f32_tiles: bool | None = None):
    """x [M, K] times w [K, N] (or w [N, K] when `transposed`: x w^T, the lm head on a [vocab, hidden]
    embedding) -> [M, N] float32; x and w both float32 or both bfloat16.

    Register-tiled on the CPU (`native/gemm.cc`); float32 sums in float32 FMAs, bfloat16 in
    `vdpbf16ps` pairs (AMX tiles where the CPU has them). Differentiable (the backward pass is
    jnp dots), so a model's training path may run through it. Call `gemm_available()` first.
    `rows` (an int32 scalar, traced or not; not differentiable): compute only x's first `rows`
    rows, the rest of the result is 0 (a step's padding rows cost nothing); each computed row is
    the same bits as without it. `f32_tiles` (None: `f32_tiles()`): float32 operands with a [N, K]
    weight (`transposed`) run on AMX tiles, each operand split into three bfloat16 parts (six
    products summed in float32; outputs that come out inf or NaN computed again by float32 FMAs),
    where the CPU has them; False keeps the FMAs.
    """
    if rows is None:
        return matmuls(x, [w], transposed=transposed, f32_tiles=f32_tiles)[0]
    _check_operands(x, (w,), transposed)
    n_axis = 0 if transposed else 1
    call = jax.ffi.ffi_call(GEMM_ROWS_TARGET, jax.ShapeDtypeStruct((x.shape[0], w.shape[n_axis]), jnp.float32))
    return call(jnp.asarray(rows, jnp.int32).reshape(()), x, w, transposed=np.int64(transposed),
                f32_tiles=np.int64(_f32_tiles_setting(f32_tiles)))


def matmuls(x, ws, *, transposed: bool = False, f32_tiles: bool | None = None):
    """[x w for w in ws]: the projections that read the same x (q/k/v, gate/up) in one call and one
    work split (fewer, larger jobs for the threads); as `matmul` otherwise."""
    ws = tuple(ws)
    _check_operands(x, ws, transposed)
    return list(_matmuls(x, ws, transposed, _f32_tiles_setting(f32_tiles)))


def f32_tiles() -> bool:
    """float32 [N, K] weights (`transposed`) multiply on AMX tiles, each operand split into three
    bfloat16 parts (`gemm_amx()`; JAXSERVE_F32_TILES=0 keeps the float32 FMAs, read when a step is traced)."""
    return os.environ.get("JAXSERVE_F32_TILES", "1") != "0" and gemm_amx()


def _f32_tiles_setting(value: bool | None) -> bool:
    return f32_tiles() if value is None else bool(value) and gemm_amx()


PACK_COLUMNS = 32   # a pre-packed weight's column block: the width of two AMX sum tiles


def packable(w) -> bool:
    """True when a [K, N] weight can be pre-packed for `matmuls_packed`: bfloat16, K and N multiples of 32."""
    return w.ndim == 2 and w.dtype == jnp.bfloat16 and w.shape[0] % 32 == 0 and w.shape[1] % PACK_COLUMNS == 0


def pack_weight(w):
    """A bfloat16 weight [K, N] laid out for the AMX tiles: [N / 32, K / 2, 32, 2], element [b, p, c, e]
    = w[2p + e, 32b + c] (each 32-column block in k pairs, contiguous). `unpack_weight` inverts it."""
    if not packable(w):
        raise ValueError(f"pack_weight takes a bfloat16 [K, N] with K and N multiples of 32, got "
                         f"{w.dtype}{list(w.shape)}")
    k, n = w.shape
    return w.reshape(k // 2, 2, n // PACK_COLUMNS, PACK_COLUMNS).transpose(2, 0, 3, 1)


def unpack_weight(wp):
    """The [K, N] weight `pack_weight` laid out as `wp` [N / 32, K / 2, 32, 2]."""
    nb, pairs, cols, two = wp.shape
    return wp.transpose(1, 3, 0, 2).reshape(2 * pairs, nb * cols)


def matmuls_packed(x, wps, out_dtype=jnp.float32):
    """[x w for w in weights] for x [M, K] bfloat16 and weights pre-packed by `pack_weight` -> [M, N_i]
    float32: the same bits as `matmuls(x, weights)` on AMX tiles, without packing the weights each
    call. `out_dtype` bfloat16: the same sums rounded as `.astype(jnp.bfloat16)` rounds them, at half
    the bytes written. Needs `gemm_amx()`. Not differentiable (the engine's step only)."""
    wps = tuple(wps)
    if out_dtype not in (jnp.float32, jnp.bfloat16):
        raise ValueError(f"matmuls_packed returns float32 or bfloat16, got {out_dtype}")
    if (x.ndim != 2 or x.dtype != jnp.bfloat16 or not wps or x.shape[1] % 32
            or any(w.ndim != 4 or w.dtype != jnp.bfloat16 or w.shape[1] * 2 != x.shape[1]
                   or w.shape[2:] != (PACK_COLUMNS, 2) for w in wps)):
        raise ValueError(f"matmuls_packed takes x [M, K] bfloat16 (K a multiple of 32) and weights "
                         f"[N / 32, K / 2, 32, 2] bfloat16, got {x.dtype}{list(x.shape)} and "
                         f"{[f'{w.dtype}{list(w.shape)}' for w in wps]}")
    call = jax.ffi.ffi_call(GEMM_PACKED_TARGET, tuple(
        jax.ShapeDtypeStruct((x.shape[0], w.shape[0] * PACK_COLUMNS), out_dtype) for w in wps))
    return list(call(x, *wps))


def _check_operands(x, ws, transposed: bool) -> None:
    k_axis = 1 if transposed else 0
    if x.ndim != 2 or not ws or any(w.ndim != 2 or w.shape[k_axis] != x.shape[1] for w in ws):
        raise ValueError(f"matmul takes x [M, K] and w {'[N, K]' if transposed else '[K, N]'}, got "
                         f"{list(x.shape)} and {[list(w.shape) for w in ws]}")
    if any(w.dtype != x.dtype for w in ws) or x.dtype not in (jnp.float32, jnp.bfloat16):
        raise ValueError(f"matmul takes float32 or bfloat16 operands of one dtype, got {x.dtype} and "
                         f"{[str(w.dtype) for w in ws]}")


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def _matmuls(x, ws, transposed, tiles):
    n_axis = 0 if transposed else 1
    call = jax.ffi.ffi_call(GEMM_TARGET, tuple(jax.ShapeDtypeStruct((x.shape[0], w.shape[n_axis]), jnp.float32)
                                               for w in ws))
    return tuple(call(x, *ws, transposed=np.int64(transposed), f32_tiles=np.int64(tiles)))


def _matmuls_fwd(x, ws, transposed, tiles):
    return _matmuls(x, ws, transposed, tiles), (x, ws)


def _matmuls_bwd(transposed, tiles, residuals, gs):
    x, ws = residuals
    x32 = x.astype(jnp.float32)
    kn = [w.astype(jnp.float32).T if transposed else w.astype(jnp.float32) for w in ws]   # each as [K, N]
    dx = sum(jnp.dot(g, w.T) for g, w in zip(gs, kn)).astype(x.dtype)
    dws = (jnp.dot(x32.T, g) for g in gs)
    return dx, tuple((dw.T if transposed else dw).astype(w.dtype) for dw, w in zip(dws, ws))


_matmuls.defvjp(_matmuls_fwd, _matmuls_bwd)


def silu_mul(gate, up):
    """`jax.nn.silu(gate.astype(bf16)) * up.astype(bf16)` for float32 gate and up [..., N] (a bfloat16
    SwiGLU's elementwise half, from its projections' float32 products; or the products already
    rounded to bfloat16, as pre-packed projections return them) -> bfloat16, bit for bit.

    XLA rounds each step of silu to bfloat16, so silu is a function of the 16 input bits: the
    kernel (`native/step_ops.cc`) looks up XLA's own results (`silu_table()`) instead of evaluating
    the chain, ~8 cycles an element in XLA's fusion. Differentiable (the backward pass is jnp).
    Call `available()` first.
    """
    if gate.shape != up.shape or gate.dtype != up.dtype or gate.dtype not in (jnp.float32, jnp.bfloat16):
        raise ValueError(f"silu_mul takes float32 (or already rounded bfloat16) gate and up of one shape and dtype, "
                         f"got {gate.dtype}{list(gate.shape)} and {up.dtype}{list(up.shape)}")
    return _silu_mul(gate, up)


def silu_mul_reference(gate, up):
    """What `silu_mul` computes, in jnp: its oracle and its backward pass."""
    return jax.nn.silu(gate.astype(jnp.bfloat16)) * up.astype(jnp.bfloat16)


_SILU_LOCK = threading.Lock()
_SILU_TABLE: list[np.ndarray] = []   # silu_table()'s one result


def silu_table() -> np.ndarray:
    """XLA's bfloat16 silu of every bfloat16 value (indexed by its bits), as float32 [65536].

    Computed once, when the kernels load: computed inside the first step traced instead, the
    warm-up's concurrent traces lowered the same bucket to different programs from one start
    to the next (XLA's persistent cache then missed on a warm start).
    """
    with _SILU_LOCK:
        if _SILU_TABLE:
            return _SILU_TABLE[0]
        with jax.ensure_compile_time_eval(), jax.default_device(jax.devices("cpu")[0]):
            values = jnp.asarray(np.arange(1 << 16, dtype=np.uint16).view(jnp.bfloat16))
            _SILU_TABLE.append(np.asarray(jax.nn.silu(values).astype(jnp.float32)))
        return _SILU_TABLE[0]


def silu_table_ready() -> bool:
    """True once the kernels loaded with the silu table (`silu_mul` may be traced)."""
    return available() and bool(_SILU_TABLE)


@jax.custom_vjp
def _silu_mul(gate, up):
    call = jax.ffi.ffi_call(SILU_MUL_TARGET, jax.ShapeDtypeStruct(gate.shape, jnp.bfloat16))
    return call(gate, up, jnp.asarray(silu_table()))


def _silu_mul_fwd(gate, up):
    return _silu_mul(gate, up), (gate, up)


def _silu_mul_bwd(residuals, g):
    return jax.vjp(silu_mul_reference, *residuals)[1](g)


_silu_mul.defvjp(_silu_mul_fwd, _silu_mul_bwd)


def write_kv(kv_cache, k, v, slot_mapping, *, rope=None):
    """`write_kv_cache(kv_cache, k, v, slot_mapping)` on the CPU: each token's K/V rows copied into its
    slot of the pool, which is updated in place (donate it); the same bits as the jnp scatter.

    XLA lays the scatter's updates out token-major, so the fusion feeding it ends in a transposing
    copy (~50 us a layer at 64 decode tokens, ~330 us at 512 here; `native/step_ops.cc`). bfloat16 k
    and v go in as they are (a uint16 pool holds their bits). `rope` (cos, sin) [T, D] bfloat16 (where
    `rope_supported`): k comes unrotated and is rotated on its way in, with the roundings XLA's
    fusion of a bf16 model's rotate-half RoPE takes (each product rounded to bf16, their sum in
    float32 rounded to bf16), so the pool gets the same bits without XLA's pass over k. Not
    differentiable (the training path has no cache). Call `available()` first.
    """
    check_kv_write(kv_cache, k, v, slot_mapping)
    if rope is not None and not rope_supported(k, kv_cache):
        raise ValueError(f"write_kv(rope=...) takes bfloat16 k into a uint16 pool with a head dim of a multiple of 32, "
                         f"got k {k.dtype}{list(k.shape)} and a {kv_cache.dtype} pool")
    if kv_cache.dtype == jnp.uint16 and k.dtype != jnp.bfloat16:   # the bits of k's 16-bit float type
        k, v = [jax.lax.bitcast_convert_type(x.astype(k.dtype), jnp.uint16) for x in (k, v)]
    elif kv_cache.dtype != jnp.uint16:
        k, v = k.astype(kv_cache.dtype), v.astype(kv_cache.dtype)
    cos, sin = _rope_tables("write_kv", k, rope)
    call = jax.ffi.ffi_call(WRITE_KV_TARGET, jax.ShapeDtypeStruct(kv_cache.shape, kv_cache.dtype),
                            input_output_aliases={0: 0})
    return call(kv_cache, k, v.astype(k.dtype), slot_mapping, cos, sin, rope=np.int64(rope is not None))


def _rope_tables(name: str, x, rope):
    """`rope`'s (cos, sin), checked to be [T, D] bfloat16 for x [T, heads, D], for a native call that
    rotates x; without rope, the empty stand-ins the call takes in their place."""
    if rope is None:
        return (jnp.zeros((0,), jnp.bfloat16),) * 2
    cos, sin = rope
    want = (x.shape[0], x.shape[-1])
    if cos.shape != want or sin.shape != want or cos.dtype != jnp.bfloat16 or sin.dtype != jnp.bfloat16:
        raise ValueError(f"{name}'s rope takes cos and sin [T, D] = [{want[0]}, {want[1]}] bfloat16, got "
                         f"{cos.dtype}{list(cos.shape)} and {sin.dtype}{list(sin.shape)}")
    return cos, sin


def rope_supported(x, kv_cache) -> bool:
    """The native kernels can rotate x (k in `write_kv(rope=...)`, q in `paged_context_native(rope=...)`):
    bfloat16 against a uint16 pool, a head dim of a multiple of 32, kernels built with AVX-512 BF16."""
    return x.dtype == jnp.bfloat16 and kv_cache.dtype == jnp.uint16 and x.shape[-1] % 32 == 0 and gemm_available()


def rope_applies(x, kv_cache) -> bool:
    """The engine's step rotates x natively: `rope_supported`, and JAXSERVE_NATIVE_ROPE is not 0 (read when a
    step is traced; 0 keeps XLA's RoPE, for A/B benchmarks)."""
    return os.environ.get("JAXSERVE_NATIVE_ROPE", "1") != "0" and rope_supported(x, kv_cache)


def add_rms_norm(x, delta, weight, eps: float):
    """(x + delta, RMSNorm(x + delta) * weight) for a decoder on the CPU, in one pass: the residual
    add of a sublayer's output and the norm of the next.

    bfloat16 model (weight [H] bfloat16): x [T, H] float32 (the residual stream, which XLA keeps in
    float32 in a bf16 model) or bfloat16 (the embedding); delta [T, H] float32 (a projection's
    unrounded product plus its bias: rounded to bfloat16 first, as the projection's output is) or
    bfloat16, or None (no add). Returns (the sum in float32, the norm in bfloat16).
    float32 model (weight [H] float32): x and delta float32, nothing rounded; returns two float32
    arrays. Either way `add_rms_norm_reference`'s values but for the norm's sum of squares, taken
    in a fixed order of its own per row (`native/step_ops.cc`; XLA's order depends on the step's
    shape), which may move an output by a few ulps (bf16: 2, float32: 5 in the tests). Not
    differentiable (the engine's step only). Call `available()` first."""
    f32 = weight.dtype == jnp.float32
    if (x.ndim != 2 or x.dtype not in ((jnp.float32,) if f32 else (jnp.float32, jnp.bfloat16))
            or weight.shape != x.shape[-1:] or weight.dtype not in (jnp.float32, jnp.bfloat16)):
        raise ValueError(f"add_rms_norm takes x [T, H] float32 or bfloat16 and weight [H] bfloat16 (or x and weight "
                         f"float32), got {x.dtype}{list(x.shape)} and {weight.dtype}{list(weight.shape)}")
    if delta is not None and (delta.shape != x.shape or delta.dtype not in (
            (jnp.float32,) if f32 else (jnp.float32, jnp.bfloat16))):
        raise ValueError(f"add_rms_norm takes delta [T, H] like x {list(x.shape)}"
                         f"{' (float32, as the weight)' if f32 else ', float32 or bfloat16'}, got "
                         f"{delta.dtype}{list(delta.shape)}")
    call = jax.ffi.ffi_call(ADD_RMS_NORM_TARGET, (jax.ShapeDtypeStruct(x.shape, jnp.float32),
                                                  jax.ShapeDtypeStruct(x.shape, weight.dtype)))
    return tuple(call(x, x if delta is None else delta, weight, eps=np.float32(eps), add=np.int64(delta is not None)))


def add_rms_norm_reference(x, delta, weight, eps: float):
    """What `add_rms_norm` computes, in jnp: the residual in float32 plus the delta (rounded to
    bfloat16 first for a bf16 weight), and HF's RMSNorm of it (float32 math; for a bf16 weight the
    normed rounded to bf16 before the weight): its oracle."""
    x = x.astype(jnp.float32)
    if delta is not None:
        x = x + delta.astype(weight.dtype).astype(jnp.float32)
    normed = (x * jax.lax.rsqrt(jnp.mean(jnp.square(x), axis=-1, keepdims=True) + eps)).astype(weight.dtype)
    return x, weight * normed


def log_softmax(x):
    """jax.nn.log_softmax(x, axis=-1) of logits x [S, V] float32, each row by itself on the CPU: the
    sum of exponentials in a fixed order per row (`native/step_ops.cc`), so a row's logprobs do not
    depend on the rows beside it (XLA's fused reduction follows the row count). Within float32
    rounding of jax's (its exp and sum order differ). Not differentiable. Call `available()` first."""
    if x.ndim != 2 or x.dtype != jnp.float32:
        raise ValueError(f"log_softmax takes x [S, V] float32, got {x.dtype}{list(x.shape)}")
    return jax.ffi.ffi_call(LOG_SOFTMAX_TARGET, jax.ShapeDtypeStruct(x.shape, jnp.float32))(x)
