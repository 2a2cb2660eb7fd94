"""`jaxserve router` over fake instances: gRPC servicers whose outputs are worked out by hand.

A fake consumer's choice i generates the tokens 100 + 10 i + k (k = 0, 1, ...), one Chunk
each, text = the tokenizer's decoding of that token; a fake producer answers one token and
a Complete carrying an export of the prompt's full blocks (block size 4). Fakes run on
their own event loop thread, the router (uvicorn + RouterEngine) on another, as in
production; the tests drive it over HTTP, mostly with the official `openai` client.
"""

from __future__ import annotations

import asyncio
import json
import re
import signal
import subprocess
import sys
import threading
import time

import grpc
import httpx
import openai
import pytest
import uvicorn
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from jaxserve.core import RequestOutputKind, SamplingParams
from jaxserve.proto import jaxserve_pb2 as pb
from jaxserve.proto import jaxserve_pb2_grpc as pb_grpc
from jaxserve.tokenizer import Tokenizer
from server.router import RouterEngine, load_tokenizer, router_app

from .conftest import free_port, metric

BLOCK_SIZE = 4
LONG_PROMPT = "Once upon a time, in a small town by the sea"   # 10+ tokens: two full blocks or more
SHORT_PROMPT = [5, 6, 7]                                        # no full block to ship
TOK: Tokenizer      # the tiny model's, set by the `tokenizer` fixture (the fakes decode with it too)


