"""The gRPC API in-process: streamed deltas against HTTP and the engine, token-id input, n > 1,
cancel / deadline / Abort freeing the request, model and server info, every error code, health
and reflection; the serve flags; and `jaxserve serve --grpc-port` as a process under SIGTERM.

Each server runs on its own event-loop thread and is called with grpc's blocking client. The
real tiny model checks what the engine computes; the scripted engine (.scripted) checks what
can be worked out by hand (n > 1 lengths, stop strings, aborts, queue limits, a dying engine).
"""

import asyncio
import signal
import subprocess
import sys
import threading
import time
import types

import grpc
import httpx
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase

from jaxserve.cli import build_parser, engine_config
from jaxserve.cli import main as cli_main
from jaxserve.config import EngineConfig
from jaxserve.core import SamplingParams
from jaxserve.core.kv_transfer import IncompatibleKVError, KVTransferParams, UnknownTransferError
from jaxserve.engine.async_engine import AsyncEngine, QueueFullError
from jaxserve.engine.llm_engine import LLMEngine
from jaxserve.outputs import CompletionOutput, RequestOutput
from jaxserve.proto import jaxserve_pb2 as pb
from jaxserve.proto import jaxserve_pb2_grpc as pb_grpc
from server.app import serve
from server.grpc_server import GENERATION, _Choices, kv_params_from_proto, kv_params_to_proto, start_grpc_server
from tests.conftest import TINY_ENGINE_OPTIONS

from .conftest import RunningServer, free_port
from .scripted import ScriptedEngine



class GrpcThread:
    """start_grpc_server on an event loop of its own thread, and a blocking client to it."""

    def __init__(self, engine: AsyncEngine, **options) -> None:
        self.engine = engine
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.server = self.run(start_grpc_server(engine, 0, health_poll_s=0.05, **options))
        self.channel = grpc.insecure_channel(f"127.0.0.1:{self.server.port}")
        self.stub = pb_grpc.GenerationStub(self.channel)

    def run(self, coro, timeout: float = 60):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def health(self, service: str = "") -> int:
        return health_pb2_grpc.HealthStub(self.channel).Check(health_pb2.HealthCheckRequest(service=service)).status

    def stop(self) -> None:
        self.channel.close()
        self.run(self.server.stop(1))
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


def request(prompt, *, request_id: str = "", add_special_tokens: bool = False, **sampling) -> pb.GenerateRequest:
    """A GenerateRequest of text or token ids."""
    r = pb.GenerateRequest(request_id=request_id, sampling_params=pb.SamplingParams(**sampling),
                           add_special_tokens=add_special_tokens)
    if isinstance(prompt, str):
        r.text = prompt
    else:
        r.token_ids.ids.extend(prompt)
    return r


def collect(call) -> tuple[dict[int, list[pb.Chunk]], list[pb.Complete], list[str]]:
    """(chunks by choice, Completes, the order of messages as 'chunk i' / 'complete i')."""
    chunks: dict[int, list[pb.Chunk]] = {}
    completes, order = [], []
    for r in call:
        if r.HasField("chunk"):
            chunks.setdefault(r.chunk.index, []).append(r.chunk)
            order.append(f"chunk {r.chunk.index}")
        else:
            completes.append(r.complete)
            order.append(f"complete {r.complete.index}")
    return chunks, completes, order


def joined(chunks: list[pb.Chunk]) -> tuple[list[int], str]:
    return [t for c in chunks for t in c.token_ids], "".join(c.text for c in chunks)


def rpc_error(call) -> grpc.RpcError:
    """The error that ends a streaming call."""
    with pytest.raises(grpc.RpcError) as info:
        list(call)
    return info.value


