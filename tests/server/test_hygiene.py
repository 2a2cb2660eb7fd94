"""Bad input cannot hurt: request limits, malformed bodies, a fuzzer, auth and docs.

On the scripted engine (tests/server/scripted.py), so that thousands of bodies run in seconds.
"""

import json

import httpx
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from jaxserve.engine.async_engine import AsyncEngine
from jaxserve.protocol import RequestLimits

from .conftest import RunningServer
from .scripted import ScriptedEngine

LIMITS = RequestLimits(max_prompts_per_request=8, max_sequences_per_request=16, max_stop_strings=4,
                       max_stop_string_chars=10, max_stop_token_ids=5, max_logprobs=3)


def scripted_server(tok, **app_kwargs):
    engine = ScriptedEngine(tok, lambda prompt, i: [71, 72, 73, 74], max_logprobs=3)
    return RunningServer(AsyncEngine(engine, max_num_queued_requests=64), served_model_name="scripted",
                         max_request_body_bytes=64 * 1024, **app_kwargs)


@pytest.fixture(scope="module")
def srv(tok):
    s = scripted_server(tok, limits=LIMITS)
    yield s
    s.stop()


def post(srv, body, path="/v1/completions", **kw):
    return httpx.post(f"{srv.url}{path}", json=body, timeout=30, **kw)


def assert_400(r, param, contains):
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and contains in err["message"], err


@pytest.mark.parametrize("body,param,contains", [
    ({"prompt": [[1]] * 9}, "prompt", "--max-prompts-per-request"),
    ({"prompt": [[1]] * 6, "n": 3}, "n", "6 prompts x n=3 = 18 sequences"),
    ({"prompt": "x", "stop": ["a", "b", "c", "d", "e"]}, "stop", "--max-stop-strings"),
    ({"prompt": "x", "stop": "y" * 11}, "stop", "11 characters"),
    ({"prompt": "x", "stop_token_ids": [1] * 6}, "stop_token_ids", "--max-stop-token-ids"),
    ({"prompt": "x", "logprobs": 4}, "logprobs", "--max-logprobs"),
    ({"prompt": "x", "prompt_logprobs": 10**9}, "prompt_logprobs", "--max-logprobs"),
    ({"prompt": "x", "n": 10**9}, "n", "128"),
])
def test_each_limit_is_a_400_naming_its_flag(srv, body, param, contains):
    assert_400(post(srv, body), param, contains)


def test_chat_limits_and_a_request_just_inside_them(srv):
    msgs = [{"role": "user", "content": "hi"}]
    assert_400(post(srv, {"messages": msgs, "top_logprobs": 4, "logprobs": True}, "/v1/chat/completions"),
               "top_logprobs", "--max-logprobs")
    assert_400(post(srv, {"messages": msgs, "n": 17}, "/v1/chat/completions"), "n", "--max-sequences")
    ok = post(srv, {"prompt": [[1]] * 8, "n": 2, "stop": ["a", "b", "c", "d"], "stop_token_ids": [1] * 5,
                    "logprobs": 3, "max_tokens": 2})
    assert ok.status_code == 200 and len(ok.json()["choices"]) == 16


def test_malformed_bodies_are_400_or_413(srv):
    url = f"{srv.url}/v1/completions"
    deep = "[" * 100_000 + "]" * 100_000
    cases = {
        "deep json": (json.dumps({"prompt": "x"})[:-1] + ', "metadata": ' + deep[:20000] + deep[-20000:] + "}")
        .encode(),
        "deep array": deep[:30000].encode() + deep[-30000:].encode(),
        "invalid utf-8": b'{"prompt": "\xff\xfe"}',
        "not an object": b"[1, 2]",
        "empty": b"",
        "truncated": b'{"prompt": "x", ',
        "nan": b'{"prompt": "x", "temperature": NaN}',
        "lone surrogate": b'{"prompt": "a\\ud800b"}',
        "lone surrogate in model": b'{"prompt": "x", "model": "\\udfff"}',
        "5000-digit integer": b'{"prompt": "x", "n": ' + b"1" * 5000 + b"}",
    }
    for name, data in cases.items():
        r = httpx.post(url, content=data, headers={"content-type": "application/json"}, timeout=30)
        assert r.status_code == 400, (name, r.status_code, r.text[:200])
        assert r.json()["error"]["code"] == 400
    big = httpx.post(url, content=b'{"prompt": "' + b"x" * 10_000_000 + b'"}', timeout=30)
    assert big.status_code == 413


_json = st.recursive(st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=20),
                     lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner,
                                                                                  max_size=4), max_leaves=12)
_fields = ["prompt", "messages", "n", "max_tokens", "temperature", "top_p", "top_k", "stop", "stop_token_ids",
           "logprobs", "top_logprobs", "echo", "stream", "stream_options", "seed", "min_tokens", "prompt_logprobs",
           "tools", "tool_choice", "response_format", "logit_bias", "priority", "model", "best_of",
           "max_completion_tokens", "chat_template_kwargs", "add_generation_prompt", "cache_salt"]
