"""Raw HTTP: every error case, tokenize/detokenize, health, metrics, and client disconnects."""

import asyncio
import json

import httpx
import pytest

from jaxserve.engine.async_engine import AsyncEngine

from tests.faults import GRAMMAR_MARKER, MARKER, fail_marked_grammars, fail_marked_requests

from .conftest import RunningServer, metric


def post(server, path, body, **kw):
    return httpx.post(f"{server.url}{path}", json=body, timeout=60, **kw)


def assert_error(r, status, param=None, contains=""):
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) >= {"message", "type", "param", "code"} and err["code"] == status
    if param is not None:
        assert err["param"] == param, err
    assert contains in err["message"], err["message"]


@pytest.mark.parametrize("body,param", [
    ({"prompt": "x", "temperature": -1}, "temperature"),
    ({"prompt": "x", "top_p": 2}, "top_p"),
    ({"prompt": "x", "max_tokens": -5}, "max_tokens"),
    ({"prompt": "x", "n": 0}, "n"),
    ({"prompt": "x", "logprobs": 99}, None),
    ({"prompt": "x", "no_such_field": 1}, "no_such_field"),
    ({"prompt": 5}, "prompt"),
    ({}, "prompt"),
])
def test_invalid_completion_parameters_are_400_naming_the_parameter(server, body, param):
    assert_error(post(server, "/v1/completions", body), 400, param)