def wait_until(predicate, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


# ---- the real tiny model, over gRPC and HTTP at once ------------------------------------------


@pytest.fixture(scope="module")
def real(tiny_llm_engine):
    engine = AsyncEngine(tiny_llm_engine, max_num_queued_requests=200)
    g = GrpcThread(engine, served_model_name="tiny")
    http = RunningServer(engine, served_model_name="tiny")     # stopping it shuts the engine down
    yield g, http
    g.stop()
    http.stop()


def engine_output(g: GrpcThread, prompt, params: SamplingParams) -> RequestOutput:
    """The final cumulative output of a direct AsyncEngine call."""
    async def run():
        out = None
        async for out in g.engine.generate(prompt, params):
            pass
        return out
    return g.run(run())


def all_blocks_free(g: GrpcThread) -> bool:
    s = g.engine.stats()
    return s["kv_free_blocks"] == s["kv_total_blocks"] and s["num_unfinished"] == 0


def test_greedy_deltas_join_to_the_http_completion_and_the_engine_output(real):
    g, http = real
    prompt = "Once upon a time"
    ids = g.engine.tokenizer.encode(prompt)
    call = g.stub.Generate(request(prompt, add_special_tokens=True, temperature=0, max_tokens=12, ignore_eos=True,
                                   logprobs=2))
    chunks, (complete,), _ = collect(call)
    tokens, text = joined(chunks[0])
    assert len(chunks[0]) > 1 and list(chunks) == [0]                 # streamed, one choice

    body = {"prompt": prompt, "temperature": 0, "max_tokens": 12, "ignore_eos": True, "logprobs": 2}
    choice = httpx.post(f"{http.url}/v1/completions", json=body, timeout=60).json()["choices"][0]
    direct = engine_output(g, prompt, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=2))
    (c,) = direct.outputs
    assert text == choice["text"] == c.text
    assert tokens == c.token_ids and len(tokens) == 12
    assert complete.index == 0 and complete.finish_reason == "length" and not complete.HasField("stop_reason")
    assert (complete.prompt_tokens, complete.completion_tokens) == (len(ids), 12)
    assert list(complete.prompt_token_ids) == ids
    assert complete.cached_tokens <= len(ids) - 1

    lps = [lp for chunk in chunks[0] for lp in chunk.logprobs]
    assert [lp.token_id for lp in lps] == tokens
    for lp, want, http_lp in zip(lps, c.logprobs, choice["logprobs"]["token_logprobs"]):
        assert lp.logprob == pytest.approx(want[lp.token_id], rel=1e-6) == pytest.approx(http_lp, rel=1e-6)
        best = sorted(want.items(), key=lambda kv: -kv[1])[:2]
        assert [(t.token_id, pytest.approx(t.logprob, rel=1e-6)) for t in lp.top] == best


def test_token_id_input_is_used_as_given(real):
    g, _ = real
    ids = [300, 5, 17, 42, 299, 8]       # no text tokenizes to this: a re-tokenized prompt would differ
    chunks, (complete,), _ = collect(g.stub.Generate(request(ids, temperature=0, max_tokens=6, ignore_eos=True)))
    (c,) = engine_output(g, ids, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)).outputs
    assert joined(chunks[0]) == (c.token_ids, c.text)
    assert list(complete.prompt_token_ids) == ids and complete.prompt_tokens == len(ids)


def test_structured_outputs_constrain_the_stream(real):
    g, _ = real
    choices = ["red apple", "green pear"]
    for seed in range(6):
        chunks, completes, _ = collect(g.stub.Generate(request([5, 6, 7], max_tokens=20, temperature=1.0, seed=seed,
                                                                  structured_outputs=pb.StructuredOutputs(
                                                                      choice=pb.Choices(choices=choices)))))
        assert joined(chunks[0])[1] in choices and completes[0].finish_reason == "stop"
    err = rpc_error(g.stub.Generate(request([5, 6], structured_outputs=pb.StructuredOutputs(regex="[a-"))))
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and "invalid regex" in err.details()


def test_text_input_adds_special_tokens_unless_told_not_to(real, monkeypatch):
    g, _ = real
    seen = []
    encode = g.engine.tokenizer.encode
    monkeypatch.setattr(g.engine.tokenizer, "encode",
                        lambda text, add_special_tokens=True: seen.append(add_special_tokens) or encode(text))
    unset = request("hello", max_tokens=1)
    unset.ClearField("add_special_tokens")
    collect(g.stub.Generate(unset))
    collect(g.stub.Generate(request("hello", max_tokens=1, add_special_tokens=False)))
    assert seen == [True, False]


