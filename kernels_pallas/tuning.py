"""Block sizes of the Pallas ragged paged attention kernels, by head_dim and dtype.

Plain data, read at trace time by `ragged_paged_attention_gpu` / `_tpu`; nothing here
touches a device. Any entry can be overridden per call with the kernels' keyword knobs.

Status: the GPU values are starting points chosen from the kernels' structure, not yet
measured on an H100/H200 (no GPU was lent so far). Re-tune with
`python benchmarks/kernel_bench.py --sweep` on the target GPU and update the table.
The reasoning behind the starting points:
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

import dataclasses

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


def _lookup(table, kind: str, head_dim: int, dtype: str):
    try:
        return table[(head_dim, dtype)]
    except KeyError:
        known = sorted({d for d, _ in table}), sorted({t for _, t in table})
        raise ValueError(f"no {kind} tuning for head_dim={head_dim}, dtype={dtype}; "
                         f"the table covers head_dim in {known[0]} and dtype in {known[1]}") from None


def gpu_block_sizes(head_dim: int, dtype: str) -> GpuBlockSizes:
    """The GPU table entry; ValueError naming head_dim / dtype when there is none."""
    return _lookup(GPU_TUNING, "Pallas GPU", head_dim, dtype)


def tpu_block_sizes(head_dim: int, dtype: str) -> TpuBlockSizes:
    """The TPU table entry; ValueError naming head_dim / dtype when there is none."""
    return _lookup(TPU_TUNING, "Pallas TPU", head_dim, dtype)
