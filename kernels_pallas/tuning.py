"""Block sizes of the Pallas ragged paged attention kernels, by device kind, head_dim and dtype.

Plain data, read at trace time by `ragged_paged_attention_gpu` / `_tpu`, which pass the
device kind they run on (`jax.devices()[0].device_kind`); nothing here touches a device.
Any entry can be overridden per call with the kernels' keyword knobs. Two layers:
- measured tables (`tuning_measured.json` beside this file, keyed by device kind, then
  backend, then "head_dim/dtype"): what a sweep on that device chose; an entry may name
  only some fields, the rest come from the defaults;
- the defaults below (`GPU_TUNING`, `TPU_TUNING`), used for every device kind, head_dim
  or dtype that no measured table covers (and in interpret mode and cross-lowering).

Measuring: `python -m kernels_pallas.tuning --sweep --out FILE` on the device (the sweep
is `tuning_sweep.py`; `benchmarks/device_check.sh` runs a short one) writes a table in the
file format above; `python -m kernels_pallas.tuning --merge FILE` adds it to
`tuning_measured.json`, which is committed like code.

Status: the GPU defaults are starting points chosen from the kernels' structure, not yet
measured on an H100/H200 (no GPU was lent so far). The reasoning behind them:
- Decode work items are memory-bound: 16 matmul rows (the smallest Triton `dot` M) keep
  the wasted MMA work low, 64 keys per step (4 pages of 16) with 3 pipeline stages keep
  ~48 KiB of K/V loads in flight per program at head_dim 128 in bf16.
- Prefill tiles of 64 rows re-read each K/V block for 64 query rows, which makes them
  compute-bound on Hopper at realistic contexts; 4 warps, 2 stages fit the shared memory
  of one SM with room for two programs.
- float32 halves what fits, so it uses 32-key blocks; its dots run without TF32 (exact
  float32), so float32 on GPU is for testing, not speed.
- TPU: rows are a multiple of the 8 (f32) / 16 (bf16) sublane tiling and 128 keys per
  step, so one step's K/V DMA (P pages) is 32 KiB at head_dim 128 in bf16.

Page size (the engine's `--block-size`, the KV cache's block_size axis) is the caller's
choice; `PAGE_SIZE` is the value these tables assume and what the engine defaults to.
The GPU kernel needs a power of two (its loads are powers of two); the TPU kernel a
multiple of the sublane tiling (8 rows for 32-bit, 16 for 16-bit dtypes).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import sys
from pathlib import Path

PAGE_SIZE = 16           # tokens per KV page the tables were chosen for
H100_NUM_SMS = 132       # H100 / H200 SXM; used when the device cannot be asked (cross-lowering)


@dataclasses.dataclass(frozen=True)
class GpuBlockSizes:
    """Static block sizes of the Triton kernel for one (head_dim, dtype)."""

    decode_rows: int        # matmul rows of a decode work item: tokens x (padded) q heads per KV head
    prefill_rows: int       # matmul rows of a prefill tile
    kv_block: int           # keys per inner-loop step (whole pages: max(1, kv_block // page_size) pages)
    decode_warps: int
    decode_stages: int
    prefill_warps: int
    prefill_stages: int
    max_kv_splits: int      # cap on how many programs share one decode item's KV (flash-decoding)


@dataclasses.dataclass(frozen=True)
class TpuBlockSizes:
    """Static block sizes of the Mosaic TPU kernel for one (head_dim, dtype)."""

    decode_rows: int        # rows of a decode work item (a multiple of the sublane tiling)
    prefill_rows: int       # rows of a prefill tile
    kv_block: int           # keys per DMA'd K/V step (whole pages)


_GPU_16BIT = {
    64: GpuBlockSizes(decode_rows=16, prefill_rows=64, kv_block=64, decode_warps=4, decode_stages=3,
                      prefill_warps=4, prefill_stages=2, max_kv_splits=16),
    128: GpuBlockSizes(decode_rows=16, prefill_rows=64, kv_block=64, decode_warps=4, decode_stages=3,
                       prefill_warps=4, prefill_stages=2, max_kv_splits=16),
    256: GpuBlockSizes(decode_rows=16, prefill_rows=32, kv_block=32, decode_warps=4, decode_stages=2,
                       prefill_warps=4, prefill_stages=2, max_kv_splits=16),
}
_GPU_32BIT = {
    head_dim: dataclasses.replace(sizes, prefill_rows=min(sizes.prefill_rows, 32), kv_block=32, decode_stages=2)
    for head_dim, sizes in _GPU_16BIT.items()
}
GPU_TUNING: dict[tuple[int, str], GpuBlockSizes] = {
    **{(d, "bfloat16"): s for d, s in _GPU_16BIT.items()},
    **{(d, "float16"): s for d, s in _GPU_16BIT.items()},
    **{(d, "float32"): s for d, s in _GPU_32BIT.items()},
}

TPU_TUNING: dict[tuple[int, str], TpuBlockSizes] = {
    **{(d, dt): TpuBlockSizes(decode_rows=16, prefill_rows=128, kv_block=128)
       for d in (64, 128, 256) for dt in ("bfloat16", "float16")},
    **{(d, "float32"): TpuBlockSizes(decode_rows=8, prefill_rows=128, kv_block=128) for d in (64, 128, 256)},
}


BACKENDS = ("pallas_gpu", "pallas_tpu")
MEASURED_TABLES = Path(__file__).with_name("tuning_measured.json")
TABLE_FORMAT = 1     # version of the file format: {"format": 1, "tables": {kind: {backend: {"D/dtype": {...}}}}}
_DEFAULTS = {"pallas_gpu": (GPU_TUNING, "Pallas GPU"), "pallas_tpu": (TPU_TUNING, "Pallas TPU")}


def table_key(head_dim: int, dtype: str) -> str:
    """The key of one entry in a measured table: "128/bfloat16"."""
    return f"{head_dim}/{dtype}"


def default_block_sizes(backend: str, head_dim: int, dtype: str):
    """The defaults' entry; ValueError naming head_dim / dtype when there is none."""
    table, kind = _DEFAULTS[backend]
    try:
        return table[(head_dim, dtype)]
    except KeyError:
        known = sorted({d for d, _ in table}), sorted({t for _, t in table})
        raise ValueError(f"no {kind} tuning for head_dim={head_dim}, dtype={dtype}; "
                         f"the table covers head_dim in {known[0]} and dtype in {known[1]}") from None