def test_stop_token_id_is_the_stop_reason(real):
    g, _ = real
    ids = [7, 8, 9, 10]
    greedy, _ = joined(collect(g.stub.Generate(request(ids, temperature=0, max_tokens=8, ignore_eos=True)))[0][0])
    stop = greedy[3]
    chunks, (complete,), _ = collect(g.stub.Generate(request(ids, temperature=0, max_tokens=8, ignore_eos=True,
                                                             stop_token_ids=[stop])))
    assert complete.finish_reason == "stop" and complete.stop_token_id == stop
    assert complete.completion_tokens == greedy.index(stop) + 1 == len(joined(chunks[0])[0])


def test_sampling_controls_reach_the_engine(real):
    g, _ = real
    ids = [7, 8, 9, 10]
    greedy, _ = joined(collect(g.stub.Generate(request(ids, temperature=0, max_tokens=4, ignore_eos=True)))[0][0])
    chunks, _, _ = collect(g.stub.Generate(request(ids, temperature=0, max_tokens=4, ignore_eos=True,
                                                   logit_bias={greedy[0]: -100, 33: 100})))
    assert joined(chunks[0])[0] == [33] * 4 != greedy
    chunks, _, _ = collect(g.stub.Generate(request(ids, temperature=1.0, seed=3, max_tokens=8, ignore_eos=True,
                                                   allowed_token_ids=[40, 41])))
    assert set(joined(chunks[0])[0]) <= {40, 41}
    chunks, _, _ = collect(g.stub.Generate(request(ids, temperature=0, max_tokens=4, ignore_eos=True,
                                                   bad_words=[g.engine.tokenizer.decode([greedy[0]]).strip()])))
    assert greedy[0] not in joined(chunks[0])[0]
    chunks, (complete,), _ = collect(g.stub.Generate(request(list(range(20, 50)), temperature=0, max_tokens=2,
                                                             truncate_prompt_tokens=4)))
    assert complete.prompt_tokens == 4
    # Constraints that leave no token: the request's own fault, as over HTTP (a 400 there).
    choice = pb.StructuredOutputs(choice=pb.Choices(choices=["yes", "no"]))       # not EOS first
    e = rpc_error(g.stub.Generate(request(ids, max_tokens=4, allowed_token_ids=[2], structured_outputs=choice)))
    assert e.code() == grpc.StatusCode.INVALID_ARGUMENT and "no token can be sampled" in e.details()


@pytest.fixture
def slow_steps(real, monkeypatch):
    """The real engine's steps take 20 ms or more, so a 90-token request outlives a short deadline."""
    core = real[0].engine.engine
    step = core.step

    def slow_step():
        time.sleep(0.02)
        return step()
    monkeypatch.setattr(core, "step", slow_step)
    return real


def test_cancel_mid_stream_aborts_the_request_and_frees_its_blocks(slow_steps):
    g, _ = slow_steps
    wait_until(lambda: all_blocks_free(g))
    generated = g.engine.stats()["generation_tokens"]
    call = g.stub.Generate(request([11, 12, 13] * 10, max_tokens=90, ignore_eos=True))
    next(call)
    call.cancel()
    assert rpc_error(call).code() == grpc.StatusCode.CANCELLED
    wait_until(lambda: all_blocks_free(g))
    assert g.engine.stats()["generation_tokens"] - generated < 90      # cut, not finished


def test_a_cancelled_call_retried_with_its_request_id_gets_its_own_tokens(slow_steps):
    # A client's idempotent retry: cancel, then the same request_id at once, on another prompt.
    g, _ = slow_steps
    wait_until(lambda: all_blocks_free(g))
    call = g.stub.Generate(request([11, 12, 13] * 10, request_id="retried", max_tokens=90, ignore_eos=True))
    next(call)
    call.cancel()
    retry = request([31, 32], request_id="retried", temperature=0, max_tokens=5, ignore_eos=True)
    chunks, completes, _ = collect(g.stub.Generate(retry))
    expected = engine_output(g, [31, 32], SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)).outputs[0]
    assert joined(chunks[0])[0] == list(expected.token_ids)
    assert [(c.finish_reason, c.completion_tokens) for c in completes] == [("length", 5)]
    wait_until(lambda: all_blocks_free(g))


