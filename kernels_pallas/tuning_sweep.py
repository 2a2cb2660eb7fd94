"""Block-size sweep of a Pallas attention kernel on this device -> a measured tuning table.

What flows through, on the caller's thread: for each (head_dim, dtype) asked for, two random
batches shaped like serving steps (a decode batch, and a mixed batch where two decodes are
replaced by prefill chunks, padded to a power-of-two token count as the runner pads), then
the backend's kernel timed on both (median of `--reps` calls after a compile) for the default
block sizes, for candidates that change one field at a time, and for the per-field winners
combined. A candidate whose output differs from the default's beyond rounding is dropped.
The fastest (decode + mixed time) becomes the table entry, written after every
(head_dim, dtype) as a tuning file (`tuning.read_tables`' format, keyed by
`jax.devices()[0].device_kind`) with every measurement under "sweep".

On a CPU it runs only with `--interpret` (Pallas' interpreter, tiny shapes): the times mean
nothing there, which is why `tuning.merge_tables` refuses such files; it checks the sweep
and its file format.

    python -m kernels_pallas.tuning --sweep --out sweep.json                      # on a GPU / TPU
    python -m kernels_pallas.tuning --sweep --out sweep.json --quick              # fewer candidates
    python -m kernels_pallas.tuning --sweep --out sweep.json --interpret --quick  # CPU rehearsal
    python -m kernels_pallas.tuning --merge sweep.json                            # keep the result
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import functools
import json
import statistics
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from kernels_pallas import tuning

# Values tried per field, one field at a time from the default (the default's own value is skipped).
CANDIDATES = {
    "pallas_gpu": {"kv_block": (32, 64, 128), "decode_stages": (2, 3, 4), "decode_warps": (4, 8),
                   "prefill_rows": (32, 64, 128), "prefill_warps": (4, 8), "prefill_stages": (2, 3)},
    "pallas_tpu": {"decode_rows": (16, 32), "prefill_rows": (64, 128, 256), "kv_block": (64, 128, 256, 512)},
}
QUICK_CANDIDATES = {
    "pallas_gpu": {"kv_block": (32, 64, 128), "prefill_rows": (32, 64, 128)},
    "pallas_tpu": {"prefill_rows": (64, 128, 256), "kv_block": (64, 128, 256)},
}
TINY_CANDIDATES = {   # --interpret: block sizes that fit the tiny batches
    "pallas_gpu": {"kv_block": (16, 32), "prefill_rows": (16, 32)},
    "pallas_tpu": {"prefill_rows": (32, 64), "kv_block": (32, 64)},
}
# Heads per head_dim, from the models these sizes serve: SmolLM2-135M (the default model),
# Llama-3-8B, Gemma-2 style. Tables are keyed by head_dim and dtype only.
HEADS = {64: (3, 3), 128: (8, 4), 256: (4, 2)}   # head_dim -> (KV heads, q heads per KV head)
SIZES = {   # name -> (sequences, context per sequence, prefill chunk, timed calls)
    "full": (64, 2048, 512, 10),
    "quick": (32, 1024, 256, 5),
    "tiny": (2, 32, 16, 1),
}
_BACKEND_OF_PLATFORM = {"gpu": "pallas_gpu", "tpu": "pallas_tpu"}


def kernel_fn(backend: str):
    """The backend's kernel entry point (imported only when swept)."""
    if backend == "pallas_gpu":
        from kernels_pallas.ragged_paged_attention_gpu import ragged_paged_attention_gpu
        return ragged_paged_attention_gpu
    from kernels_pallas.ragged_paged_attention_tpu import ragged_paged_attention_tpu
    return ragged_paged_attention_tpu


def kernel_knobs(backend: str, sizes) -> dict:
    """The kernel's keyword knobs for one table entry."""
    if backend == "pallas_gpu":
        return dict(decode_rows=sizes.decode_rows, prefill_rows=sizes.prefill_rows, kv_block=sizes.kv_block,
                    num_warps=(sizes.decode_warps, sizes.prefill_warps),
                    num_stages=(sizes.decode_stages, sizes.prefill_stages))
    return dict(decode_rows=sizes.decode_rows, prefill_rows=sizes.prefill_rows, kv_block=sizes.kv_block)