def block_sizes(backend: str, head_dim: int, dtype: str, device_kind: str | None = None,
                tables: dict | None = None):
    """The block sizes for `backend` on `device_kind`: its measured entry over the defaults.

    `tables` ({device_kind: {backend: {"D/dtype": {field: value}}}}) defaults to the
    shipped `tuning_measured.json`; `device_kind` None (cross-lowering, interpret mode)
    and kinds or keys without an entry get the defaults.
    """
    default = default_block_sizes(backend, head_dim, dtype)
    if device_kind is None:
        return default
    tables = measured_tables() if tables is None else tables
    entry = tables.get(device_kind, {}).get(backend, {}).get(table_key(head_dim, dtype))
    if not entry:
        return default
    unknown = sorted(set(entry) - {f.name for f in dataclasses.fields(default)})
    if unknown:
        raise ValueError(f"measured tuning for {device_kind!r} {backend} {table_key(head_dim, dtype)} has unknown "
                         f"field(s) {unknown}; known: {[f.name for f in dataclasses.fields(default)]}")
    return dataclasses.replace(default, **entry)


def gpu_block_sizes(head_dim: int, dtype: str, device_kind: str | None = None) -> GpuBlockSizes:
    """The GPU entry (measured for `device_kind`, else the default); ValueError naming head_dim / dtype."""
    return block_sizes("pallas_gpu", head_dim, dtype, device_kind)