def test_deadline_ends_the_call_and_frees_its_blocks(slow_steps):
    g, _ = slow_steps
    generated = g.engine.stats()["generation_tokens"]
    seen = []
    with pytest.raises(grpc.RpcError) as info:
        for r in g.stub.Generate(request([21, 22, 23] * 10, max_tokens=90, ignore_eos=True), timeout=0.5):
            seen.append(r)
    assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert seen and all(r.HasField("chunk") for r in seen)          # it ran, and was cut mid-stream
    wait_until(lambda: all_blocks_free(g))
    assert g.engine.stats()["generation_tokens"] - generated < 90


def test_model_and_server_info(real):
    g, _ = real
    info = g.stub.GetModelInfo(pb.GetModelInfoRequest())
    core = g.engine.engine
    assert info.served_model_name == "tiny" and info.model_name == g.engine.model_name
    assert (info.max_model_len, info.vocab_size, info.block_size) == (128, 512, core.config.block_size)
    assert info.max_logprobs == 20 and list(info.eos_token_ids) == [2]
    assert info.compat_hash == core.compat_hash != ""
    wait_until(lambda: all_blocks_free(g))
    s = g.stub.GetServerInfo(pb.GetServerInfoRequest())
    stats = g.engine.stats()
    assert s.healthy and s.kv_role == "" and (s.num_running, s.num_waiting, s.num_exports) == (0, 0, 0)
    assert s.kv_total_blocks == stats["kv_total_blocks"] > 0 and s.kv_free_blocks == s.kv_total_blocks
    assert s.kv_usage == stats["kv_usage"]


@pytest.mark.parametrize("sampling,body", [
    (dict(temperature=-1), {"temperature": -1}),
    (dict(top_p=1.5), {"top_p": 1.5}),
    (dict(max_tokens=200), {"max_tokens": 200}),          # past max_model_len: both numbers in the message
    (dict(max_tokens=0), {"max_tokens": 0}),
    (dict(n=0), {"n": 0}),
    (dict(logprobs=21), {"logprobs": 21}),                # past --max-logprobs
    (dict(stop_token_ids=[600]), {"stop_token_ids": [600]}),   # outside the vocabulary: the engine's check
    (dict(stop=["x" * 300]), {"stop": ["x" * 300]}),
], ids=["temperature", "top_p", "max_tokens_past_the_context", "max_tokens_0", "n_0", "logprobs", "stop_token_ids",
        "stop_string_length"])
def test_invalid_arguments_carry_the_http_400_message(real, sampling, body):
    g, http = real
    e = rpc_error(g.stub.Generate(request([5, 6, 7], **sampling)))
    r = httpx.post(f"{http.url}/v1/completions", json={"prompt": [5, 6, 7], **body}, timeout=60)
    assert r.status_code == 400
    assert e.code() == grpc.StatusCode.INVALID_ARGUMENT and e.details() == r.json()["error"]["message"]


@pytest.mark.parametrize("req,message", [
    (request([]), "prompt must not be empty"),
    (request(""), "prompt must not be empty"),
    (pb.GenerateRequest(), "prompt: Field required"),
    (request([600]), "prompt token id 600 is out of range [0, 512)"),
], ids=["no_token_ids", "empty_text", "no_input", "token_out_of_vocab"])
def test_bad_prompts_are_invalid_arguments(real, req, message):
    e = rpc_error(real[0].stub.Generate(req))
    assert e.code() == grpc.StatusCode.INVALID_ARGUMENT and e.details() == message


def test_health_serving_and_reflection_lists_the_services(real):
    g, _ = real
    assert g.health() == g.health(GENERATION) == health_pb2.HealthCheckResponse.SERVING
    db = ProtoReflectionDescriptorDatabase(g.channel)
    assert set(db.get_services()) >= {"jaxserve.v1.Generation", "grpc.health.v1.Health"}
    assert "jaxserve.v1.KVTransfer" not in db.get_services()          # producers only
    assert db.FindFileContainingSymbol("jaxserve.v1.Generation").name == "jaxserve/proto/jaxserve.proto"


