"""The Pallas TPU (Mosaic) ragged paged attention kernel on CPU: TPU interpret mode vs the
reference, input checks, and cross-lowering for TPU.

TPU interpret mode (`pltpu.InterpretParams`) simulates the kernel's DMAs, semaphores and
VMEM scratch (uninitialised memory reads as NaN, so a wait on the wrong buffer shows up).
It does not run Mosaic's compiler (vector layouts, tiling), which needs a TPU; the
cross-lowering test checks the lowering to Mosaic MLIR. The TPU interpreter is slow
(~1.5 s per call here), so the GQA sweeps, which exercise code shared with the GPU
kernel (work_items) and are swept there, are marked slow. On a TPU, `--pallas-on-device` runs
the reference comparisons with the kernel compiled for it (tests/kernels/conftest.py).
"""

from __future__ import annotations

import inspect

import jax.numpy as jnp
import pytest

from kernels_pallas.ragged_paged_attention_tpu import ragged_paged_attention_tpu
from tests.kernels.pallas_cases import (BF16, GQA_1, GQA_3, GQA_8_HEAD_DIM_128, LARGE_LOGITS, SCENARIOS,
                                        WINDOW_SOFT_CAP, batch, check_against_reference, lowered_text,
                                        run_compiled)

# float32 tiles: 8-row decode items, 32-row prefill tiles (16 tokens), 32-key KV blocks
# (4 pages of 8), so prefills span several tiles and contexts several DMA'd blocks (both
# buffers in use).
SMALL = dict(decode_rows=8, prefill_rows=32, kv_block=32)

# name -> (batch options, kernel knobs, scenarios, marks)
CONFIGS = {
    # every scenario but "padding" (all of them pad; the GPU tests run it on its own)
    "base": ({}, SMALL, [s for s in SCENARIOS if s != "padding"], []),
    # bf16 with the tuning table's block sizes (16-row pages)
    "bf16_head_dim_128": (BF16, {}, ["mixed"], []),
    "window_soft_cap": (LARGE_LOGITS, {**SMALL, **WINDOW_SOFT_CAP}, ["mixed"], []),
    "gqa_1": (GQA_1, SMALL, ["mixed"], [pytest.mark.slow]),
    "gqa_3": (GQA_3, SMALL, ["mixed"], [pytest.mark.slow]),
    "gqa_8_head_dim_128": (GQA_8_HEAD_DIM_128, SMALL, ["mixed"], [pytest.mark.slow]),
}
DEVICE_PLATFORM = "tpu"   # under --pallas-on-device, test_matches_reference runs the kernel compiled for it
CASES = [pytest.param(name, scenario, id=f"{name}-{scenario}", marks=marks)
         for name, (_, _, scenarios, marks) in CONFIGS.items() for scenario in scenarios]


def sm_scale(args) -> float:
    return args[0].shape[-1] ** -0.5


@pytest.mark.parametrize("config, scenario", CASES)
def test_matches_reference(config, scenario, pallas_interpret):
    options, knobs, _, _ = CONFIGS[config]
    args = batch(scenario, **options)
    got = run_compiled(ragged_paged_attention_tpu, args, sm_scale=sm_scale(args), interpret=pallas_interpret, **knobs)
    check_against_reference(got, scenario, options, sm_scale=sm_scale(args),
                            sliding_window=knobs.get("sliding_window"), soft_cap=knobs.get("soft_cap"))


@pytest.mark.parametrize("knobs", [{}, {"sliding_window": 100, "soft_cap": 30.0}], ids=["default", "window_cap"])
def test_lowers_for_tpu(knobs):
    """Lowers to Mosaic custom calls (decode items and prefill tiles) without a TPU: realistic bf16 shapes."""
    args = batch("mixed", group=4, head_dim=128, dtype=jnp.bfloat16, page_size=16)
    text = lowered_text(ragged_paged_attention_tpu, args, "tpu", sm_scale=sm_scale(args), **knobs)
    calls = [line for line in text.splitlines() if "custom_call @tpu_custom_call" in line]
    assert len(calls) == 2, calls
    assert "ragged_paged_attention_decode" in text and "ragged_paged_attention_prefill" in text


def test_knobs_are_keyword_only_and_interpret_defaults_to_false():
    params = inspect.signature(ragged_paged_attention_tpu).parameters
    positional = [n for n, p in params.items() if p.kind == p.POSITIONAL_OR_KEYWORD]
    assert positional == ["q", "kv_cache", "block_tables", "context_lens", "query_start_loc", "num_seqs"]
    assert params["interpret"].default is False


def _with(args, **changes):
    names = ["q", "kv_cache", "block_tables", "context_lens", "query_start_loc", "num_seqs"]
    d = dict(zip(names, args))
    return {**d, **{k: f(d) for k, f in changes.items()}}


@pytest.mark.parametrize("change, knobs, message", [
    ({"q": lambda a: a["q"].astype(jnp.bfloat16)}, {}, "one dtype .* got q bfloat16 and kv_cache float32"),
    ({"kv_cache": lambda a: a["kv_cache"][:, :, :, :4]}, {}, "page size .* 4 must be a multiple of 8"),
    ({"q": lambda a: a["q"].astype(jnp.bfloat16), "kv_cache": lambda a: a["kv_cache"].astype(jnp.bfloat16)}, {},
     "page size .* 8 must be a multiple of 16 .*bfloat16"),
    ({"q": lambda a: a["q"][..., :32], "kv_cache": lambda a: a["kv_cache"][..., :32]}, {},
     "no Pallas TPU tuning for head_dim=32"),
    ({"block_tables": lambda a: a["block_tables"].astype(jnp.int16)}, {}, "block_tables must be an int32"),
    ({}, {"decode_rows": 12}, "decode_rows must be a multiple of 8"),
    ({}, {"kv_block": 0}, "kv_block must be a multiple of 8"),
    ({}, {"soft_cap": 0.0}, "soft_cap must be None or a positive"),
])
def test_bad_inputs_raise_value_error_naming_them(change, knobs, message):
    args = _with(batch("padding"), **change)
    with pytest.raises(ValueError, match=message):
        ragged_paged_attention_tpu(**args, sm_scale=0.125, interpret=True, **knobs)
