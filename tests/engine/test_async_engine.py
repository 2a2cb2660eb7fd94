"""AsyncEngine: streaming, joining between steps, cancellation, and failure of a step."""

import asyncio

import pytest

from jaxserve import SamplingParams
from jaxserve.engine.async_engine import AsyncEngine, EngineDeadError


@pytest.fixture(scope="module")
def llm_engine(tiny_engine):
    return tiny_engine


@pytest.fixture
def engine(llm_engine):
    eng = AsyncEngine(llm_engine)
    yield eng
    eng.shutdown()


async def collect(engine, prompt, params, request_id=None):
    outs = []
    async for out in engine.generate(prompt, params, request_id):
        outs.append(out)
    return outs


def test_streams_incremental_outputs_and_requests_join_between_steps(engine):
    async def main():
        long = asyncio.create_task(collect(engine, [1, 2, 3], SamplingParams(max_tokens=40, ignore_eos=True)))
        await asyncio.sleep(0.05)
        short = await collect(engine, [4, 5], SamplingParams(max_tokens=3, ignore_eos=True))
        return await long, short
    long, short = asyncio.run(main())
    assert [len(o.outputs[0].token_ids) for o in short] == [1, 2, 3]
    assert len(long[-1].outputs[0].token_ids) == 40 and long[-1].finished
    assert not any(o.finished for o in long[:-1])
    assert len(long) == 40   # one output per step of that request


def test_bad_request_raises_before_streaming(engine):
    async def main():
        with pytest.raises(ValueError, match="maximum context length"):
            await collect(engine, [1] * 200, SamplingParams())
        return await collect(engine, [1], SamplingParams(max_tokens=2, ignore_eos=True))
    assert asyncio.run(main())[-1].finished   # the engine keeps serving


def test_cancelled_consumer_aborts_and_frees_blocks(engine, llm_engine):
    total = llm_engine.stats()["kv_total_blocks"]

    async def main():
        tasks = [asyncio.create_task(collect(engine, list(range(3, 60)), SamplingParams(max_tokens=100,
                                                                                      ignore_eos=True)))
                 for _ in range(5)]
        while llm_engine.stats()["generation_tokens"] == 0 or llm_engine.stats()["num_running"] < 5:
            await asyncio.sleep(0.01)
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for _ in range(200):
            if not llm_engine.has_unfinished_requests():
                break
            await asyncio.sleep(0.01)
    asyncio.run(main())
    assert not llm_engine.has_unfinished_requests()
    assert llm_engine.stats()["kv_free_blocks"] == total


def test_abort_by_id_ends_a_stream_still_read_with_its_abort_output(engine, llm_engine):
    async def main():
        stream = await engine.add_request([3, 4, 5], SamplingParams(max_tokens=500, ignore_eos=True), "by-id")
        first = await stream.__anext__()
        engine.abort("by-id")
        rest = [out async for out in stream]      # ends: it does not wait forever
        return first, rest
    first, rest = asyncio.run(main())
    assert not first.finished and rest[-1].finished and rest[-1].outputs[0].finish_reason == "abort"
    assert not llm_engine.has_unfinished_requests()


def test_an_id_reused_right_after_its_stream_closed_gets_only_its_own_outputs(engine, llm_engine):
    # A client cancels and retries with the same id (the gRPC API takes the client's): the old
    # request's last step and its abort output arrive after the new stream took the id.
    async def main():
        results = []
        for round_ in range(5):
            params = SamplingParams(max_tokens=12 + round_, ignore_eos=True)
            old = await engine.add_request([3, 4, 5, 6], SamplingParams(max_tokens=500, ignore_eos=True), "again")
            await old.__anext__()
            await old.aclose()                      # its abort is only queued
            new = await engine.add_request([7, 8], params, "again")
            results.append((params.max_tokens, [out async for out in new]))
        return results
    for max_tokens, outs in asyncio.run(main()):
        assert all(out.prompt_token_ids == [7, 8] for out in outs)
        assert outs[-1].finished and outs[-1].outputs[0].finish_reason == "length"
        assert len(outs[-1].outputs[0].token_ids) == max_tokens
        assert not any(out.finished for out in outs[:-1])
    assert not llm_engine.has_unfinished_requests() and engine.num_in_flight == 0
    assert not engine._live   # the engine thread let go of every id


def test_an_abort_queued_by_a_closed_stream_leaves_a_newer_request_of_that_id_alone(engine, llm_engine):
    # The old stream's abort can reach the engine after the new request under the same id was
    # added (the two streams live on different threads): it must not end the new one, and the
    # old request, which nobody reads any more, ends when the new one is added.
    async def main():
        old = await engine.add_request([3, 4, 5], SamplingParams(max_tokens=500, ignore_eos=True), "late")
        await old.__anext__()
        engine._forget(old.request_id, old.serial)     # what close() does first...
        new = await engine.add_request([7, 8], SamplingParams(max_tokens=6, ignore_eos=True), "late")
        engine.abort("late", old.serial)                # ...then its abort, queued after the new add
        return [out async for out in new]
    outs = asyncio.run(main())
    assert all(out.prompt_token_ids == [7, 8] for out in outs)
    assert outs[-1].outputs[0].finish_reason == "length" and len(outs[-1].outputs[0].token_ids) == 6
    assert not llm_engine.has_unfinished_requests() and not engine._live


def test_a_failing_step_fails_every_request_and_marks_the_engine_unhealthy(llm_engine, monkeypatch):
    engine = AsyncEngine(llm_engine)

    real_launch, calls = llm_engine.runner.launch, {"n": 0}

    def launch_then_fail(so, grammars=None, prev=None):
        calls["n"] += 1
        if calls["n"] >= 3:      # every request is in flight by the third step
            raise RuntimeError("device on fire")
        return real_launch(so, grammars, prev)

    async def main():
        monkeypatch.setattr(llm_engine.runner, "launch", launch_then_fail)
        tasks = [asyncio.create_task(collect(engine, [1, 2, 3], SamplingParams(max_tokens=50, ignore_eos=True)))
                 for _ in range(3)]
        results = await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), timeout=30)
        with pytest.raises(EngineDeadError):
            await collect(engine, [1], SamplingParams())
        return results
    results = asyncio.run(main())
    # Clients see the error's type; the error itself (with its message) is the cause, for the log.
    assert all(isinstance(r, EngineDeadError) and "RuntimeError" in str(r) and "device on fire" not in str(r)
               and "device on fire" in str(r.__cause__) for r in results)
    assert not engine.is_healthy
    monkeypatch.undo()
    llm_engine.abort_all()


def test_bad_words_are_tokenized_off_the_engine_thread(engine, llm_engine, monkeypatch):
    import threading

    from jaxserve.engine import async_engine

    threads, real = [], async_engine.bad_words_token_ids

    def recorded(words, tokenizer):
        threads.append(threading.current_thread().name)
        return real(words, tokenizer)
    monkeypatch.setattr(async_engine, "bad_words_token_ids", recorded)
    greedy = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    free = asyncio.run(collect(engine, [4, 5, 6], greedy))[-1].outputs[0].token_ids
    word = llm_engine.tokenizer.decode([free[0]]).strip()
    out = asyncio.run(collect(engine, [4, 5, 6], greedy.clone(bad_words=[word])))[-1].outputs[0].token_ids
    assert len(threads) == 1 and threads[0] != "jaxserve-engine"
    assert free[0] not in out and len(out) == 8