def test_a_producer_serves_kv_transfer_and_returns_its_export(tiny_models):
    engine = AsyncEngine(LLMEngine.from_kwargs(str(tiny_models["llama"]), **TINY_ENGINE_OPTIONS, kv_role="producer"))
    g = GrpcThread(engine)
    try:
        assert "jaxserve.v1.KVTransfer" in ProtoReflectionDescriptorDatabase(g.channel).get_services()
        req = request(list(range(5, 45)), max_tokens=1)
        req.kv_transfer_params.CopyFrom(pb.KVTransferParams(role=pb.KV_ROLE_PRODUCE, transfer_id="t-1"))
        _, (complete,), _ = collect(g.stub.Generate(req))
        kv = kv_params_from_proto(complete.kv_transfer_params)
        assert (kv.transfer_id, kv.num_full_blocks, len(kv.block_hashes)) == ("t-1", 2, 2)   # 40 tokens, blocks of 16
        assert kv.compat_hash == g.stub.GetModelInfo(pb.GetModelInfoRequest()).compat_hash != ""
        info = g.stub.GetServerInfo(pb.GetServerInfoRequest())
        assert (info.kv_role, info.num_exports) == ("producer", 1)
        assert pb_grpc.KVTransferStub(g.channel).Release(pb.LeaseRequest(transfer_id="t-1")).found
        assert g.stub.GetServerInfo(pb.GetServerInfoRequest()).num_exports == 0
    finally:
        g.stop()
        engine.shutdown()


# ---- the scripted engine: outputs worked out by hand ------------------------------------------


def scripted_engine(tok, words, **kw) -> ScriptedEngine:
    """Completion i generates 3 * (i + 1) of `words` (all of them for a prompt starting with 99)."""
    def script(prompt_ids, i):
        return list(words) if prompt_ids[0] == 99 else words[:3 * (i + 1)]
    engine = ScriptedEngine(tok, script, **kw)
    engine.config = types.SimpleNamespace(max_logprobs=20, block_size=16, kv_role=None)
    engine.exports = None
    return engine


def scripted_server(tok, words, *, max_num_queued_requests=None, **kw) -> tuple[ScriptedEngine, GrpcThread]:
    engine = scripted_engine(tok, words, **kw)
    return engine, GrpcThread(AsyncEngine(engine, max_num_queued_requests=max_num_queued_requests))


@pytest.fixture
def scripted(tok, words):
    engine, g = scripted_server(tok, words, step_delay_s=0.01)
    yield engine, g
    g.stop()
    g.engine.shutdown()


def test_n2_choices_finish_at_different_steps_each_with_one_complete(scripted, tok, words):
    _, g = scripted
    chunks, completes, order = collect(g.stub.Generate(request([5, 6], n=2, max_tokens=50)))
    for i in (0, 1):
        assert joined(chunks[i]) == (words[:3 * (i + 1)], tok.decode(words[:3 * (i + 1)]))
    assert [(c.index, c.finish_reason, c.completion_tokens, c.prompt_tokens) for c in completes] == \
        [(0, "length", 3, 2), (1, "length", 6, 2)]
    # One token per step: choice 0 completes after its third chunk, while choice 1 goes on.
    assert order.index("complete 0") < [i for i, m in enumerate(order) if m == "chunk 1"][3]
    assert order[-1] == "complete 1"


def test_stop_string_is_the_stop_reason(scripted, tok, words):
    _, g = scripted
    assert tok.decode(words[:6]) == " one two"
    chunks, completes, _ = collect(g.stub.Generate(request([5, 6], n=2, max_tokens=50, stop=["tw"])))
    assert [(c.finish_reason, c.WhichOneof("stop_reason")) for c in completes] == \
        [("length", None), ("stop", "stop_string")]
    assert completes[1].stop_string == "tw"
    assert [joined(chunks[i])[1] for i in (0, 1)] == [" one", " one "]


