"""A request whose output processing raises fails alone: the engine, its other requests (their
tokens unchanged) and later ones carry on, and the failed request's blocks are freed."""

import asyncio

import pytest

from jaxserve import SamplingParams
from jaxserve.core import StructuredOutputsParams
from jaxserve.core import EngineCoreOutput, Logprobs
from jaxserve.engine.async_engine import AsyncEngine, RequestFailedError
from jaxserve.engine.output_processor import OutputProcessor
from tests.faults import GRAMMAR_MARKER, MARKER, fail_marked_grammars, fail_marked_requests

from .test_output_processor import tok  # noqa: F401 - the tiny model's tokenizer fixture

PARAMS = SamplingParams(max_tokens=12, ignore_eos=True, temperature=0.0)


def test_processor_fails_the_request_alone_and_returns_all_its_core_ids(tok, monkeypatch):  # noqa: F811
    fail_marked_requests(monkeypatch, after=2)
    proc = OutputProcessor(tok)
    proc.add("bad", None, [5] + MARKER, SamplingParams(n=2, max_tokens=9), ["0_bad", "1_bad"], 0.0)
    proc.add("good", None, [5, 6], SamplingParams(max_tokens=9), ["0_good"], 0.0)
    step = [EngineCoreOutput("0_bad", [70], []), EngineCoreOutput("1_bad", [71], []),
            EngineCoreOutput("0_good", [72], [])]
    outs, stopped, failed = proc.process(step, 1.0)
    assert failed == [] and stopped == [] and len(outs) == 2
    outs, stopped, failed = proc.process(step, 2.0)
    assert sorted(failed) == ["0_bad", "1_bad"] and stopped == []
    (bad,) = [o for o in outs if o.request_id == "bad"]
    (good,) = [o for o in outs if o.request_id == "good"]
    assert bad.finished and "InjectedFault" in bad.error and "injected fault" not in bad.error
    assert [c.finish_reason for c in bad.outputs] == ["error", "error"]
    assert [c.token_ids for c in bad.outputs] == [[70, 70], [71]]   # every token it was given
    assert good.error is None and good.outputs[0].token_ids == [72, 72]
    assert "bad" not in proc and "good" in proc
    # Later diffs of the failed request (a step already in flight) are ignored.
    outs, _, failed = proc.process([EngineCoreOutput("0_bad", [73], [], finish_reason="length")], 3.0)
    assert outs == [] and failed == []


def test_a_delta_request_fails_with_only_what_was_not_yet_handed_out(tok, monkeypatch):  # noqa: F811
    from jaxserve import RequestOutputKind
    fail_marked_requests(monkeypatch, after=3)
    proc = OutputProcessor(tok)
    proc.add("bad", None, [5] + MARKER, SamplingParams(n=2, max_tokens=9, logprobs=1,
                                                       output_kind=RequestOutputKind.DELTA), ["0_bad", "1_bad"], 0.0)
    lp = Logprobs(-0.5, [3], [-0.25])
    step = [EngineCoreOutput("0_bad", [70], [lp]), EngineCoreOutput("1_bad", [71], [lp], finish_reason="length")]
    (first,), _, _ = proc.process(step, 1.0)
    assert [c.token_ids for c in first.outputs] == [[70], [71]]
    (second,), _, _ = proc.process(step[:1], 2.0)
    (bad,), _, failed = proc.process(step[:1], 3.0)
    assert failed == ["0_bad", "1_bad"] and bad.error is not None
    # Sibling 1 had finished and was reported: not again. Sibling 0: the tokens after the last output.
    assert [(c.index, c.token_ids, c.finish_reason) for c in bad.outputs] == [(0, [70], "error")]
    assert len(bad.outputs[0].logprobs) == 1 and bad.outputs[0].cumulative_logprob == -1.5
    assert bad.outputs[0].text == ""    # the failed token's text was never decoded


def test_engine_fails_only_the_request_and_frees_its_blocks(tiny_engine, monkeypatch):
    engine = tiny_engine
    prompts = [[3, 4, 5, 6], [9] * 20 + MARKER, [8, 7, 6, 5, 4, 3]]
    alone = {}
    for i in (0, 2):
        engine.add_request(f"alone-{i}", prompts[i], PARAMS)
        while engine.has_unfinished_requests():
            for out in engine.step():
                alone[i] = out
    free = engine.stats()["kv_free_blocks"]
    fail_marked_requests(monkeypatch, after=3)
    finals = {}
    for i, prompt in enumerate(prompts):
        engine.add_request(f"r-{i}", prompt, PARAMS)
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finals[out.request_id] = out
    bad = finals["r-1"]
    assert "InjectedFault" in bad.error and bad.outputs[0].finish_reason == "error"
    assert len(bad.outputs[0].token_ids) == 3      # the third token's processing raised
    for i in (0, 2):
        assert finals[f"r-{i}"].error is None
        assert finals[f"r-{i}"].outputs[0].token_ids == alone[i].outputs[0].token_ids
    assert engine.stats()["kv_free_blocks"] == free   # nothing held by the failed request
    assert engine.stats()["num_running"] == 0 and engine.stats()["num_waiting"] == 0
    # The engine keeps serving, the marked prompt included once the fault is gone.
    monkeypatch.undo()
    engine.add_request("after", prompts[1], PARAMS)
    while engine.has_unfinished_requests():
        for out in engine.step():
            last = out
    assert last.error is None and len(last.outputs[0].token_ids) == 12