def make_batch(seqs, *, kv_heads: int, group: int, head_dim: int, page_size: int, dtype, seed: int) -> dict:
    """Kernel inputs for sequences given as (context_len, query_len); pages shuffled over the pool."""
    rng = np.random.default_rng(seed)
    pages = [-(-ctx // page_size) for ctx, _ in seqs]
    num_blocks = sum(pages) + 1                                   # + the null block 0
    free = rng.permutation(np.arange(1, num_blocks))
    tables = np.zeros((len(seqs), max(pages)), np.int32)
    used = 0
    for s, n in enumerate(pages):
        tables[s, :n] = free[used:used + n]
        used += n
    q_lens = [q for _, q in seqs]
    num_tokens = 1 << max(0, (sum(q_lens) - 1).bit_length())      # the runner's power-of-two bucket
    k1, k2 = jax.random.split(jax.random.key(seed))
    return dict(q=jax.random.normal(k1, (num_tokens, kv_heads * group, head_dim), dtype),
                kv_cache=jax.random.normal(k2, (2, kv_heads, num_blocks, page_size, head_dim), dtype),
                block_tables=jnp.asarray(tables), context_lens=jnp.asarray([c for c, _ in seqs], jnp.int32),
                query_start_loc=jnp.asarray(np.concatenate([[0], np.cumsum(q_lens)]), jnp.int32),
                num_seqs=jnp.int32(len(seqs)))


def median_ms(fn, batch: dict, reps: int) -> float:
    jax.block_until_ready(fn(**batch))   # compile + warm up
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(**batch))
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def candidates(default, grid: dict) -> list[tuple[str, object]]:
    """(label, sizes): the default, then one field changed at a time."""
    out = [("default", default)]
    for field, values in grid.items():
        out += [(f"{field}={v}", dataclasses.replace(default, **{field: v}))
                for v in values if v != getattr(default, field)]
    return out


def sweep_one(backend: str, head_dim: int, dtype: str, *, sizes: str, grid: dict, page_size: int,
              interpret: bool) -> dict:
    """Time every candidate for one (head_dim, dtype) -> {"chosen": fields, "results": rows}."""
    seqs, context, chunk, reps = SIZES[sizes]
    kv_heads, group = HEADS[head_dim] if sizes != "tiny" else (1, 2)
    shape = dict(kv_heads=kv_heads, group=group, head_dim=head_dim, page_size=page_size, dtype=jnp.dtype(dtype))
    batches = {"decode": make_batch([(context, 1)] * seqs, seed=1, **shape),
               "mixed": make_batch([(context, 1)] * (seqs - 2) + [(chunk, chunk), (context + chunk, chunk)],
                                   seed=2, **shape)}
    kernel = functools.partial(kernel_fn(backend), sm_scale=head_dim ** -0.5, interpret=interpret)
    tol = 1e-4 if dtype == "float32" else 2e-2     # block sizes change the rounding order only
    default = tuning.default_block_sizes(backend, head_dim, dtype)
    rows, want = [], {}

    def measure(label, cand):
        row = dict(candidate=label, fields=dataclasses.asdict(cand))
        try:
            fn = functools.partial(kernel, **kernel_knobs(backend, cand))
            row["ok"], row["max_abs_diff"] = True, 0.0
            for name, batch in batches.items():
                row[f"{name}_ms"] = median_ms(fn, batch, reps)
                got = np.asarray(fn(**batch), np.float32)
                ref = want.setdefault(name, got)           # the default runs first: its output is the reference
                row["max_abs_diff"] = max(row["max_abs_diff"], float(np.abs(got - ref).max()))
                row["ok"] = row["ok"] and bool(np.allclose(got, ref, rtol=tol, atol=tol))
            row["total_ms"] = row["decode_ms"] + row["mixed_ms"]
        except Exception as e:  # noqa: BLE001 - a candidate that does not compile or run is a result too
            row.update(ok=False, error=f"{type(e).__name__}: {e}"[:300])
        rows.append(row)
        return row

    tried = candidates(default, grid)
    if not measure(*tried[0])["ok"]:
        raise RuntimeError(f"{backend} {head_dim}/{dtype}: the default block sizes failed: {rows[0].get('error')}")
    for label, cand in tried[1:]:
        measure(label, cand)
    good = [r for r in rows if r["ok"]]
    best = min(good, key=lambda r: r["total_ms"])
    # Per field, the value of the fastest correct one-field candidate (or the default's value), all at once.
    combined = {}
    for field in grid:
        mine = [r for r in good if r["candidate"] == "default" or r["candidate"].startswith(f"{field}=")]
        combined[field] = min(mine, key=lambda r: r["total_ms"])["fields"][field]
    combo = dataclasses.replace(default, **combined)
    if combo not in [cand for _, cand in tried]:
        row = measure("combined", combo)
        if row["ok"] and row["total_ms"] < best["total_ms"]:
            best = row
    return dict(chosen=best["fields"], chosen_candidate=best["candidate"], results=rows,
                default_total_ms=rows[0].get("total_ms"), chosen_total_ms=best["total_ms"],
                batches={name: dict(tokens=int(b["q"].shape[0]), seqs=int(b["num_seqs"]))
                         for name, b in batches.items()})


def run(args) -> dict:
    device = jax.devices()[0]
    backend = args.backend or _BACKEND_OF_PLATFORM.get(device.platform)
    if backend is None:
        if not args.interpret:
            raise SystemExit(f"no GPU or TPU here ({device.platform}): run on one, or pass --interpret "
                             "(tiny shapes; the times mean nothing)")
        backend = "pallas_gpu"
    sizes = "tiny" if args.interpret else "quick" if args.quick else "full"
    grid = (TINY_CANDIDATES if args.interpret else QUICK_CANDIDATES if args.quick else CANDIDATES)[backend]
    head_dims = args.head_dims or ((64,) if args.interpret else (64, 128))
    dtypes = args.dtypes or (("float32",) if args.interpret else ("bfloat16",))
    out = {"format": tuning.TABLE_FORMAT, "tables": {device.device_kind: {backend: {}}},
           "sweep": dict(device_kind=device.device_kind, platform=device.platform, backend=backend,
                         interpret=args.interpret, jax_version=jax.__version__, sizes=sizes,
                         shapes=dict(zip(("seqs", "context", "prefill_chunk", "reps"), SIZES[sizes]),
                                     page_size=args.page_size),
                         candidates={k: list(v) for k, v in grid.items()},
                         date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                         results={})}
    for head_dim in head_dims:
        for dtype in dtypes:
            key = tuning.table_key(head_dim, dtype)
            t0 = time.perf_counter()
            result = sweep_one(backend, head_dim, dtype, sizes=sizes, grid=grid, page_size=args.page_size,
                               interpret=args.interpret)
            result["seconds"] = time.perf_counter() - t0
            default = dataclasses.asdict(tuning.default_block_sizes(backend, head_dim, dtype))
            # The entry names only what differs from the defaults ({} = the defaults won).
            out["tables"][device.device_kind][backend][key] = {
                k: v for k, v in result["chosen"].items() if v != default[k]}
            out["sweep"]["results"][key] = result
            print(f"{key}: {result['chosen_candidate']} {result['chosen_total_ms']:.3f} ms "
                  f"(default {result['default_total_ms']:.3f} ms; {len(result['results'])} candidates, "
                  f"{result['seconds']:.1f} s)", flush=True)
            Path(args.out).write_text(json.dumps(out, indent=1) + "\n")   # after each key: a timeout keeps them
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m kernels_pallas.tuning --sweep", description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True, help="the tuning file to write (JSON)")
    ap.add_argument("--backend", choices=tuning.BACKENDS, default=None,
                    help="default: this platform's (pallas_gpu under --interpret on a CPU)")
    ap.add_argument("--head-dims", type=lambda s: tuple(int(x) for x in s.split(",")), default=None,
                    help="default 64,128 (64 under --interpret)")
    ap.add_argument("--dtypes", type=lambda s: tuple(s.split(",")), default=None,
                    help="default bfloat16 (float32 under --interpret)")
    ap.add_argument("--page-size", type=int, default=tuning.PAGE_SIZE)
    ap.add_argument("--quick", action="store_true", help="fewer candidates and smaller batches")
    ap.add_argument("--interpret", action="store_true", help="Pallas interpreter, tiny shapes (CPU rehearsal)")
    run(ap.parse_args(argv))
    return 0
