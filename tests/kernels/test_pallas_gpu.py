"""The Pallas GPU (Triton) ragged paged attention kernel on CPU: interpret mode vs the reference,
input checks, and cross-lowering for CUDA.

Interpret mode runs the kernel's own code (work-item planning, the grid, the page gathers
through the block tables, the online softmax, the split-KV merge) but not Triton's
compile to PTX; `test_lowers_for_cuda` covers the lowering to Triton IR. Timings and the
PTX compile need a GPU (benchmarks/kernel_bench.py). On a GPU, `--pallas-on-device` runs
the reference comparisons with the kernel compiled for it (tests/kernels/conftest.py;
benchmarks/device_check.sh).
"""

from __future__ import annotations

import inspect

import jax.numpy as jnp
import pytest

from kernels_pallas.ragged_paged_attention_gpu import ragged_paged_attention_gpu
from tests.kernels.pallas_cases import (BF16, GQA_1, GQA_3, GQA_8_HEAD_DIM_128, LARGE_LOGITS, SCENARIOS,
                                        WINDOW_SOFT_CAP, batch, check_against_reference, lowered_text,
                                        run_compiled)

# Small blocks so every loop runs several times on these small caches: 16-row decode
# items and prefill tiles (prefills span several tiles), 16-key KV blocks (2 pages).
SMALL = dict(decode_rows=16, prefill_rows=16, kv_block=16, kv_splits=1)

# name -> (batch options, kernel knobs, scenarios)
CONFIGS = {
    "base": ({}, SMALL, list(SCENARIOS)),
    # the tuning table's tile sizes; flash-decoding with 3 programs sharing each decode
    # item's KV blocks (uneven and empty splits), merged afterwards
    "tuned_rows_kv_splits_3": ({}, {"kv_block": 16, "kv_splits": 3},
                               ["decode_only", "mixed", "prefix_hit", "page_boundary"]),
    "gqa_1": (GQA_1, SMALL, ["mixed", "decode_only"]),
    "gqa_3": (GQA_3, SMALL, ["mixed", "prefix_hit"]),
    "gqa_8_head_dim_128": (GQA_8_HEAD_DIM_128, SMALL, ["mixed", "decode_only"]),
    "bf16_head_dim_128": (BF16, {**SMALL, "kv_block": 32}, ["mixed", "decode_only", "prefix_hit"]),
    "window_soft_cap": (LARGE_LOGITS, {**SMALL, **WINDOW_SOFT_CAP}, ["mixed", "prefix_hit"]),
}
DEVICE_PLATFORM = "gpu"   # under --pallas-on-device, test_matches_reference runs the kernel compiled for it
CASES = [pytest.param(name, scenario, id=f"{name}-{scenario}")
         for name, (_, _, scenarios) in CONFIGS.items() for scenario in scenarios]


def sm_scale(args) -> float:
    return args[0].shape[-1] ** -0.5


@pytest.mark.parametrize("config, scenario", CASES)
def test_matches_reference(config, scenario, pallas_interpret):
    options, knobs, _ = CONFIGS[config]
    args = batch(scenario, **options)
    got = run_compiled(ragged_paged_attention_gpu, args, sm_scale=sm_scale(args), interpret=pallas_interpret, **knobs)
    check_against_reference(got, scenario, options, sm_scale=sm_scale(args),
                            sliding_window=knobs.get("sliding_window"), soft_cap=knobs.get("soft_cap"))


@pytest.mark.parametrize("knobs", [{}, {"sliding_window": 100, "soft_cap": 30.0, "kv_splits": 4}],
                         ids=["default", "window_cap_splits"])
def test_lowers_for_cuda(knobs):
    """Lowers to Triton custom calls (decode items and prefill tiles) without a GPU: realistic bf16 shapes."""
    args = batch("mixed", group=4, head_dim=128, dtype=jnp.bfloat16, page_size=16)
    text = lowered_text(ragged_paged_attention_gpu, args, "cuda", sm_scale=sm_scale(args), **knobs)
    calls = [line for line in text.splitlines() if "custom_call @__gpu$xla.gpu.triton" in line]
    assert len(calls) == 2, calls
    assert "ragged_paged_attention_decode" in text and "ragged_paged_attention_prefill" in text


def test_knobs_are_keyword_only_and_interpret_defaults_to_false():
    params = inspect.signature(ragged_paged_attention_gpu).parameters
    positional = [n for n, p in params.items() if p.kind == p.POSITIONAL_OR_KEYWORD]
    assert positional == ["q", "kv_cache", "block_tables", "context_lens", "query_start_loc", "num_seqs"]
    assert params["interpret"].default is False


def _with(args, **changes):
    names = ["q", "kv_cache", "block_tables", "context_lens", "query_start_loc", "num_seqs"]
    d = dict(zip(names, args))
    return {**d, **{k: f(d) for k, f in changes.items()}}


@pytest.mark.parametrize("change, knobs, message", [
    ({"q": lambda a: a["q"].astype(jnp.bfloat16)}, {}, "one dtype .* got q bfloat16 and kv_cache float32"),
    ({"q": lambda a: a["q"].astype(jnp.int32)}, {}, "q must be a float"),
    ({"kv_cache": lambda a: a["kv_cache"][:, :, :, :6]}, {}, "page size .* 6 must be a power of 2"),
    ({"q": lambda a: a["q"][..., :48], "kv_cache": lambda a: a["kv_cache"][..., :48]}, {},
     "head_dim 48 must be a power of 2"),
    ({"q": lambda a: a["q"][..., :32], "kv_cache": lambda a: a["kv_cache"][..., :32]}, {},
     "no Pallas GPU tuning for head_dim=32"),
    ({"context_lens": lambda a: a["context_lens"][:-1]}, {}, "context_lens shape"),
    ({"num_seqs": lambda a: a["num_seqs"][None]}, {}, "num_seqs"),
    ({}, {"decode_rows": 8}, "decode_rows must be a power of 2 >= 16"),
    ({}, {"kv_block": 24}, "kv_block must be a power of 2"),
    ({}, {"kv_splits": 0}, "kv_splits must be an int >= 1"),
    ({}, {"num_warps": 4}, "num_warps must be a .decode, prefill. pair"),
    ({}, {"soft_cap": -1.0}, "soft_cap must be None or a positive"),
    ({}, {"sliding_window": 0}, "sliding_window must be None or a positive int"),
])
def test_bad_inputs_raise_value_error_naming_them(change, knobs, message):
    args = _with(batch("padding"), **change)
    with pytest.raises(ValueError, match=message):
        ragged_paged_attention_gpu(**args, sm_scale=0.125, interpret=True, **knobs)