def test_async_engine_ends_the_stream_with_the_error_and_stays_healthy(tiny_engine, monkeypatch):
    fail_marked_requests(monkeypatch, after=4)
    engine = AsyncEngine(tiny_engine)

    async def collect(prompt, params):
        return [out async for out in engine.generate(prompt, params)]

    async def main():
        results = await asyncio.gather(collect([9] * 10 + MARKER, SamplingParams(n=3, max_tokens=30, ignore_eos=True)),
                                       collect([3, 4, 5], SamplingParams(max_tokens=30, ignore_eos=True)),
                                       return_exceptions=True)
        later = await collect([4, 5], SamplingParams(max_tokens=3, ignore_eos=True))
        return results, later, engine.is_healthy
    try:
        (bad, good), later, healthy = asyncio.run(main())
    finally:
        engine.shutdown()
    assert isinstance(bad, RequestFailedError) and "InjectedFault" in str(bad)
    assert good[-1].finished and len(good[-1].outputs[0].token_ids) == 30
    assert later[-1].finished and healthy
    assert not tiny_engine.has_unfinished_requests()


def test_a_failure_building_the_output_is_isolated_too(tok, monkeypatch):  # noqa: F811
    proc = OutputProcessor(tok)
    proc.add("bad", None, [5, 6], SamplingParams(max_tokens=9), ["0_bad"], 0.0)
    proc.add("good", None, [5, 6], SamplingParams(max_tokens=9), ["0_good"], 0.0)
    real = OutputProcessor._output

    def output(self, state):
        if state.request_id == "bad":
            raise KeyError("boom")
        return real(self, state)
    monkeypatch.setattr(OutputProcessor, "_output", output)
    outs, _, failed = proc.process([EngineCoreOutput("0_bad", [70], []), EngineCoreOutput("0_good", [71], [])], 1.0)
    assert failed == ["0_bad"]
    assert {o.request_id: o.error is None for o in outs} == {"bad": False, "good": True}


@pytest.mark.parametrize("where", ["fill", "consume", "stopped"])
def test_a_grammar_that_raises_fails_its_request_alone(tiny_engine, monkeypatch, where):
    """A matcher raising while the step's bitmask is filled (its unconstrained token is dropped), while
    it takes a token or says whether it stopped (that token, which the mask allowed, is kept) ends its
    request with an error; a constrained and a free request beside it get their tokens, and the
    engine goes on."""
    engine = tiny_engine
    regex = StructuredOutputsParams(regex="[a-z ]{8,40}")
    kinds = {"marked": SamplingParams(max_tokens=12, temperature=0.0, n=2, structured_outputs=StructuredOutputsParams(
                 regex=f"({GRAMMAR_MARKER})?[a-z ]{{8,40}}")),
             "constrained": SamplingParams(max_tokens=12, temperature=0.0, structured_outputs=regex),
             "free": PARAMS}
    alone = {}
    for name in ("constrained", "free"):
        engine.add_request(f"alone-{name}", [3, 4, 5, 6], kinds[name])
        while engine.has_unfinished_requests():
            for out in engine.step():
                alone[name] = out
    free = engine.stats()["kv_free_blocks"]
    fail_marked_grammars(monkeypatch, where, after=3)
    finals = {}
    for name, params in kinds.items():
        engine.add_request(name, [3, 4, 5, 6], params)
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finals[out.request_id] = out
    bad = finals["marked"]
    assert "InjectedFault" in bad.error and "structured output" in bad.error
    assert [c.finish_reason for c in bad.outputs] == ["error", "error"]
    # Both siblings' matchers raise in one step: filling the fourth token's row (its token dropped),
    # taking the fourth token or asking after the third (the token kept). The first sibling processed
    # ends the request, and the other's token of that step is not handed out.
    assert sorted(len(c.token_ids) for c in bad.outputs) == {"fill": [3, 3], "consume": [3, 4],
                                                              "stopped": [2, 3]}[where]
    for name in ("constrained", "free"):
        assert finals[name].error is None
        assert finals[name].outputs[0].token_ids == alone[name].outputs[0].token_ids
    assert engine.stats()["kv_free_blocks"] == free
    assert engine.stats()["num_running"] == 0 and engine.stats()["num_waiting"] == 0
    engine.add_request("after", [3, 4, 5, 6], kinds["marked"].clone(n=1))
    while engine.has_unfinished_requests():
        for out in engine.step():
            last = out
    assert last.error is not None and engine.stats()["kv_free_blocks"] == free   # the fault is still injected
    monkeypatch.undo()
    engine.add_request("later", [3, 4, 5, 6], kinds["marked"].clone(n=1))
    while engine.has_unfinished_requests():
        for out in engine.step():
            last = out
    assert last.error is None and last.outputs[0].finish_reason in ("stop", "length")