class LoopThread:
    """An event loop running on its own daemon thread."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def submit(self, coro):
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def run(self, coro, timeout: float = 30):
        return self.submit(coro).result(timeout)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


class FakeInstance(pb_grpc.GenerationServicer, pb_grpc.KVTransferServicer):
    """Generation + KVTransfer + Health of one instance, recording what it was asked."""

    def __init__(self, kv_role: str, log: list, **model_info) -> None:
        self.kv_role, self.log = kv_role, log
        self.model_info = pb.ModelInfo(**{**dict(served_model_name="tiny", model_name="tiny-llama", max_model_len=128,
                                                  vocab_size=512, block_size=BLOCK_SIZE, compat_hash="c1",
                                                  max_logprobs=5), **model_info})
        self.health = health.aio.HealthServicer()
        self.reset()

    def reset(self) -> None:
        self.requests: list[pb.GenerateRequest] = []
        self.cancelled: list[str] = []         # request ids whose call the client cancelled
        self.released: list[str] = []          # transfer ids
        self.fail: tuple[grpc.StatusCode, str] | None = None    # Generate fails with it, before any message
        self.fail_mid: tuple[grpc.StatusCode, str] | None = None    # ... or after the first chunk
        self.first_delay_s = 0.0
        self.token_delay_s = 0.0
        self.text: str | None = None            # decode: this text (8 characters a chunk), then "stop"

    @property
    def last(self) -> pb.GenerateRequest:
        return self.requests[-1]

    async def start(self) -> None:
        self.server = grpc.aio.server()
        pb_grpc.add_GenerationServicer_to_server(self, self.server)
        pb_grpc.add_KVTransferServicer_to_server(self, self.server)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        self.address = f"127.0.0.1:{self.server.add_insecure_port('127.0.0.1:0')}"
        await self.server.start()

    async def Generate(self, request, context):
        self.requests.append(request)
        self.log.append((self.kv_role, request.request_id))
        # context.write, not an async generator: a cancel that lands while grpc writes a yielded message
        # leaves the generator suspended, where no CancelledError reaches it
        try:
            if self.fail is not None:
                await context.abort(*self.fail)
            await asyncio.sleep(self.first_delay_s)
            if self.kv_role == "producer":
                await context.write(pb.GenerateResponse(chunk=pb.Chunk(index=0, token_ids=[99], text="x")))
                await context.write(pb.GenerateResponse(complete=self.produced(request)))
                return
            async for message in self.decoded(request, context):
                await context.write(message)
        except asyncio.CancelledError:
            self.cancelled.append(request.request_id)
            raise

    def produced(self, request) -> pb.Complete:
        ids = list(request.token_ids.ids)
        n = len(ids) // BLOCK_SIZE
        kv = pb.KVTransferParams(role=pb.KV_ROLE_PRODUCE, transfer_id=request.kv_transfer_params.transfer_id,
                                 num_full_blocks=n, block_hashes=[b"h%d" % i for i in range(n)], block_size=BLOCK_SIZE,
                                 compat_hash="c1", lease_seconds=30.0)
        return pb.Complete(index=0, finish_reason="length", prompt_tokens=len(ids), completion_tokens=1,
                           cached_tokens=BLOCK_SIZE, prompt_token_ids=ids, kv_transfer_params=kv)

    async def decoded(self, request, context):
        sp = request.sampling_params
        if self.text is not None:
            pieces = [self.text[i:i + 8] for i in range(0, len(self.text), 8)]
            for k, piece in enumerate(pieces):
                yield pb.GenerateResponse(chunk=pb.Chunk(index=0, token_ids=[100 + k], text=piece))
            yield pb.GenerateResponse(complete=pb.Complete(
                index=0, finish_reason="stop", prompt_tokens=len(request.token_ids.ids), completion_tokens=len(pieces)))
            return
        for k in range(sp.max_tokens):
            for i in range(sp.n):
                token = 100 + 10 * i + k
                lps = [pb.TokenLogprobs(token_id=token, logprob=-token / 100, top=[pb.TopLogprob(token_id=0,
                                                                                               logprob=-0.5)])]
                yield pb.GenerateResponse(chunk=pb.Chunk(index=i, token_ids=[token], text=TOK.decode([token]),
                                                         logprobs=lps if sp.HasField("logprobs") else None))
                if self.fail_mid is not None:
                    await context.abort(*self.fail_mid)
            await asyncio.sleep(self.token_delay_s)
        for i in range(sp.n):
            stop = {"stop_string": sp.stop[0]} if sp.stop else {}
            yield pb.GenerateResponse(complete=pb.Complete(
                index=i, finish_reason="stop" if sp.stop else "length", prompt_tokens=len(request.token_ids.ids),
                completion_tokens=sp.max_tokens, cached_tokens=len(request.token_ids.ids) - 1, **stop))

    async def Release(self, request, context):
        self.released.append(request.transfer_id)
        return pb.LeaseResponse(found=True)

    async def GetModelInfo(self, request, context):
        return self.model_info

    async def GetServerInfo(self, request, context):
        return pb.ServerInfo(num_running=3, num_waiting=1, kv_usage=0.25, kv_role=self.kv_role, kv_free_blocks=10,
                             kv_total_blocks=20, healthy=True)

    def set_serving(self, loop: LoopThread, serving: bool) -> None:
        status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
        loop.run(self.health.set("", status))


def expected_text(choice: int, num_tokens: int) -> str:
    return "".join(TOK.decode([100 + 10 * choice + k]) for k in range(num_tokens))


class Router:
    """RouterEngine + uvicorn on their own loop thread, on a free port."""

    def __init__(self, prefill: list[str], decode: list[str], **app_kw) -> None:
        self.loop = LoopThread()
        self.engine = self.loop.run(RouterEngine.connect(TOK, 512, prefill, decode, startup_timeout_s=5,
                                                         poll_interval_s=0.05))
        self.port = free_port()
        self.server = uvicorn.Server(uvicorn.Config(router_app(self.engine, **app_kw), host="127.0.0.1",
                                                    port=self.port, log_level="warning"))
        self.serving = self.loop.submit(self.server.serve())
        deadline = time.monotonic() + 30
        while not self.server.started:
            assert time.monotonic() < deadline and not self.serving.done(), "the router did not start"
            time.sleep(0.02)
        self.url = f"http://127.0.0.1:{self.port}"
        self.client = openai.OpenAI(base_url=f"{self.url}/v1", api_key="unused", max_retries=0)

    def stop(self) -> None:
        self.server.should_exit = True
        self.serving.result(30)
        self.loop.run(self.engine.aclose())
        self.loop.close()


@pytest.fixture(scope="module", autouse=True)
def tokenizer(tiny_models):
    global TOK
    TOK, vocab = load_tokenizer(str(tiny_models["llama"]))
    assert vocab == 512
    return TOK


@pytest.fixture(scope="module")
def fakes():
    loop, log = LoopThread(), []
    producer, consumer = FakeInstance("producer", log), FakeInstance("consumer", log)
    for f in (producer, consumer):
        loop.run(f.start())
    yield loop, producer, consumer, log
    for f in (producer, consumer):
        loop.run(f.server.stop(None))
    loop.close()


@pytest.fixture(scope="module")
def router(fakes):
    _, producer, consumer, _ = fakes
    r = Router([producer.address], [consumer.address])
    yield r
    r.stop()


@pytest.fixture(autouse=True)
def fresh(request):
    """Every fake as new, and their call log empty, before each test that uses them."""
    if "fakes" in request.fixturenames:
        _, producer, consumer, log = request.getfixturevalue("fakes")
        producer.reset()
        consumer.reset()
        log.clear()


def wait_for(condition, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


def post(router, body, path="/v1/completions", **kw):
    return httpx.post(f"{router.url}{path}", json=body, timeout=30, **kw)


def path_count(router, path: str) -> float:
    text = httpx.get(f"{router.url}/metrics").text
    line = next(x for x in text.splitlines() if x.startswith("jaxserve:router_requests_total{")
                and f'path="{path}"' in x)
    return float(line.rsplit(" ", 1)[1])


# ---- the two legs ----------------------------------------------------------------------


def test_prefill_then_decode_with_the_params_each_leg_needs(router, fakes):
    _, producer, consumer, log = fakes
    before = path_count(router, "disaggregated")
    r = router.client.completions.create(model="tiny", prompt=LONG_PROMPT, max_tokens=5, temperature=0.7, seed=11,
                                         top_p=0.9, stop=["zz"], logprobs=2, logit_bias={"5": -3.5},
                                         extra_body={"min_tokens": 2, "allowed_token_ids": [5, 9],
                                                     "bad_words": ["zz"]})
    ids = TOK.encode(LONG_PROMPT)
    assert [role for role, _ in log] == ["producer", "consumer"]
    p, c = producer.last, consumer.last
    assert list(p.token_ids.ids) == list(c.token_ids.ids) == ids
    ps, cs = p.sampling_params, c.sampling_params
    assert (ps.max_tokens, ps.n, ps.min_tokens, list(ps.stop), ps.HasField("logprobs")) == (1, 1, 0, [], False)
    assert ps.seed == cs.seed == 11 and ps.temperature == cs.temperature == pytest.approx(0.7)
    assert ps.top_p == pytest.approx(0.9)
    assert (cs.max_tokens, cs.n, cs.min_tokens, list(cs.stop), cs.logprobs) == (5, 1, 2, ["zz"], 2)
    assert dict(cs.logit_bias) == {5: -3.5} and list(cs.allowed_token_ids) == [5, 9] and list(cs.bad_words) == ["zz"]
    assert p.kv_transfer_params.role == pb.KV_ROLE_PRODUCE and p.kv_transfer_params.transfer_id
    kv = c.kv_transfer_params
    assert kv.role == pb.KV_ROLE_CONSUME and kv.transfer_id == p.kv_transfer_params.transfer_id
    assert kv.producer_address == producer.address
    assert (kv.num_full_blocks, list(kv.block_hashes), kv.block_size, kv.compat_hash) == \
        (len(ids) // BLOCK_SIZE, [b"h%d" % i for i in range(len(ids) // BLOCK_SIZE)], BLOCK_SIZE, "c1")
    (choice,) = r.choices
    assert choice.text == expected_text(0, 5)
    assert (choice.finish_reason, choice.model_extra["stop_reason"]) == ("stop", "zz")
    assert choice.logprobs.token_logprobs == [pytest.approx(-(100 + k) / 100) for k in range(5)]
    assert r.usage.prompt_tokens == len(ids) and r.usage.completion_tokens == 5
    assert r.usage.prompt_tokens_details.cached_tokens == BLOCK_SIZE     # the producer's hits, not the pull
    assert path_count(router, "disaggregated") == before + 1
    assert producer.released == [] and consumer.cancelled == []


def test_a_prompt_without_a_full_block_to_ship_goes_decode_only(router, fakes):
    _, producer, consumer, _ = fakes
    before = path_count(router, "decode_only")
    r = router.client.completions.create(model="tiny", prompt=SHORT_PROMPT, max_tokens=3)
    assert r.choices[0].text == expected_text(0, 3)
    assert producer.requests == [] and consumer.last.kv_transfer_params.role == pb.KV_ROLE_UNSPECIFIED
    assert path_count(router, "decode_only") == before + 1


def test_n2_producer_gets_n1_and_streaming_matches_the_final_answer(router, fakes):
    _, producer, consumer, _ = fakes
    kw = dict(model="tiny", prompt=LONG_PROMPT, max_tokens=4, n=2)
    full = router.client.completions.create(**kw)
    assert sorted((c.index, c.text) for c in full.choices) == [(0, expected_text(0, 4)), (1, expected_text(1, 4))]
    assert producer.last.sampling_params.n == 1 and consumer.last.sampling_params.n == 2
    chunks = list(router.client.completions.create(stream=True, stream_options={"include_usage": True}, **kw))
    for i in (0, 1):
        assert "".join(c.choices[0].text for c in chunks if c.choices and c.choices[0].index == i) == \
            expected_text(i, 4)
        assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].index == i][-1] == "length"
    assert chunks[-1].usage.completion_tokens == 8 and chunks[-1].choices == []


def test_chat_streaming_and_not(router, fakes):
    msgs = [{"role": "user", "content": "Once upon a time, in a small town"}]
    full = router.client.chat.completions.create(model="tiny", messages=msgs, max_tokens=6)
    assert full.choices[0].message.content == expected_text(0, 6)
    chunks = list(router.client.chat.completions.create(model="tiny", messages=msgs, max_tokens=6, stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == expected_text(0, 6)
    text = TOK.apply_chat_template(msgs, add_generation_prompt=True)
    assert list(fakes[2].last.token_ids.ids) == TOK.encode(text, add_special_tokens=False)


def test_echo_is_the_routers_and_prompt_logprobs_are_a_400(router, fakes):
    r = router.client.completions.create(model="tiny", prompt=LONG_PROMPT, max_tokens=2, echo=True)
    assert r.choices[0].text == LONG_PROMPT + expected_text(0, 2)
    r = post(router, {"prompt": LONG_PROMPT, "max_tokens": 2, "echo": True, "logprobs": 1})
    assert r.status_code == 400 and r.json()["error"]["message"].startswith("prompt_logprobs is not available")


# ---- errors ----------------------------------------------------------------------------


@pytest.mark.parametrize("code,status,kind", [
    (grpc.StatusCode.INVALID_ARGUMENT, 400, "invalid_request_error"),
    (grpc.StatusCode.RESOURCE_EXHAUSTED, 503, "service_unavailable"),
    (grpc.StatusCode.UNAVAILABLE, 503, "service_unavailable"),
])
@pytest.mark.parametrize("stream", [False, True])
def test_consumer_errors_are_the_http_errors_of_a_single_server(router, fakes, code, status, kind, stream):
    _, producer, consumer, _ = fakes
    consumer.fail = (code, "the instance's own message")
    r = post(router, {"prompt": LONG_PROMPT, "max_tokens": 3, "stream": stream})
    assert r.status_code == status and r.headers["content-type"] == "application/json"
    assert r.json() == {"error": {"message": "the instance's own message", "type": kind, "param": None,
                                  "code": status}}
    wait_for(lambda: producer.released == [producer.last.kv_transfer_params.transfer_id])


def test_a_consumer_dying_mid_request_is_a_503(router, fakes):
    fakes[2].fail_mid = (grpc.StatusCode.UNAVAILABLE, "the engine is not running")
    r = post(router, {"prompt": LONG_PROMPT, "max_tokens": 3})
    assert r.status_code == 503 and r.json()["error"]["message"] == "the engine is not running"
    r = post(router, {"prompt": LONG_PROMPT, "max_tokens": 3, "stream": True})
    events = [line[6:] for line in r.text.splitlines() if line.startswith("data: ")]
    assert json.loads(events[0])["choices"][0]["text"] == expected_text(0, 1)
    assert json.loads(events[1])["error"]["code"] == 503 and events[2:] == ["[DONE]"]
    wait_for(lambda: metric(router.url, "jaxserve:num_requests_in_flight") == 0)


def test_a_request_failing_on_its_own_constraints_mid_stream_is_a_400(router, fakes):
    # A single server answers 400 when a request's own constraints leave no token after its first
    # (streamed: an error event with code 400); the instance sends INVALID_ARGUMENT mid-call.
    message = "the request's constraints leave no token to sample"
    fakes[2].fail_mid = (grpc.StatusCode.INVALID_ARGUMENT, message)
    r = post(router, {"prompt": LONG_PROMPT, "max_tokens": 3})
    assert r.status_code == 400 and r.json()["error"]["message"] == message
    r = post(router, {"prompt": LONG_PROMPT, "max_tokens": 3, "stream": True})
    events = [line[6:] for line in r.text.splitlines() if line.startswith("data: ")]
    assert json.loads(events[0])["choices"][0]["text"] == expected_text(0, 1)
    error = json.loads(events[1])["error"]
    assert (error["code"], error["type"], error["message"]) == (400, "invalid_request_error", message)
    assert events[2:] == ["[DONE]"]
    wait_for(lambda: metric(router.url, "jaxserve:num_requests_in_flight") == 0)


def test_other_consumer_failures_are_a_500_that_tells_only_an_id(router, fakes):
    fakes[2].fail = (grpc.StatusCode.INTERNAL, "secret traceback")
    r = post(router, {"prompt": SHORT_PROMPT, "max_tokens": 3})
    assert r.status_code == 500 and "internal error (request id" in r.json()["error"]["message"]
    assert "secret" not in r.text


def test_tool_calls_are_parsed_by_a_router_started_with_a_tool_call_parser(fakes):
    # As `jaxserve serve --enable-auto-tool-choice --tool-call-parser hermes`: the router parses what
    # the instances generate (without the flags, tools with tool_choice "auto" are a 400 naming them).
    _, producer, consumer, _ = fakes
    consumer.text = 'Sure.<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}}}}]
    body = {"messages": [{"role": "user", "content": "weather in Paris?"}], "tools": tools, "max_tokens": 40}
    plain = Router([producer.address], [consumer.address])
    try:
        r = post(plain, body, path="/v1/chat/completions")
        assert r.status_code == 400 and "--enable-auto-tool-choice" in r.json()["error"]["message"]
    finally:
        plain.stop()
    router = Router([producer.address], [consumer.address], tool_parser="hermes")
    try:
        for stream in (False, True):
            r = router.client.chat.completions.create(model="tiny", stream=stream, **body)
            if stream:
                chunks = list(r)
                calls = [c for ch in chunks for c in (ch.choices[0].delta.tool_calls or []) if ch.choices]
                content = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
                finish = [ch.choices[0].finish_reason for ch in chunks if ch.choices and ch.choices[0].finish_reason]
                name, arguments = calls[0].function.name, "".join(c.function.arguments or "" for c in calls)
            else:
                message, finish = r.choices[0].message, [r.choices[0].finish_reason]
                content, name, arguments = message.content, message.tool_calls[0].function.name, \
                    message.tool_calls[0].function.arguments
            assert (content, name, json.loads(arguments), finish) == (
                "Sure.", "get_weather", {"city": "Paris"}, ["tool_calls"]), stream
    finally:
        router.stop()


def test_the_models_sampling_defaults_fill_the_fields_a_request_leaves_out(router, fakes):
    # serve_router sets them from MODEL's generation config (--generation-config auto); the instances
    # get every field, so the router fills them in as a single server does.
    _, _, consumer, _ = fakes
    router.engine.sampling_defaults = {"temperature": 0.7, "top_k": 3, "max_tokens": 2}
    try:
        chat = {"messages": [{"role": "user", "content": "hi"}]}
        assert post(router, chat, path="/v1/chat/completions").status_code == 200
        sp = consumer.last.sampling_params
        assert (round(sp.temperature, 6), sp.top_k, sp.max_tokens) == (0.7, 3, 2)
        reply = post(router, {**chat, "temperature": 0.5, "max_tokens": 3}, path="/v1/chat/completions")
        assert reply.status_code == 200
        sp = consumer.last.sampling_params
        assert (sp.temperature, sp.top_k, sp.max_tokens) == (0.5, 3, 3)
    finally:
        router.engine.sampling_defaults = {}


def test_a_request_the_producer_refuses_is_a_400_and_never_decoded(router, fakes):
    _, producer, consumer, _ = fakes
    producer.fail = (grpc.StatusCode.INVALID_ARGUMENT, "stop_token_ids=[999] has id 999 outside the vocabulary")
    r = post(router, {"prompt": LONG_PROMPT, "max_tokens": 3})
    assert r.status_code == 400 and r.json()["error"]["message"].startswith("stop_token_ids=[999]")
    assert consumer.requests == []


def test_what_the_grpc_api_cannot_carry_is_a_400(router, fakes):
    r = post(router, {"prompt": [600, 1]})
    assert r.status_code == 400 and r.json()["error"]["message"] == "prompt token id 600 is out of range [0, 512)"
    r = post(router, {"prompt": "x", "seed": 2**70})     # past int64: the engine's own check, as the proto's
    assert r.status_code == 400 and "must fit in 64 bits" in r.json()["error"]["message"]
    assert fakes[1].requests == fakes[2].requests == []


def test_priority_and_structured_outputs_travel_to_the_instances(router, fakes):
    _, producer, consumer, _ = fakes
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    r = post(router, {"prompt": LONG_PROMPT, "max_tokens": 3, "priority": 2,
                      "response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": schema}}})
    assert r.status_code == 200, r.text
    assert producer.last.priority == consumer.last.priority == 2
    assert not producer.last.sampling_params.HasField("structured_outputs")   # one token, discarded anyway
    so = consumer.last.sampling_params.structured_outputs
    assert so.WhichOneof("constraint") == "json" and json.loads(so.json) == schema
    r = post(router, {"prompt": LONG_PROMPT, "max_tokens": 3, "structured_outputs": {"choice": ["a", "b"]}})
    assert r.status_code == 200 and list(consumer.last.sampling_params.structured_outputs.choice.choices) == ["a", "b"]


# ---- clients that leave ----------------------------------------------------------------


def test_a_client_leaving_between_the_legs_releases_the_export(router, fakes):
    _, producer, consumer, _ = fakes
    consumer.first_delay_s = 30
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{router.url}/v1/completions", json={"prompt": LONG_PROMPT, "max_tokens": 3}, timeout=1)
    transfer_id = producer.last.kv_transfer_params.transfer_id
    wait_for(lambda: producer.released == [transfer_id] and consumer.cancelled == [consumer.last.request_id])
    wait_for(lambda: metric(router.url, "jaxserve:num_requests_in_flight") == 0)


def test_a_client_leaving_mid_stream_cancels_the_consumer_call(router, fakes):
    _, producer, consumer, _ = fakes
    consumer.token_delay_s = 0.1
    body = {"prompt": LONG_PROMPT, "max_tokens": 100, "stream": True}
    with httpx.stream("POST", f"{router.url}/v1/completions", json=body, timeout=30) as r:
        assert next(r.iter_lines()).startswith("data: ")
    wait_for(lambda: consumer.cancelled == [consumer.last.request_id])
    assert producer.released == []         # the consumer had pulled it
    wait_for(lambda: metric(router.url, "jaxserve:num_requests_in_flight") == 0)


def test_the_engine_surface_final_only_and_closing_an_unread_stream(router, fakes):
    """What create_app relies on, called directly: one FINAL_ONLY output with every choice; close()
    on a stream nobody reads cancels the consumer's call."""
    consumer = fakes[2]
    consumer.token_delay_s = 0.1
    prompt = {"prompt": LONG_PROMPT, "prompt_token_ids": TOK.encode(LONG_PROMPT)}

    async def scenario():
        final = await router.engine.add_request(
            prompt, SamplingParams(n=2, max_tokens=3, output_kind=RequestOutputKind.FINAL_ONLY), "final")
        outputs = [out async for out in final]
        unread = await router.engine.add_request(
            prompt, SamplingParams(max_tokens=50, output_kind=RequestOutputKind.DELTA), "unread")
        unread.close()
        return outputs
    (out,) = router.loop.run(scenario())
    assert out.finished and out.request_id == "final" and out.prompt_token_ids == prompt["prompt_token_ids"]
    assert [(c.index, c.text, c.finish_reason) for c in out.outputs] == \
        [(0, expected_text(0, 3), "length"), (1, expected_text(1, 3), "length")]
    assert out.outputs[1].token_ids == [110, 111, 112] and out.metrics.e2e_latency > 0
    wait_for(lambda: consumer.cancelled == ["unread"])