def test_chat_errors(server):
    assert_error(post(server, "/v1/chat/completions", {"messages": []}), 400, "messages")
    assert_error(post(server, "/v1/chat/completions", {"messages": [{"content": "no role"}]}), 400)
    assert_error(post(server, "/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                                                        "top_logprobs": 2}), 400, "top_logprobs")


def test_prompt_longer_than_the_context_gives_both_numbers(server):
    r = post(server, "/v1/completions", {"prompt": [1] * 200, "max_tokens": 5})
    assert_error(r, 400, contains="128")
    assert "200" in r.json()["error"]["message"]
    r = post(server, "/v1/completions", {"prompt": [1] * 100, "max_tokens": 50})
    assert_error(r, 400, "max_tokens", "150 tokens (100 in the prompt, 50 in the completion)")


def test_unknown_model_is_404_and_invalid_json_is_400(server):
    assert_error(post(server, "/v1/completions", {"prompt": "x", "model": "gpt-4"}), 404, "model")
    r = httpx.post(f"{server.url}/v1/completions", content=b"{nope", headers={"content-type": "application/json"})
    assert_error(r, 400)


def test_oversized_body_is_413(server):
    assert_error(post(server, "/v1/completions", {"prompt": "x" * 100_000}), 413)


def test_tokenize_detokenize_roundtrip(server):
    r = post(server, "/tokenize", {"prompt": "hello there"})
    assert r.status_code == 200 and r.json()["count"] == len(r.json()["tokens"])
    d = post(server, "/detokenize", {"tokens": r.json()["tokens"]})
    assert d.json()["prompt"] == "hello there"
    assert_error(post(server, "/detokenize", {"tokens": [10**9]}), 400, "tokens")
    chat = post(server, "/tokenize", {"messages": [{"role": "user", "content": "hi"}]})
    assert chat.status_code == 200 and chat.json()["count"] > 2


def test_health_and_metrics(server):
    assert httpx.get(f"{server.url}/health").status_code == 200
    text = httpx.get(f"{server.url}/metrics").text
    for name in ("jaxserve:num_requests_running", "jaxserve:num_requests_waiting", "jaxserve:kv_cache_usage_perc",
                 "jaxserve:prefix_cache_queries_total", "jaxserve:prefix_cache_hits_total",
                 "jaxserve:num_preemptions_total", "jaxserve:compiles_after_warmup",
                 "jaxserve:prompt_tokens_total", "jaxserve:generation_tokens_total",
                 "jaxserve:time_to_first_token_seconds_bucket", "jaxserve:inter_token_latency_seconds_bucket",
                 "jaxserve:e2e_request_latency_seconds_bucket", "jaxserve:request_queue_time_seconds_bucket"):
        assert name in text, name
    assert metric(server.url, "jaxserve:compiles_after_warmup") == 0


def test_fifty_streams_cut_mid_generation_leave_the_pool_as_full_as_before(server):
    free_before = metric(server.url, "jaxserve:kv_cache_free_blocks")

    async def cut_one(client, i):
        body = {"prompt": [3 + i, 4, 5, 6] * 10, "max_tokens": 80, "stream": True, "ignore_eos": True}
        async with client.stream("POST", f"{server.url}/v1/completions", json=body) as r:
            n = 0
            async for line in r.aiter_lines():
                if line.startswith("data: "):
                    n += 1
                if n >= 3:
                    return n     # leave mid-generation: the connection closes

    async def main():
        async with httpx.AsyncClient(timeout=60) as client:
            return await asyncio.gather(*(cut_one(client, i) for i in range(50)))
    assert all(n == 3 for n in asyncio.run(main()))
    for _ in range(300):
        if metric(server.url, "jaxserve:num_requests_running") == 0 and \
                metric(server.url, "jaxserve:num_requests_waiting") == 0:
            break
        asyncio.run(asyncio.sleep(0.05))
    assert metric(server.url, "jaxserve:num_requests_running") == 0
    assert metric(server.url, "jaxserve:kv_cache_free_blocks") == free_before


@pytest.mark.parametrize("fault", ["output", "grammar"])
def test_a_request_that_fails_alone_is_500_and_the_server_keeps_serving(server, monkeypatch, fault):
    """Processing one request's output, or its grammar, raises (an injected fault): that request gets
    a 500 (or, streamed, an error event and [DONE]), while a request running beside it and later
    ones are served, and the pool is as full as before."""
    if fault == "output":
        fail_marked_requests(monkeypatch, after=3)
        bad = {"prompt": [9] * 10 + MARKER, "max_tokens": 40, "ignore_eos": True}
    else:
        fail_marked_grammars(monkeypatch, "fill", after=3)
        bad = {"prompt": [9] * 10, "max_tokens": 40,
               "structured_outputs": {"regex": f"({GRAMMAR_MARKER})?[a-z ]{{8,60}}"}}
    free_before = metric(server.url, "jaxserve:kv_cache_free_blocks")
    good = {"prompt": [3, 4, 5], "max_tokens": 40, "ignore_eos": True}

    async def streamed(client, body):
        events = []
        async with client.stream("POST", f"{server.url}/v1/completions", json=body) as r:
            assert r.status_code == 200
            async for line in r.aiter_lines():
                if line.startswith("data: "):
                    events.append(line[6:])
        return events

    async def main():
        async with httpx.AsyncClient(timeout=60) as client:
            return await asyncio.gather(client.post(f"{server.url}/v1/completions", json=bad),
                                        streamed(client, {**bad, "stream": True, "n": 2}),
                                        client.post(f"{server.url}/v1/completions", json=good))
    plain, events, beside = asyncio.run(main())
    assert_error(plain, 500, contains="internal error")
    assert events[-1] == "[DONE]" and json.loads(events[-2])["error"]["code"] == 500
    assert len(events) > 2 and all("choices" in json.loads(e) for e in events[:-2])   # tokens before it
    assert beside.status_code == 200 and beside.json()["usage"]["completion_tokens"] == 40
    assert post(server, "/v1/completions", good).status_code == 200
    assert httpx.get(f"{server.url}/health").status_code == 200
    assert metric(server.url, "jaxserve:num_requests_running") == 0
    assert metric(server.url, "jaxserve:kv_cache_free_blocks") == free_before


def test_api_key_401(tiny_llm_engine):
    srv = RunningServer(AsyncEngine(tiny_llm_engine), api_key="sekret")
    try:
        body = {"prompt": "x", "max_tokens": 1}
        assert_error(post(srv, "/v1/completions", body), 401)
        assert_error(post(srv, "/v1/completions", body, headers={"Authorization": "Bearer wrong"}), 401)
        assert post(srv, "/v1/completions", body, headers={"Authorization": "Bearer sekret"}).status_code == 200
        assert httpx.get(f"{srv.url}/health").status_code == 200   # health stays open
    finally:
        srv.stop()


def test_queue_limit_503(tiny_llm_engine):
    srv = RunningServer(AsyncEngine(tiny_llm_engine, max_num_queued_requests=2))
    try:
        async def main():
            async with httpx.AsyncClient(timeout=60) as client:
                body = {"prompt": "x", "max_tokens": 60, "ignore_eos": True}
                return await asyncio.gather(*(client.post(f"{srv.url}/v1/completions", json=body)
                                              for _ in range(8)))
        codes = sorted(r.status_code for r in asyncio.run(main()))
        assert codes.count(200) >= 2 and 503 in codes
        assert all(c in (200, 503) for c in codes)
    finally:
        srv.stop()


def test_dead_engine_is_503_everywhere(tiny_llm_engine):
    engine = AsyncEngine(tiny_llm_engine)
    srv = RunningServer(engine)
    try:
        engine.shutdown()
        assert httpx.get(f"{srv.url}/health").status_code == 503
        assert_error(post(srv, "/v1/completions", {"prompt": "x"}), 503)
    finally:
        srv.stop()


@pytest.mark.parametrize("body,status,param", [
    ({"prompt": "hi", "top_k": 10**10, "max_tokens": 2}, 200, None),           # keeps the whole vocab: no cut
    ({"prompt": "hi", "stop_token_ids": [2**32], "max_tokens": 2}, 400, "stop_token_ids"),
    ({"prompt": "hi", "n": 129}, 400, "n"),
    ({"prompt": "hi", "logit_bias": {"5": 10, "0": -100}, "max_tokens": 2}, 200, None),
    ({"prompt": "hi", "logit_bias": {"five": 10}}, 400, "logit_bias"),
    ({"prompt": "hi", "logit_bias": {"-5": 10}}, 400, "logit_bias"),
    ({"prompt": "hi", "logit_bias": {"1" * 5000: 10}}, 400, "logit_bias"),               # past int()'s digits
    ({"prompt": "hi", "logit_bias": {"5": 100.5}}, 400, "logit_bias"),
    ({"prompt": "hi", "logit_bias": {str(t): 1 for t in range(301)}}, 400, "logit_bias"),
    ({"prompt": "hi", "logit_bias": {"4096": 1}}, 400, "logit_bias"),                   # past the vocabulary
    ({"prompt": "hi", "logit_bias": {"5": "high"}}, 400, None),
    ({"prompt": "hi", "allowed_token_ids": [5, 6], "max_tokens": 2}, 200, None),
    ({"prompt": "hi", "allowed_token_ids": []}, 400, "allowed_token_ids"),
    ({"prompt": "hi", "allowed_token_ids": [-5]}, 400, "allowed_token_ids"),
    ({"prompt": "hi", "allowed_token_ids": [5, 4096]}, 400, "allowed_token_ids"),       # past the vocabulary
    ({"prompt": "hi", "allowed_token_ids": [5] * 600}, 400, "allowed_token_ids"),       # more ids than tokens
    ({"prompt": "hi", "bad_words": ["the", " cat"], "max_tokens": 2}, 200, None),
    ({"prompt": "hi", "bad_words": [""]}, 400, "bad_words"),
    ({"prompt": "hi", "truncate_prompt_tokens": 0}, 400, "truncate_prompt_tokens"),
    ({"prompt": "hi", "truncate_prompt_tokens": 10**6}, 400, "truncate_prompt_tokens"),    # past max_model_len
    ({"prompt": "hi", "bad_words": ["w"] * 129}, 400, "bad_words"),
    ({"prompt": "hi", "bad_words": ["w" * 257]}, 400, "bad_words"),
    ({"prompt": "hi", "suffix": "x"}, 400, "suffix"),
    ({"prompt": "hi", "priority": 3}, 400, "priority"),                         # needs the priority policy
])
def test_out_of_range_values_fail_only_their_request(server, body, status, param):
    r = post(server, "/v1/completions", body)
    if status == 200:
        assert r.status_code == 200, r.text
    else:
        assert_error(r, status, param)
    assert httpx.get(f"{server.url}/health").status_code == 200
    assert post(server, "/v1/completions", {"prompt": "ok", "max_tokens": 1}).status_code == 200


def test_streaming_chat_disconnects_abort_too(server):
    async def cut(client):
        body = {"messages": [{"role": "user", "content": "tell me"}], "max_tokens": 90, "stream": True,
                "ignore_eos": True}
        async with client.stream("POST", f"{server.url}/v1/chat/completions", json=body) as r:
            async for line in r.aiter_lines():
                if line.startswith("data: ") and '"content"' in line and '"role"' not in line:
                    return

    async def main():
        async with httpx.AsyncClient(timeout=60) as client:
            await asyncio.gather(*(cut(client) for _ in range(8)))
    free_before = metric(server.url, "jaxserve:kv_cache_free_blocks")
    asyncio.run(main())
    for _ in range(300):
        if metric(server.url, "jaxserve:num_requests_running") == 0:
            break
        asyncio.run(asyncio.sleep(0.05))
    assert metric(server.url, "jaxserve:num_requests_running") == 0
    assert metric(server.url, "jaxserve:kv_cache_free_blocks") == free_before


def test_constraints_that_leave_no_token_are_a_400_naming_the_reason(server):
    """allowed_token_ids of EOS alone with a choice grammar, which does not allow EOS first: found
    at the first step. Plain: a 400 with the reason; streamed: an error event with code 400, then
    [DONE]. Where it is plain before any step (EOS alone under min_tokens), a 400 at once."""
    eos = [2]      # the tiny model's EOS
    body = {"prompt": "hi", "max_tokens": 4, "allowed_token_ids": eos,
            "structured_outputs": {"choice": ["yes", "no"]}}
    r = post(server, "/v1/completions", body)
    assert_error(r, 400, contains="no token can be sampled")
    events = []
    with httpx.stream("POST", f"{server.url}/v1/completions", json={**body, "stream": True}, timeout=60) as s:
        assert s.status_code == 200
        events = [line[6:] for line in s.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]" and json.loads(events[-2])["error"]["code"] == 400
    static = {"prompt": "hi", "max_tokens": 4, "min_tokens": 2, "allowed_token_ids": eos, "stream": True}
    assert_error(post(server, "/v1/completions", static), 400, contains="no token can be sampled")
    assert post(server, "/v1/completions", {"prompt": "ok", "max_tokens": 1}).status_code == 200