def test_abort_by_id_ends_every_choice_with_abort(scripted):
    engine, g = scripted
    call = g.stub.Generate(request([99], request_id="job-1", n=2, max_tokens=12))
    first = next(call)
    assert first.HasField("chunk")
    assert g.stub.Abort(pb.AbortRequest(request_id="job-1")).found
    _, completes, _ = collect(call)                                   # the call ends OK
    assert sorted((c.index, c.finish_reason) for c in completes) == [(0, "abort"), (1, "abort")]
    assert all(c.completion_tokens < 12 for c in completes)
    wait_until(lambda: "job-1" in engine.aborted and g.engine.num_in_flight == 0)
    assert not g.stub.Abort(pb.AbortRequest(request_id="job-1")).found
    assert not g.stub.Abort(pb.AbortRequest(request_id="never-seen")).found


def test_a_request_id_in_use_is_an_invalid_argument(scripted):
    _, g = scripted
    call = g.stub.Generate(request([99], request_id="dup", max_tokens=12))
    next(call)
    e = rpc_error(g.stub.Generate(request([5], request_id="dup")))
    assert e.code() == grpc.StatusCode.INVALID_ARGUMENT and e.details() == "request id 'dup' is already in use"
    call.cancel()


def test_queue_limit_is_resource_exhausted(tok, words):
    _, g = scripted_server(tok, words, max_num_queued_requests=1, step_delay_s=0.01)
    try:
        call = g.stub.Generate(request([99], max_tokens=12))
        next(call)
        e = rpc_error(g.stub.Generate(request([5])))
        assert e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "(--max-num-queued-requests) is 1" in e.details()
        e = rpc_error(g.stub.Generate(request([5], n=2)))     # could never fit: the client's error
        assert e.code() == grpc.StatusCode.INVALID_ARGUMENT and "the server queues at most 1" in e.details()
        call.cancel()
    finally:
        g.stop()
        g.engine.shutdown()


def test_engine_death_is_unavailable_and_health_not_serving(tok, words):
    _, g = scripted_server(tok, words, fail_at_step=2)
    try:
        call = g.stub.Generate(request([5], max_tokens=12))
        e = rpc_error(call)
        assert e.code() == grpc.StatusCode.UNAVAILABLE
        assert e.details() == "the engine step failed (RuntimeError; details in the server log)"
        wait_until(lambda: g.health() == health_pb2.HealthCheckResponse.NOT_SERVING, timeout=5)
        assert g.health(GENERATION) == health_pb2.HealthCheckResponse.NOT_SERVING
        e = rpc_error(g.stub.Generate(request([5])))
        assert e.code() == grpc.StatusCode.UNAVAILABLE and e.details() == "the engine is not running"
        assert not g.stub.GetServerInfo(pb.GetServerInfoRequest()).healthy
    finally:
        g.stop()


def test_serve_exits_1_when_the_engine_dies_under_a_grpc_call(tok, words, monkeypatch):
    """serve() itself (in this main thread, as the CLI runs it) over a scripted engine whose first
    step fails: the gRPC caller gets UNAVAILABLE, both servers stop and serve() returns 1."""
    engine = scripted_engine(tok, words, fail_at_step=1)
    monkeypatch.setattr(AsyncEngine, "from_config", classmethod(lambda cls, config, **kw: cls(engine, **kw)))
    grpc_port, codes = free_port(), []

    def client():
        with grpc.insecure_channel(f"127.0.0.1:{grpc_port}", options=[("grpc.max_reconnect_backoff_ms", 100)]) as ch:
            grpc.channel_ready_future(ch).result(timeout=60)
            codes.append(rpc_error(pb_grpc.GenerationStub(ch).Generate(request([5]))).code())
    thread = threading.Thread(target=client)
    thread.start()
    previous = signal.getsignal(signal.SIGTERM)
    try:
        assert serve(EngineConfig(), port=free_port(), grpc_port=grpc_port, step_timeout_s=None) == 1
    finally:
        signal.signal(signal.SIGTERM, previous)
        thread.join(30)
    assert codes == [grpc.StatusCode.UNAVAILABLE]