# ---- health, metrics, failures of instances --------------------------------------------


def test_health_and_metrics_follow_the_instances(router, fakes):
    loop, producer, consumer, _ = fakes
    assert httpx.get(f"{router.url}/health").status_code == 200
    assert metric(router.url, "jaxserve:num_requests_running") == 6          # 3 on each instance
    assert metric(router.url, "jaxserve:kv_cache_total_blocks") == 40
    try:
        producer.set_serving(loop, False)
        wait_for(lambda: not router.engine.producers[0].serving)
        assert router.client.completions.create(model="tiny", prompt=LONG_PROMPT, max_tokens=2).choices[0].text
        assert producer.requests == []       # a producer that is not serving gets nothing
        consumer.set_serving(loop, False)
        wait_for(lambda: httpx.get(f"{router.url}/health").status_code == 503)
        r = post(router, {"prompt": LONG_PROMPT, "max_tokens": 2})
        assert r.status_code == 503 and r.json()["error"]["type"] == "service_unavailable"
    finally:
        producer.set_serving(loop, True)
        consumer.set_serving(loop, True)
    wait_for(lambda: httpx.get(f"{router.url}/health").status_code == 200)
    wait_for(lambda: router.engine.producers[0].serving)


def test_a_failed_producer_sends_requests_decode_only_and_sits_out(tiny_models):
    loop, log = LoopThread(), []
    producers = [FakeInstance("producer", log), FakeInstance("producer", log)]
    consumer = FakeInstance("consumer", log)
    for f in (*producers, consumer):
        loop.run(f.start())
    router = Router([p.address for p in producers], [consumer.address])
    try:
        producers[0].fail = (grpc.StatusCode.INTERNAL, "broken")
        loop.run(producers[1].server.stop(None))        # its port is closed now
        for _ in range(4):
            r = router.client.completions.create(model="tiny", prompt=LONG_PROMPT, max_tokens=2)
            assert r.choices[0].text == expected_text(0, 2)
            assert consumer.last.kv_transfer_params.role == pb.KV_ROLE_UNSPECIFIED
        assert len(producers[0].requests) == 1       # then it sits out
        assert path_count(router, "decode_only") == 4 and path_count(router, "disaggregated") == 0
    finally:
        router.stop()
        for f in (producers[0], consumer):
            loop.run(f.server.stop(None))
        loop.close()


