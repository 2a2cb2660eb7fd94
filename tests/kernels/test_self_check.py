"""The start-up attention self-check (kernels_pallas.self_check) and what the engine does with it.

The check passes for every backend that computes the reference's answer (the Pallas ones
in interpret mode here); a deliberately broken kernel, injected by replacing the Pallas
GPU kernel function the dispatcher calls, makes "auto" fall back to the reference with a
warning and an explicit backend fail start-up with a ValueError naming the case, both
through `resolve_attention_backend` (a GPU machine described on this CPU) and through a
whole engine build. Its cost is reported, not asserted (see the self_check module).
"""

from __future__ import annotations

import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import kernels_pallas.dispatch as dispatch
import kernels_pallas.ragged_paged_attention_gpu as gpu_kernel
from jaxserve.cli import build_parser, engine_config
from jaxserve.config import EngineConfig
from jaxserve.engine import builder
from kernels_pallas.oracle import attention_oracle, make_batch
from kernels_pallas.ragged_paged_attention import ragged_paged_attention_reference
from kernels_pallas.self_check import KernelSelfCheckError, cases, self_check
from tests.kernels.test_ragged_paged_attention import EXTRA, SCENARIOS, SM_SCALE, naive_attention


@pytest.mark.parametrize("name", [*SCENARIOS, *EXTRA])
def test_oracle_matches_the_naive_oracle(name):
    """The check's vectorised float64 oracle equals the tests' position-by-position one (masks and GQA too)."""
    case = dict(EXTRA.get(name, {"seqs": SCENARIOS.get(name)}))
    masking = dict(sliding_window=case.pop("sliding_window", None), soft_cap=case.pop("soft_cap", None))
    q_scale = case.pop("q_scale", 1.0)
    args = make_batch(case.pop("seqs"), **case)
    args = (args[0] * np.float32(q_scale), *args[1:])
    np.testing.assert_allclose(attention_oracle(*args, sm_scale=SM_SCALE, **masking),
                               naive_attention(*args, sm_scale=SM_SCALE, **masking), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("page_size", [8, 16, 32])
def test_cases_sit_on_page_boundaries(page_size):
    """Decodes end just before, at and just after a page end; a chunk starts and ends on page boundaries."""
    named = cases(page_size)
    assert list(named) == ["decode", "prefill", "mixed", "page_boundary"]
    decode_ends = {ctx % page_size for ctx, _ in named["decode"]}
    assert {page_size - 1, 0, 1} <= decode_ends
    assert any(q > 1 and ctx % page_size == 0 and (ctx - q) % page_size == 0 for ctx, q in named["page_boundary"])
    assert any(q == ctx > page_size for ctx, q in named["prefill"])                 # a prompt over a page
    assert any(1 < q < ctx for ctx, q in named["mixed"]) and any(q == 1 for _, q in named["mixed"])


def _counting(monkeypatch, module, name):
    """Replace module.name by a pass-through that counts its calls."""
    calls = []
    real = getattr(module, name)

    def counted(*args, **kwargs):
        calls.append(kwargs.get("interpret"))
        return real(*args, **kwargs)

    monkeypatch.setattr(module, name, counted)
    return calls


@pytest.mark.parametrize("backend, dtype", [
    ("cpu", "float32"),
    ("cpu", "bfloat16"),      # the pool as uint16 bits, as the engine stores it for this backend
    ("pallas_gpu", "float32"),
    ("pallas_gpu", "bfloat16"),
    ("pallas_tpu", "float32"),
])
def test_passes_for_backends_that_compute_the_reference(backend, dtype, monkeypatch, caplog):
    import kernels_pallas.ragged_paged_attention_tpu as tpu_kernel
    module, name = {"cpu": (dispatch, "ragged_paged_attention_cpu"),
                    "pallas_gpu": (gpu_kernel, "ragged_paged_attention_gpu"),
                    "pallas_tpu": (tpu_kernel, "ragged_paged_attention_tpu")}[backend]
    calls = _counting(monkeypatch, module, name)
    with caplog.at_level(logging.INFO, logger="kernels_pallas.self_check"):
        self_check(backend, dtype=dtype, page_size=16)
    # One call per case; a Pallas kernel interpreted unless the device is its own (not on CPU machines).
    platform = {"cpu": None, "pallas_gpu": "gpu", "pallas_tpu": "tpu"}[backend]
    assert calls == [None if platform is None else jax.devices()[0].platform != platform] * 4
    assert f"attention self-check: {backend} passed 4 cases ({dtype}, page 16)" in caplog.text


def test_reference_needs_no_check(monkeypatch):
    calls = _counting(monkeypatch, dispatch, "ragged_paged_attention_reference")
    self_check("reference", dtype="float32")
    assert calls == []


# ---- broken kernels -------------------------------------------------------------------------------


def _wrong_prefills(q, kv_cache, block_tables, context_lens, query_start_loc, num_seqs, *, sm_scale,
                    sliding_window=None, soft_cap=None, interpret=False, **knobs):
    """A GPU "kernel" that is right for decodes but 1.5x off on every row of a multi-token sequence."""
    out = ragged_paged_attention_reference(q, kv_cache, block_tables, context_lens, query_start_loc, num_seqs,
                                           sm_scale=sm_scale, sliding_window=sliding_window, soft_cap=soft_cap)
    q_lens = query_start_loc[1:] - query_start_loc[:-1]
    owner = jnp.searchsorted(query_start_loc[1:], jnp.arange(q.shape[0]), side="right")
    multi = (owner < num_seqs) & (q_lens[jnp.minimum(owner, q_lens.shape[0] - 1)] > 1)
    return jnp.where(multi[:, None, None], out * 1.5, out).astype(out.dtype)


def _garbage_padding(q, kv_cache, block_tables, context_lens, query_start_loc, num_seqs, *, sm_scale,
                     sliding_window=None, soft_cap=None, interpret=False, **knobs):
    """Right on every real row, but padding rows hold q instead of 0."""
    out = ragged_paged_attention_reference(q, kv_cache, block_tables, context_lens, query_start_loc, num_seqs,
                                           sm_scale=sm_scale, sliding_window=sliding_window, soft_cap=soft_cap)
    real = jnp.arange(q.shape[0]) < query_start_loc[num_seqs]
    return jnp.where(real[:, None, None], out, q)


def _fails_to_compile(*args, **kwargs):
    raise RuntimeError("Triton: out of shared memory (simulated)")


BROKEN = {   # name -> (kernel, the case it fails, what the error says)
    "wrong_prefills": (_wrong_prefills, "prefill",
                       r"\d+ of \d+ outputs differ from the float64 oracle .* worst at token row \d+, head"),
    "garbage_padding": (_garbage_padding, "decode", r".* worst at token row \d+ \(a padding row, must be 0\)"),
    "fails_to_compile": (_fails_to_compile, "decode", r"RuntimeError: Triton: out of shared memory \(simulated\)"),
}
BROKEN_CASES = [pytest.param(*kernel, id=name) for name, kernel in BROKEN.items()]


@pytest.mark.parametrize("kernel, case, message", BROKEN_CASES)
def test_a_broken_kernel_fails_naming_the_case(kernel, case, message, monkeypatch):
    monkeypatch.setattr(gpu_kernel, "ragged_paged_attention_gpu", kernel)
    with pytest.raises(KernelSelfCheckError, match=f"'pallas_gpu' failed self-check case '{case}': {message}") as e:
        self_check("pallas_gpu", dtype="float32")
    assert e.value.case == case


@pytest.mark.parametrize("kernel, case, message", BROKEN_CASES)
def test_auto_falls_back_to_the_reference(kernel, case, message, monkeypatch, caplog):
    monkeypatch.setattr(gpu_kernel, "ragged_paged_attention_gpu", kernel)
    config = EngineConfig(attention_backend="auto", dtype="float32")
    with caplog.at_level(logging.WARNING, logger="jaxserve.engine.builder"):
        assert builder.resolve_attention_backend(config, "gpu") == "reference"
    [warning] = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert f"'pallas_gpu' failed self-check case '{case}'" in warning.getMessage()
    assert "falls back to 'reference'" in warning.getMessage()


@pytest.mark.parametrize("kernel, case, message", BROKEN_CASES)
def test_an_explicit_backend_refuses_to_start(kernel, case, message, monkeypatch):
    monkeypatch.setattr(gpu_kernel, "ragged_paged_attention_gpu", kernel)
    config = EngineConfig(attention_backend="pallas_gpu", dtype="float32")
    with pytest.raises(ValueError, match=f"attention_backend='pallas_gpu' failed its start-up self-check, "
                                         f"case '{case}': {message}.*--no-attention-self-check"):
        builder.resolve_attention_backend(config, "gpu")


def test_the_check_can_be_skipped(monkeypatch):
    monkeypatch.setattr(gpu_kernel, "ragged_paged_attention_gpu", _fails_to_compile)
    config = EngineConfig(attention_backend="pallas_gpu", attention_self_check=False)
    assert builder.resolve_attention_backend(config, "gpu") == "pallas_gpu"
    args = build_parser().parse_args(["serve", "--attention-backend", "pallas_gpu", "--no-attention-self-check"])
    assert engine_config(args).attention_self_check is False
    assert engine_config(build_parser().parse_args(["serve"])).attention_self_check is True


# ---- through a whole engine build -----------------------------------------------------------------

SMALL_ENGINE = dict(max_num_batched_tokens=16, max_num_seqs=4, num_kv_blocks=16, max_model_len=64,
                    token_buckets=(16,), dtype="float32")


@pytest.fixture
def gpu_machine_with_a_broken_kernel(monkeypatch):
    """This CPU described as a GPU machine to the engine's backend resolution, with a wrong Pallas GPU kernel."""
    monkeypatch.setattr(builder, "backend_for_platform",
                        lambda requested, platform: dispatch.resolve_attention_backend(requested, "gpu"))
    monkeypatch.setattr(gpu_kernel, "ragged_paged_attention_gpu", _wrong_prefills)


def test_engine_auto_serves_with_the_reference(gpu_machine_with_a_broken_kernel, tiny_models, caplog):
    from jaxserve import LLM, SamplingParams

    with caplog.at_level(logging.WARNING, logger="jaxserve.engine.builder"):
        llm = LLM(model=str(tiny_models["llama"]), **SMALL_ENGINE)
    assert "'pallas_gpu' failed self-check case 'prefill'" in caplog.text
    assert llm.engine.model_config.attention_backend == "reference"
    [out] = llm.generate([[1, 2, 3, 4]], SamplingParams(max_tokens=3, temperature=0.0))
    assert len(out.outputs[0].token_ids) == 3


def test_engine_with_an_explicit_backend_fails_start_up(gpu_machine_with_a_broken_kernel, tiny_models):
    from jaxserve.engine.llm_engine import LLMEngine

    with pytest.raises(ValueError, match="'pallas_gpu' failed its start-up self-check, case 'prefill': "):
        LLMEngine.from_kwargs(str(tiny_models["llama"]), attention_backend="pallas_gpu", **SMALL_ENGINE)