@pytest.mark.parametrize("error,code,message", [
    (IncompatibleKVError("the producer's block_size 32 differs from ours (16)"), grpc.StatusCode.FAILED_PRECONDITION,
     "the producer's block_size 32 differs from ours (16)"),
    (UnknownTransferError("no export 't-1' (pulled, released or expired)"), grpc.StatusCode.NOT_FOUND,
     "no export 't-1' (pulled, released or expired)"),
    (QueueFullError("full"), grpc.StatusCode.RESOURCE_EXHAUSTED, "full"),
    (ValueError("bad"), grpc.StatusCode.INVALID_ARGUMENT, "bad"),
    (ZeroDivisionError("secret detail"), grpc.StatusCode.INTERNAL, "internal error (request id r-1)"),
], ids=["incompatible_kv", "unknown_transfer", "queue_full", "value_error", "unexpected"])
def test_engine_errors_map_to_status_codes(scripted, monkeypatch, error, code, message):
    _, g = scripted

    async def add_request(*args, **kwargs):
        raise error
    monkeypatch.setattr(g.engine, "add_request", add_request)
    e = rpc_error(g.stub.Generate(request([5], request_id="r-1")))
    assert e.code() == code and e.details() == message


def test_kv_transfer_params_reach_the_engine(scripted, monkeypatch):
    _, g = scripted
    seen = {}

    async def add_request(prompt, params, request_id, **kwargs):
        seen.update(kwargs)
        raise ValueError("stop here")
    monkeypatch.setattr(g.engine, "add_request", add_request)
    req = request([5, 6])
    req.cache_salt = "tenant-a"
    req.priority = 3
    req.kv_transfer_params.CopyFrom(pb.KVTransferParams(role=pb.KV_ROLE_CONSUME, transfer_id="t-9",
                                                        producer_address="127.0.0.1:7000", num_full_blocks=1,
                                                        block_hashes=[b"\x01" * 8], block_size=16,
                                                        compat_hash="abc", lease_seconds=5))
    rpc_error(g.stub.Generate(req))
    assert seen == {"cache_salt": "tenant-a", "priority": 3,
                    "kv_transfer": KVTransferParams(role="consume", transfer_id="t-9", producer_address="127.0.0.1:7000",
                                                    num_full_blocks=1, block_hashes=[b"\x01" * 8], block_size=16,
                                                    compat_hash="abc", lease_seconds=5.0)}
    seen.clear()
    rpc_error(g.stub.Generate(request([5, 6])))
    assert seen == {"cache_salt": None, "priority": 0, "kv_transfer": None}       # an ordinary request


# ---- conversions ------------------------------------------------------------------------------


def test_kv_params_round_trip_and_checks():
    params = KVTransferParams(role="produce", transfer_id="t-1", num_full_blocks=2, block_hashes=[b"a", b"b"],
                              block_size=16, compat_hash="h", lease_seconds=30.0)
    proto = kv_params_to_proto(params)
    assert proto.role == pb.KV_ROLE_PRODUCE and list(proto.block_hashes) == [b"a", b"b"]
    assert kv_params_from_proto(pb.KVTransferParams.FromString(proto.SerializeToString())) == params
    assert kv_params_from_proto(pb.KVTransferParams()) is None          # role unset: an ordinary request
    assert kv_params_to_proto(KVTransferParams()).role == pb.KV_ROLE_UNSPECIFIED
    with pytest.raises(ValueError, match="needs the producer's address"):
        kv_params_from_proto(pb.KVTransferParams(role=pb.KV_ROLE_CONSUME, transfer_id="t"))
    with pytest.raises(ValueError, match="role=7 is not a KVRole"):
        kv_params_from_proto(pb.KVTransferParams(role=7, transfer_id="t"))