@pytest.mark.parametrize("change,message", [
    (("producer", {"compat_hash": "other"}), "different compat_hash ('other' vs 'c1')"),
    (("producer", {"max_model_len": 64}), "has max_model_len 64, less than the 128"),
    (("consumer", {"max_model_len": 64}), "disagree on max_model_len (128 vs 64)"),
    (("consumer", {"vocab_size": 1024}), "vocab_size"),
    (("role", "consumer"), "runs with kv role 'consumer'"),
])
def test_start_up_refuses_instances_that_cannot_serve_together(change, message):
    loop, log = LoopThread(), []
    who, what = change
    producer = FakeInstance("consumer" if who == "role" else "producer", log,
                            **(what if who == "producer" else {}))
    consumers = [FakeInstance("consumer", log), FakeInstance("consumer", log, **(what if who == "consumer" else {}))]
    for f in (producer, *consumers):
        loop.run(f.start())
    try:
        with pytest.raises(ValueError, match=re.escape(message)) as e:
            loop.run(RouterEngine.connect(TOK, 512, [producer.address], [c.address for c in consumers],
                                          startup_timeout_s=5))
        assert producer.address in str(e.value) or consumers[1].address in str(e.value)
    finally:
        for f in (producer, *consumers):
            loop.run(f.server.stop(None))
        loop.close()


