"""The streaming layer on a scripted engine whose outputs are worked out by hand: n > 1
choices finishing at different steps, finish chunks once, usage counted once, deltas,
text_offset across chunks, continuous usage, and disconnects at every point."""

import asyncio
import json
import socket
import time

import httpx
import openai
import pytest

from jaxserve.engine.async_engine import AsyncEngine

from .conftest import RunningServer
from .scripted import ScriptedEngine



def script_for(words):
    """Completion i of a prompt generates 3 * (i + 1) tokens, starting at word offset len(prompt) % 5."""
    def script(prompt_ids, i):
        start = len(prompt_ids) % 5
        return words[start:start + 3 * (i + 1)]
    return script


def start(tok, words, script=None, **kw):
    engine = ScriptedEngine(tok, script or script_for(words), **kw)
    return engine, RunningServer(AsyncEngine(engine), served_model_name="scripted")


@pytest.fixture(scope="module")
def scripted(tok, words):
    engine, srv = start(tok, words, step_delay_s=0.002)
    yield engine, srv
    srv.stop()


def sse(srv, path, body):
    """The parsed data events of a stream (the last one must be [DONE])."""
    with httpx.stream("POST", f"{srv.url}{path}", json=body, timeout=30) as r:
        assert r.status_code == 200, r.read()
        lines = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]" and "[DONE]" not in lines[:-1]
    return [json.loads(x) for x in lines[:-1]]


def expected(tok, words, prompt_ids, i):
    return script_for(words)(prompt_ids, i)


def test_completions_n3_two_prompts_each_choice_finishes_once_and_usage_counts_once(scripted, tok, words):
    engine, srv = scripted
    prompts = [[5, 6, 7], [8, 9, 10, 11]]
    chunks = sse(srv, "/v1/completions", {"prompt": prompts, "n": 3, "max_tokens": 50, "stream": True,
                                          "stream_options": {"include_usage": True}})
    *body, last = chunks
    assert last["choices"] == [] and last["usage"]["prompt_tokens"] == 7
    per_choice: dict[int, list[dict]] = {}
    for c in body:
        assert "usage" not in c or c["usage"] is None
        (choice,) = c["choices"]
        per_choice.setdefault(choice["index"], []).append(choice)
    assert sorted(per_choice) == list(range(6))
    total = 0
    for p, prompt in enumerate(prompts):
        for i in range(3):
            tokens = expected(tok, words, prompt, i)
            got = per_choice[p * 3 + i]
            total += len(tokens)
            assert "".join(c["text"] for c in got) == tok.decode(tokens)
            # One chunk per generated token; the finish comes once, on the last one.
            assert len(got) == len(tokens)
            assert [c["finish_reason"] for c in got] == [None] * (len(tokens) - 1) + ["length"]
    assert last["usage"]["completion_tokens"] == total == 2 * (3 + 6 + 9)


def test_chat_n2_deltas_roles_finish_and_usage(scripted, tok, words):
    engine, srv = scripted
    client = openai.OpenAI(base_url=f"{srv.url}/v1", api_key="x")
    chunks = list(client.chat.completions.create(model="scripted", messages=[{"role": "user", "content": "hi"}],
                                                 n=2, max_tokens=50, stream=True,
                                                 stream_options={"include_usage": True}))
    prompt_tokens = chunks[-1].usage.prompt_tokens
    texts, finishes, roles = {0: "", 1: ""}, {0: [], 1: []}, []
    for c in chunks[:-1]:
        (choice,) = c.choices
        if choice.delta.role:
            roles.append(choice.index)
        texts[choice.index] += choice.delta.content or ""
        if choice.finish_reason:
            finishes[choice.index].append(choice.finish_reason)
    assert roles == [0, 1]
    prompt_ids = [0] * prompt_tokens   # the script depends only on the prompt's length
    for i in (0, 1):
        assert texts[i] == tok.decode(expected(tok, words, prompt_ids, i))
        assert finishes[i] == ["length"]
    assert chunks[-1].usage.completion_tokens == 3 + 6


def test_non_streaming_n2_matches_the_script(scripted, tok, words):
    engine, srv = scripted
    r = httpx.post(f"{srv.url}/v1/completions", json={"prompt": [5, 6, 7], "n": 2, "max_tokens": 4}, timeout=30)
    body = r.json()
    assert [c["text"] for c in body["choices"]] == [tok.decode(expected(tok, words, [5, 6, 7], 0)),
                                                    tok.decode(expected(tok, words, [5, 6, 7], 1)[:4])]
    assert [c["finish_reason"] for c in body["choices"]] == ["length", "length"]
    assert body["usage"] == {"prompt_tokens": 3, "completion_tokens": 7, "total_tokens": 10,
                             "prompt_tokens_details": {"cached_tokens": 0}}