def test_complete_carries_a_producers_export_and_logprobs_chunks():
    kv = KVTransferParams(role="produce", transfer_id="t-2", num_full_blocks=1, block_hashes=[b"h"], block_size=16)
    choices = _Choices(1, [4, 5, 6], top_logprobs=1)
    out = RequestOutput("r", None, [4, 5, 6], [CompletionOutput(0, "x", [9], logprobs=[{3: -0.1, 9: -2.0}],
                                                               finish_reason="length")],
                        finished=True, num_cached_tokens=2, kv_transfer_params=kv)
    chunk, complete = choices.responses(out)
    lp = chunk.chunk.logprobs[0]
    assert (lp.token_id, lp.logprob, [(t.token_id, t.logprob) for t in lp.top]) == (9, -2.0, [(3, pytest.approx(-0.1))])
    assert kv_params_from_proto(complete.complete.kv_transfer_params) == kv
    assert (complete.complete.cached_tokens, complete.complete.completion_tokens) == (2, 1)


# ---- the serve flags and the process ------------------------------------------------------------


def test_kv_role_needs_a_grpc_port(capsys):
    assert cli_main(["serve", "--kv-role", "consumer"]) == 2
    assert "--kv-role consumer needs --grpc-port" in capsys.readouterr().err


def test_serve_flags_reach_the_engine_config():
    def config(*flags):
        return engine_config(build_parser().parse_args(["serve", *flags]))
    c = config("--kv-role", "producer", "--grpc-port", "7000", "--kv-lease-seconds", "5",
               "--kv-load-failure-policy", "fail")
    assert (c.kv_role, c.kv_lease_seconds, c.kv_load_failure_policy) == ("producer", 5.0, "fail")
    assert (config().kv_role, config().data_parallel_size) == (None, 1)
    assert config("--data-parallel-size-local", "2").data_parallel_size == 2
    assert config("-dp", "2", "-dpl", "2").data_parallel_size == 2
    with pytest.raises(ValueError, match="--data-parallel-size-local=2 differs from --data-parallel-size=4"):
        config("-dp", "4", "-dpl", "2")


def test_sigterm_drains_grpc_streams_then_exits_0(tiny_models):
    """Six 120-token streams run one at a time (--max-num-seqs 1); SIGTERM after the first chunk:
    the server stops taking calls (health fails) yet streams on until every one is complete."""
    port, grpc_port = free_port(), free_port()
    proc = subprocess.Popen([sys.executable, "-m", "jaxserve.cli", "serve", str(tiny_models["llama"]),
                             "--port", str(port), "--grpc-port", str(grpc_port), "--max-model-len", "128",
                             "--num-kv-blocks", "64", "--max-num-batched-tokens", "16", "--max-num-seqs", "1",
                             "--token-buckets", "4,16"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    results: list[list[tuple[float, pb.GenerateResponse]]] = [[] for _ in range(6)]
    try:
        # Retry the connection every 250 ms while the server starts (not grpc's growing backoff).
        with grpc.insecure_channel(f"127.0.0.1:{grpc_port}", options=[("grpc.max_reconnect_backoff_ms", 250)]) \
                as channel:
            grpc.channel_ready_future(channel).result(timeout=300)
            health = health_pb2_grpc.HealthStub(channel)
            assert health.Check(health_pb2.HealthCheckRequest(), timeout=10).status == \
                health_pb2.HealthCheckResponse.SERVING
            stub = pb_grpc.GenerationStub(channel)

            def run(i):
                for r in stub.Generate(request([5, 6, 7], max_tokens=120, ignore_eos=True)):
                    results[i].append((time.monotonic(), r))
            threads = [threading.Thread(target=run, args=(i,)) for i in range(6)]
            for t in threads:
                t.start()
            wait_until(lambda: any(results))
            proc.send_signal(signal.SIGTERM)

            def refused() -> bool:
                try:
                    return health.Check(health_pb2.HealthCheckRequest(), timeout=1).status != \
                        health_pb2.HealthCheckResponse.SERVING
                except grpc.RpcError:
                    return True
            wait_until(refused)
            stopping = time.monotonic()
            for t in threads:
                t.join(60)
        for messages in results:
            *_, (_, last) = messages
            assert last.complete.finish_reason == "length" and last.complete.completion_tokens == 120
        assert max(at for messages in results for at, _ in messages) > stopping    # drained, not cut
        assert proc.wait(timeout=60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
    assert f"127.0.0.1:{grpc_port}" in proc.stdout.read()