def test_without_producers_requests_spread_over_plain_instances():
    """No --prefill: a load balancer over ordinary instances (kv role none), every request whole on one."""
    loop, log = LoopThread(), []
    plain = [FakeInstance("", log), FakeInstance("", log)]
    for f in plain:
        loop.run(f.start())
    try:
        engine = loop.run(RouterEngine.connect(TOK, 512, [], [f.address for f in plain], startup_timeout_s=5))
        with pytest.raises(ValueError, match="at least one --decode"):
            loop.run(RouterEngine.connect(TOK, 512, [f.address for f in plain], [], startup_timeout_s=5))

        async def one(i):
            stream = await engine.add_request({"prompt": None, "prompt_token_ids": list(range(5, 60))},
                                              SamplingParams(max_tokens=3, output_kind=RequestOutputKind.FINAL_ONLY),
                                              f"r{i}")
            return [out async for out in stream]
        for i in range(4):
            loop.run(one(i))
        assert sorted(role for role, _ in log) == [""] * 4 and {f.last.kv_transfer_params.role for f in plain} == \
            {pb.KV_ROLE_UNSPECIFIED}
        assert all(len(f.requests) == 2 for f in plain), "requests were not spread over both instances"
        assert engine.requests_by_path == {"disaggregated": 0, "decode_only": 4}
        loop.run(engine.aclose())
    finally:
        for f in plain:
            loop.run(f.server.stop(None))
        loop.close()