def test_continuous_usage_counts_the_tokens_so_far_in_every_chunk(scripted):
    """vLLM's continuous usage: each chunk counts its own choice's tokens so far and its own prompt's;
    the final usage chunk the totals. Without include_usage, no chunk carries usage."""
    engine, srv = scripted
    body = {"prompt": [[5, 6, 7], [5, 6, 7, 8]], "n": 2, "max_tokens": 50, "stream": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    chunks = sse(srv, "/v1/completions", body)
    seen: dict[int, int] = {}
    for c in chunks[:-1]:
        (choice,) = c["choices"]
        seen[choice["index"]] = seen.get(choice["index"], 0) + 1      # one token per chunk
        assert c["usage"]["completion_tokens"] == seen[choice["index"]]
        assert c["usage"]["prompt_tokens"] == (3 if choice["index"] < 2 else 4)
        assert c["usage"]["total_tokens"] == c["usage"]["prompt_tokens"] + c["usage"]["completion_tokens"]
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == sum(seen.values())
    assert chunks[-1]["usage"]["prompt_tokens"] == 3 + 4       # each prompt once, as vLLM counts it
    plain = sse(srv, "/v1/completions", {**body, "stream_options": {"continuous_usage_stats": True}})
    assert all("usage" not in c or c["usage"] is None for c in plain)


def test_logprobs_text_offset_runs_across_chunks_and_echo_comes_first(scripted, tok, words):
    engine, srv = scripted
    prompt = "one two"
    chunks = sse(srv, "/v1/completions", {"prompt": prompt, "max_tokens": 5, "stream": True, "logprobs": 1})
    offsets = [o for c in chunks for o in c["choices"][0]["logprobs"]["text_offset"]]
    pieces = [t for c in chunks for t in c["choices"][0]["logprobs"]["tokens"]]
    assert offsets == [sum(len(p) for p in pieces[:k]) for k in range(len(pieces))]
    token_ids = expected(tok, words, tok.encode(prompt), 0)[:5]
    assert [lp for c in chunks for lp in c["choices"][0]["logprobs"]["token_logprobs"]] == \
        [-float(t) for t in token_ids]
    echoed = sse(srv, "/v1/completions", {"prompt": prompt, "max_tokens": 3, "stream": True, "echo": True})
    assert echoed[0]["choices"][0]["text"].startswith(prompt)
    assert sum(c["choices"][0]["text"].startswith(prompt) for c in echoed) == 1


def wait_idle(engine: AsyncEngine, timeout=10.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        stats = engine.stats()
        if stats["num_in_flight"] == 0 and stats["num_unfinished"] == 0:
            return stats
        time.sleep(0.02)
    return engine.stats()


def raw_request(port: int, body: dict, read_bytes: int = 0) -> bytes:
    """Send a request on a raw socket, read `read_bytes` (0: none, not even the headers), close."""
    data = json.dumps(body).encode()
    with socket.create_connection(("127.0.0.1", port)) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Content-Length: " + str(len(data)).encode() + b"\r\n\r\n" + data)
        got = b""
        while len(got) < read_bytes:
            more = s.recv(read_bytes - len(got))
            if not more:
                break
            got += more
        s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")  # RST on close
    return got


def test_clients_that_leave_at_any_point_leave_nothing_behind(tok, words):
    engine, srv = start(tok, words, lambda prompt, i: (words * 10)[:100], step_delay_s=0.01)  # ~1 s a request
    try:
        long = {"prompt": [5, 6, 7], "n": 2, "max_tokens": 100}
        # Before the headers: the client is gone before the server could answer.
        for _ in range(5):
            raw_request(srv.port, {**long, "stream": True})
            raw_request(srv.port, long)
        # Mid-stream: two chunks read, then the connection closes.
        for _ in range(5):
            got = raw_request(srv.port, {**long, "stream": True}, read_bytes=400)
            assert b"data: " in got
        # Non-streaming: the client gives up while the server waits for the result.
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(f"{srv.url}/v1/completions", json=long, timeout=0.3)
        stats = wait_idle(srv.engine, timeout=0.5)     # aborted at once, not run to their end (1 s)
        assert stats["num_in_flight"] == 0 and stats["num_unfinished"] == 0 and stats["num_running"] == 0
        assert sorted(engine.aborted) == sorted(engine.added)
        # The queue limit is not eaten by the requests of clients that left.
        r = httpx.post(f"{srv.url}/v1/completions", json={"prompt": [1], "max_tokens": 2}, timeout=30)
        assert r.status_code == 200
    finally:
        srv.stop()


def test_a_failing_step_ends_streams_with_an_error_event_and_done(tok, words):
    engine, srv = start(tok, words, step_delay_s=0.01, fail_at_step=3)
    dead = []
    srv.engine._on_dead = dead.append
    try:
        chunks = sse(srv, "/v1/completions", {"prompt": [5, 6, 7], "max_tokens": 20, "stream": True})
        assert chunks[-1]["error"]["code"] == 503
        assert "RuntimeError" in chunks[-1]["error"]["message"] and "injected" not in chunks[-1]["error"]["message"]
        assert len(dead) == 1
        assert httpx.get(f"{srv.url}/health").status_code == 503
        r = httpx.post(f"{srv.url}/v1/completions", json={"prompt": [1], "max_tokens": 2})
        assert r.status_code == 503
    finally:
        srv.stop()


def test_an_unexpected_error_is_a_500_with_a_request_id_and_no_details(tok, words, caplog):
    engine, srv = start(tok, words)

    def broken(*args, **kwargs):
        raise KeyError("secret internals")
    engine.add_request = broken
    try:
        for stream in (False, True):
            r = httpx.post(f"{srv.url}/v1/completions", json={"prompt": [1], "max_tokens": 2, "stream": stream},
                           headers={"X-Request-Id": f"abc-{stream}"})
            assert r.status_code == 500
            msg = r.json()["error"]["message"]
            assert msg == f"internal error (request id abc-{stream})" and r.headers["x-request-id"] == f"abc-{stream}"
        assert "secret internals" in caplog.text     # the details are in the log
        assert srv.engine.stats()["num_in_flight"] == 0
    finally:
        srv.stop()


def test_a_non_streaming_request_gets_a_503_when_the_engine_dies(tok, words):
    engine, srv = start(tok, words, step_delay_s=0.01, fail_at_step=3)
    try:
        r = httpx.post(f"{srv.url}/v1/completions", json={"prompt": [5, 6, 7], "max_tokens": 20}, timeout=30)
        assert r.status_code == 503 and "RuntimeError" in r.json()["error"]["message"]
        assert r.headers["x-request-id"]
    finally:
        srv.stop()


def test_step_timeout_does_not_count_compiles(tok, words):
    engine = ScriptedEngine(tok, script_for(words))
    clock = {"compiling": False, "end": 0.0}
    engine.compile_clock = lambda: (clock["compiling"], clock["end"])
    real_step = engine.step

    def step_that_compiles():
        if engine.num_steps == 1:          # the second step compiles for 1.2 s, then runs 0.3 s
            clock["compiling"] = True
            time.sleep(1.2)
            clock["compiling"], clock["end"] = False, time.monotonic()
            time.sleep(0.3)
        return real_step()
    engine.step = step_that_compiles
    async_engine = AsyncEngine(engine, step_timeout_s=0.6)
    srv = RunningServer(async_engine, served_model_name="scripted")
    try:
        chunks = sse(srv, "/v1/completions", {"prompt": [5, 6, 7], "max_tokens": 3, "stream": True})
        assert chunks[-1]["choices"][0]["finish_reason"] == "length" and async_engine.is_healthy
    finally:
        srv.stop()


def test_step_timeout_makes_health_503_and_fails_the_request(tok, words):
    engine = ScriptedEngine(tok, script_for(words), step_delay_s=0.01)
    async_engine = AsyncEngine(engine, step_timeout_s=0.5)
    srv = RunningServer(async_engine, served_model_name="scripted")
    real_step = engine.step

    def hang():
        if engine.num_steps >= 2:
            time.sleep(3)
        return real_step()
    engine.step = hang
    try:
        t0 = time.monotonic()
        chunks = sse(srv, "/v1/completions", {"prompt": [5, 6, 7], "max_tokens": 20, "stream": True})
        assert time.monotonic() - t0 < 2.5            # failed by the watchdog, not by the step ending
        assert chunks[-1]["error"]["code"] == 503 and "no progress" in chunks[-1]["error"]["message"]
        assert httpx.get(f"{srv.url}/health").status_code == 503
    finally:
        srv.stop()
        asyncio.run(asyncio.sleep(3))   # let the hung step end before the engine is dropped


def test_finals_stops_waiting_on_the_other_prompts_when_one_fails():
    """A request of several prompts whose first fails: the others' waits end with it (they were left
    suspended until garbage collection)."""
    from server.streaming import finals

    class Metrics:
        def observe(self, _):
            pass

    left = []

    async def failing():
        raise ValueError("the first prompt failed")
        yield   # an async generator

    async def waiting():
        try:
            await asyncio.Event().wait()
            yield
        finally:
            left.append("closed")

    async def main():
        with pytest.raises(ValueError, match="the first prompt failed"):
            await finals([failing(), waiting(), waiting()], Metrics())
        return [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]

    assert asyncio.run(main()) == [] and left == ["closed", "closed"]