_bodies = st.dictionaries(st.sampled_from(_fields), _json, max_size=6)


@settings(max_examples=300, deadline=None, suppress_health_check=list(HealthCheck))
@example(body={"prompt": [2 ** 40]}, path="/v1/completions")   # a token id past any vocabulary (and int64)
@example(body={"prompt": []}, path="/v1/completions")
@given(body=_bodies, path=st.sampled_from(["/v1/completions", "/v1/chat/completions", "/tokenize",
                                           "/detokenize"]))
def test_fuzzed_bodies_never_get_a_5xx(srv, body, path):
    r = httpx.post(f"{srv.url}{path}", content=json.dumps(body), headers={"content-type": "application/json"},
                   timeout=30)    # json.dumps writes NaN and Infinity too
    assert r.status_code < 500, (body, r.text)
    if r.status_code >= 400:
        assert set(r.json()["error"]) == {"message", "type", "param", "code"}
    elif "stream" in r.headers.get("content-type", ""):
        assert r.text.rstrip().endswith("data: [DONE]")


def test_api_key_covers_every_route_but_health_and_metrics(tok):
    s = scripted_server(tok, api_key="sekret")
    try:
        for method, path in [("GET", "/v1/models"), ("POST", "/v1/completions"), ("POST", "/v1/chat/completions"),
                             ("POST", "/tokenize"), ("POST", "/detokenize"), ("GET", "/nope"),
                             ("GET", "/openapi.json")]:
            for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "sekret"}):
                r = httpx.request(method, f"{s.url}{path}", headers=headers, json={})
                assert r.status_code == 401, (path, headers)
                assert r.json()["error"]["type"] == "authentication_error"
        assert httpx.get(f"{s.url}/health").status_code == 200
        assert httpx.get(f"{s.url}/metrics").status_code == 200
        ok = httpx.post(f"{s.url}/v1/completions", json={"prompt": "x", "max_tokens": 2},
                        headers={"Authorization": "Bearer sekret"})
        assert ok.status_code == 200
    finally:
        s.stop()


def test_docs_are_off_unless_asked_for(srv, tok):
    assert httpx.get(f"{srv.url}/docs").status_code == 404
    assert httpx.get(f"{srv.url}/openapi.json").status_code == 404
    s = scripted_server(tok, enable_docs=True)
    try:
        assert httpx.get(f"{s.url}/docs").status_code == 200
        schema = httpx.get(f"{s.url}/openapi.json").json()
        body = schema["paths"]["/v1/completions"]["post"]["requestBody"]["content"]["application/json"]["schema"]
        assert body == {"$ref": "#/components/schemas/CompletionRequest"}
        assert "prompt" in schema["components"]["schemas"]["CompletionRequest"]["properties"]
    finally:
        s.stop()


def test_unknown_routes_and_methods_answer_in_the_error_shape(srv):
    r = httpx.get(f"{srv.url}/v1/nothing")
    assert r.status_code == 404 and r.json()["error"]["code"] == 404
    r = httpx.get(f"{srv.url}/v1/completions")
    assert r.status_code == 405 and r.json()["error"]["code"] == 405


def test_a_request_larger_than_the_queue_is_a_400_not_a_503_forever(tok):
    engine = ScriptedEngine(tok, lambda prompt, i: [71, 72], max_logprobs=3)
    s = RunningServer(AsyncEngine(engine, max_num_queued_requests=10), served_model_name="scripted")
    try:
        r = post(s, {"prompt": [[1], [2], [3]], "n": 4, "max_tokens": 2})      # 12 sequences > 10
        assert_400(r, "n", "--max-num-queued-requests")
        assert engine.added == []                                             # nothing was admitted
        assert post(s, {"prompt": [[1], [2]], "n": 5, "max_tokens": 2}).status_code == 200
        # A request that fits the limit but not beside the ones in flight is a 503 (retry later).
        engine.step_delay_s = 0.5
        with httpx.stream("POST", f"{s.url}/v1/completions", json={"prompt": [[1], [2]], "n": 4, "max_tokens": 2,
                                                                   "stream": True}) as held:
            lines = held.iter_lines()                 # kept: a dropped iterator closes the stream
            next(lines)                               # 8 sequences in flight now
            r = post(s, {"prompt": [1], "n": 3, "max_tokens": 2})
            assert r.status_code == 503 and "--max-num-queued-requests" in r.json()["error"]["message"]
    finally:
        s.stop()


def test_streaming_chat_with_prompt_logprobs_is_refused(srv):
    r = post(srv, {"messages": [{"role": "user", "content": "hi"}], "stream": True, "prompt_logprobs": 1},
             "/v1/chat/completions")
    assert_400(r, "prompt_logprobs", "stream")