def tpu_block_sizes(head_dim: int, dtype: str, device_kind: str | None = None) -> TpuBlockSizes:
    """The TPU entry (measured for `device_kind`, else the default); ValueError naming head_dim / dtype."""
    return block_sizes("pallas_tpu", head_dim, dtype, device_kind)


# ---- measured tables on disk ---------------------------------------------------------------------


def read_tables(path: str | Path) -> dict:
    """The "tables" of a tuning file, checked: {device_kind: {backend: {"D/dtype": {field: int}}}}."""
    data = json.loads(Path(path).read_text())
    if not isinstance(data, dict) or data.get("format") != TABLE_FORMAT or not isinstance(data.get("tables"), dict):
        raise ValueError(f"{path}: not a tuning file of format {TABLE_FORMAT} "
                         '({"format": 1, "tables": {device_kind: {backend: {"D/dtype": {...}}}}})')
    for kind, backends in data["tables"].items():
        for backend, entries in backends.items():
            if backend not in BACKENDS:
                raise ValueError(f"{path}: {kind!r} has backend {backend!r}; known: {BACKENDS}")
            fields = {f.name for f in dataclasses.fields(next(iter(_DEFAULTS[backend][0].values())))}
            for key, entry in entries.items():
                bad = sorted(set(entry) - fields) + sorted(k for k, v in entry.items()
                                                           if not isinstance(v, int) or isinstance(v, bool))
                if bad:
                    raise ValueError(f"{path}: {kind!r} {backend} {key}: unknown or non-int field(s) {bad}")
    return data["tables"]


@functools.cache
def measured_tables() -> dict:
    """The shipped measured tables (read once); {} when the file is absent."""
    return read_tables(MEASURED_TABLES) if MEASURED_TABLES.is_file() else {}


def merge_tables(source: str | Path, into: str | Path = MEASURED_TABLES) -> dict:
    """Add the tables of a sweep's file to `into` (entries of the same device kind, backend and key are
    replaced); returns what was merged. Refuses sweeps run in interpret mode (their times mean nothing)."""
    data = json.loads(Path(source).read_text())
    if data.get("sweep", {}).get("interpret"):
        raise ValueError(f"{source}: the sweep ran in interpret mode; its times say nothing about a device")
    new = read_tables(source)
    into = Path(into)
    merged = {"format": TABLE_FORMAT, "tables": {}}
    if into.is_file():
        read_tables(into)   # never extend a malformed file
        merged = json.loads(into.read_text())
    for kind, backends in new.items():
        for backend, entries in backends.items():
            merged["tables"].setdefault(kind, {}).setdefault(backend, {}).update(entries)
            if "sweep" in data:
                sources = merged.setdefault("sources", {}).setdefault(kind, {})
                sources[backend] = {k: data["sweep"].get(k) for k in ("date", "jax_version", "shapes")}
    into.write_text(json.dumps(merged, indent=1, sort_keys=True) + "\n")
    measured_tables.cache_clear()
    return new


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if "--sweep" in argv:   # the sweep's own flags (and --help): tuning_sweep.py
        from kernels_pallas import tuning_sweep   # jax and the kernels: only when measuring
        return tuning_sweep.main([a for a in argv if a != "--sweep"])
    ap = argparse.ArgumentParser(prog="python -m kernels_pallas.tuning",
                                 description="Measure block sizes on this device, or merge a measured table.")
    what = ap.add_mutually_exclusive_group(required=True)
    what.add_argument("--sweep", action="store_true",
                      help="time candidates on this device and write a table: see --sweep --help")
    what.add_argument("--merge", metavar="FILE", help=f"add FILE's tables to {MEASURED_TABLES.name}")
    what.add_argument("--show", action="store_true", help="print the measured tables")
    args = ap.parse_args(argv)
    if args.merge:
        merged = merge_tables(args.merge)
        print(f"merged into {MEASURED_TABLES}: " + ", ".join(
            f"{kind} {backend} {sorted(entries)}" for kind, b in merged.items() for backend, entries in b.items()))
    else:
        print(json.dumps(measured_tables(), indent=1, sort_keys=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