def test_the_router_command(fakes, tiny_models):
    """`jaxserve router` as a process: refuses a vocabulary mismatch, serves, exits 0 on SIGTERM."""
    _, producer, consumer, _ = fakes
    port = free_port()
    args = [sys.executable, "-m", "jaxserve.cli", "router", str(tiny_models["llama"]), "--prefill", producer.address,
            "--decode", consumer.address, "--port", str(port)]
    bad = subprocess.run(args + ["--decode", "127.0.0.1:1", "--startup-timeout-s", "1"], capture_output=True,
                         text=True, timeout=120)
    assert bad.returncode == 2 and "decode instance 127.0.0.1:1 did not answer GetModelInfo" in bad.stderr
    bad = subprocess.run(args + ["--enable-auto-tool-choice"], capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "--enable-auto-tool-choice needs --tool-call-parser" in bad.stderr
    proc = subprocess.Popen(args + ["--api-key", "k", "--enable-auto-tool-choice", "--tool-call-parser", "hermes"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_for(lambda: proc.poll() is not None or _up(url), timeout=120)
        assert proc.poll() is None, proc.stdout.read()
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="k", max_retries=0)
        assert [m.id for m in client.models.list().data] == ["tiny"]
        assert client.completions.create(model="tiny", prompt=LONG_PROMPT, max_tokens=3).choices[0].text == \
            expected_text(0, 3)
        assert httpx.post(f"{url}/v1/completions", json={"prompt": "x"}).status_code == 401
        tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
        reply = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}],
                                               tools=tools, max_tokens=3)   # tool_choice "auto": parsed here
        assert reply.choices[0].message.tool_calls is None and reply.choices[0].finish_reason == "length"
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0


def _up(url: str) -> bool:
    try:
        return httpx.get(f"{url}/health", timeout=1).status_code == 200
    except httpx.HTTPError:
        return False
