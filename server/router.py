"""`jaxserve router`: the OpenAI HTTP API of `jaxserve serve`, run as prefill on a producer
instance and decode on a consumer instance (disaggregated prefill/decode).

The router holds no weights, only the model's tokenizer: `create_app(RouterEngine)` validates
bodies, renders chat templates and tokenizes exactly as a single server does, and
RouterEngine provides the engine surface create_app uses (`add_request` -> a stream of
RequestOutputs) over the instances' gRPC API (jaxserve/proto). A request runs in two legs:

1. prefill: a producer (round robin, skipping one that failed in the last few seconds) runs
   the prompt with max_tokens=1 under kv role PRODUCE and exports its full KV blocks;
2. decode: the least loaded serving consumer runs the whole request under kv role CONSUME
   with the producer's KVTransferParams: it pulls the blocks from the producer, computes the
   rest and streams deltas, which become DELTA or FINAL_ONLY RequestOutputs here.

A producer that fails (unreachable, overloaded, broken), or a prompt with no full KV block to
ship, runs decode-only on a consumer; jaxserve:router_requests_total{path} counts both paths.
A client that leaves before the consumer answers gets the export released on the producer;
one that leaves later cancels the consumer's call, which aborts the request there. Consumer
errors become the errors AsyncEngine raises, so clients get what a single server sends.

Everything runs on the HTTP server's event loop: the grpc.aio channels, both legs of every
request, and a task that polls each instance's health and load. server.router_stream turns
the consumer's messages into RequestOutputs.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import signal
import time
import uuid
from types import SimpleNamespace

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client.core import CounterMetricFamily

from checkpoints import load_checkpoint
from jaxserve.core import RequestOutputKind, SamplingParams, StructuredOutputsParams
from jaxserve.core.sampling_params import sampling_defaults
from jaxserve.engine.async_engine import EngineDeadError
from jaxserve.outputs import RequestMetrics
from jaxserve.proto import jaxserve_pb2 as pb
from jaxserve.proto import jaxserve_pb2_grpc as pb_grpc
from jaxserve.tokenizer import Tokenizer
from server.app import create_app
from server.router_stream import OutputAssembler, RouterStream, read_message

logger = logging.getLogger(__name__)

PATHS = ("disaggregated", "decode_only")
# vLLM's names, as SamplingParams's; the scalar, list and map ones copy by name, structured_outputs is converted.
_PROTO_FIELDS = tuple(n for n in pb.SamplingParams.DESCRIPTOR.fields_by_name if n != "structured_outputs")
PRODUCER_RETRY_S = 5.0     # a producer that failed a request gets none for this long
_RPC_TIMEOUT_S = 5.0       # polls and releases


class _Instance:
    """One `jaxserve serve --grpc-port` instance: its stubs, and its health and load as last polled."""

    def __init__(self, address: str, flag: str) -> None:
        host, _, port = address.rpartition(":")
        if not host or not port.isdigit():
            raise ValueError(f"--{flag} {address!r} is not HOST:PORT")
        self.address, self.flag = address, flag
        self.channel = grpc.aio.insecure_channel(address)
        self.generation = pb_grpc.GenerationStub(self.channel)
        self.kv = pb_grpc.KVTransferStub(self.channel)
        self.health = health_pb2_grpc.HealthStub(self.channel)
        self.model_info = pb.ModelInfo()
        self.server_info: pb.ServerInfo | None = None    # None while it does not answer
        self.serving = False
        self.down_until = 0.0           # monotonic time before which it gets no request (producers)
        self.in_flight = 0              # requests the router runs on it now

    def __str__(self) -> str:
        return f"{self.flag} instance {self.address}"

    async def describe(self, timeout_s: float) -> None:
        """Fetch ModelInfo and ServerInfo at start-up, waiting up to `timeout_s` for the instance to listen."""
        try:
            self.model_info = await self.generation.GetModelInfo(pb.GetModelInfoRequest(), timeout=timeout_s,
                                                                 wait_for_ready=True)
            self.server_info = await self.generation.GetServerInfo(pb.GetServerInfoRequest(), timeout=timeout_s)
        except grpc.aio.AioRpcError as e:
            raise ValueError(f"{self} did not answer GetModelInfo within {timeout_s:g} s ({e.code().name}: "
                             f"{e.details()}); is `jaxserve serve --grpc-port` running there?") from None

    async def poll(self) -> None:
        """Refresh `serving` (the gRPC health check of the whole server) and `server_info`."""
        try:
            health = await self.health.Check(health_pb2.HealthCheckRequest(), timeout=_RPC_TIMEOUT_S)
            info = await self.generation.GetServerInfo(pb.GetServerInfoRequest(), timeout=_RPC_TIMEOUT_S)
            serving = health.status == health_pb2.HealthCheckResponse.SERVING
        except grpc.aio.AioRpcError as e:
            info, serving = None, False
            if self.serving:
                logger.warning("%s stopped answering: %s: %s", self, e.code().name, e.details())
        if serving != self.serving:
            logger.log(logging.INFO if serving else logging.WARNING, "%s is %s", self,
                       "serving" if serving else "not serving")
        self.server_info, self.serving = info, serving


class _ProducerFailed(Exception):
    """The prefill leg failed for a reason other than the request itself: run it decode-only."""


def load_tokenizer(model: str | None) -> tuple[Tokenizer, int]:
    """The tokenizer of `model` (None: the default model) and the model's vocabulary size, without its weights."""
    tokenizer, vocab_size, _ = load_model_files(model)
    return tokenizer, vocab_size


def load_model_files(model: str | None, generation_config: str = "auto") -> tuple[Tokenizer, int, dict]:
    """load_tokenizer's, and the model's sampling defaults (jaxserve.core.sampling_params.sampling_defaults):
    the router fills in the fields a request leaves out, as a single server does, and sends the instances
    every field."""
    checkpoint = load_checkpoint(model)
    tokenizer = Tokenizer.from_checkpoint(checkpoint)
    return (tokenizer, int(checkpoint.config.get("vocab_size", tokenizer.vocab_size)),
            sampling_defaults(checkpoint.generation_config, generation_config))


def check_instances(producers: list[_Instance], consumers: list[_Instance], vocab_size: int) -> None:
    """Refuse to start over instances that cannot serve together, naming the two that disagree."""
    # Without producers the router only spreads requests: its decode instances may be ordinary ones.
    decode_roles = ("consumer",) if producers else ("consumer", "")
    for inst, roles in [(p, ("producer",)) for p in producers] + [(c, decode_roles) for c in consumers]:
        if inst.server_info.kv_role not in roles:
            role = roles[0]
            raise ValueError(f"{inst} runs with kv role {inst.server_info.kv_role or 'none'!r}; `jaxserve router "
                             f"--{inst.flag}` needs an instance started with --kv-role {role}")
    first = consumers[0].model_info
    for other in consumers[1:]:
        for field in ("served_model_name", "model_name", "max_model_len", "vocab_size", "max_logprobs", "block_size",
                      "compat_hash"):
            if getattr(other.model_info, field) != getattr(first, field):
                raise ValueError(f"{consumers[0]} and {other} disagree on {field} ({getattr(first, field)!r} vs "
                                 f"{getattr(other.model_info, field)!r}): every --decode instance must serve the same "
                                 "model with the same settings")
    for p in producers:
        if p.model_info.compat_hash != first.compat_hash:
            raise ValueError(f"FAILED_PRECONDITION: {p} and {consumers[0]} report different compat_hash "
                             f"({p.model_info.compat_hash!r} vs {first.compat_hash!r}): their KV blocks are not "
                             "interchangeable; start both with the same model, --dtype and --block-size")
        if p.model_info.max_model_len < first.max_model_len:
            raise ValueError(f"{p} has max_model_len {p.model_info.max_model_len}, less than the "
                             f"{first.max_model_len} of {consumers[0]}: it would refuse prompts the router accepts")
    if first.vocab_size != vocab_size:
        raise ValueError(f"{consumers[0]} serves a model with a vocabulary of {first.vocab_size}, but the router's "
                         f"MODEL has {vocab_size}: give `jaxserve router` the MODEL the instances serve")


class RouterEngine:
    """The engine surface create_app uses, served by producer and consumer instances over gRPC.

    Build it with `await RouterEngine.connect(...)` on the event loop that serves it.
    """

    def __init__(self, tokenizer: Tokenizer, producers: list[_Instance], consumers: list[_Instance], *,
                 poll_interval_s: float = 1.0) -> None:
        info = consumers[0].model_info
        self.tokenizer = tokenizer
        self.model_name = info.model_name
        self.served_model_name = info.served_model_name or info.model_name
        self.max_model_len = info.max_model_len
        self.vocab_size = info.vocab_size
        self.block_size = info.block_size
        self.sampling_defaults: dict = {}     # the model's (serve_router sets them), as an LLMEngine's
        # What create_app reads from an LLMEngine on a single server.
        self.engine = SimpleNamespace(config=SimpleNamespace(max_logprobs=info.max_logprobs),
                                      model_config=SimpleNamespace(vocab_size=info.vocab_size))
        self.producers, self.consumers = producers, consumers
        self.poll_interval_s = poll_interval_s
        self.requests_by_path = dict.fromkeys(PATHS, 0)
        # Router-side counters for create_app's metrics; ServerInfo has no preemption or compile counts.
        self.counters = dict.fromkeys(("prompt_tokens", "generation_tokens", "prefix_cache_queries",
                                       "prefix_cache_hits", "num_preemptions", "compiles_after_warmup"), 0)
        self.num_in_flight = 0
        self._turn = {"prefill": 0, "decode": 0}     # round-robin positions
        self._stopping = False
        self._poller: asyncio.Task | None = None
        self._releases: set[asyncio.Task] = set()

    @classmethod
    async def connect(cls, tokenizer: Tokenizer, vocab_size: int, prefill: list[str], decode: list[str], *,
                      startup_timeout_s: float = 600.0, poll_interval_s: float = 1.0) -> "RouterEngine":
        """Reach every instance (waiting up to `startup_timeout_s` for each), check they can serve together,
        and start polling them. Raises ValueError naming the instance at fault."""
        if not decode:
            raise ValueError("the router needs at least one --decode instance (--prefill ones are optional: without "
                             "them every request runs whole on a decode instance)")
        producers = [_Instance(a, "prefill") for a in prefill]
        consumers = [_Instance(a, "decode") for a in decode]
        instances = [*producers, *consumers]
        try:
            logger.info("waiting for %s", ", ".join(str(i) for i in instances))
            await asyncio.gather(*(i.describe(startup_timeout_s) for i in instances))
            check_instances(producers, consumers, vocab_size)
            engine = cls(tokenizer, producers, consumers, poll_interval_s=poll_interval_s)
            await engine._poll()
        except BaseException:
            await asyncio.gather(*(i.channel.close() for i in instances))
            raise
        engine._poller = asyncio.ensure_future(engine._poll_forever())
        return engine

    @property
    def instances(self) -> list[_Instance]:
        return [*self.producers, *self.consumers]

    # ---- health and load ---------------------------------------------------------------

    @property
    def is_healthy(self) -> bool:
        """Serving while at least one decode instance passes its health check."""
        return not self._stopping and any(c.serving for c in self.consumers)

    async def _poll(self) -> None:
        await asyncio.gather(*(i.poll() for i in self.instances))

    async def _poll_forever(self) -> None:
        while True:
            await asyncio.sleep(self.poll_interval_s)
            await self._poll()

    def stats(self) -> dict[str, float]:
        """The instances' load summed (kv_usage: their mean), as last polled, plus the router's own counts."""
        infos = [i.server_info for i in self.instances if i.server_info is not None]
        return {"num_running": sum(i.num_running for i in infos), "num_waiting": sum(i.num_waiting for i in infos),
                "kv_usage": sum(i.kv_usage for i in infos) / len(infos) if infos else 0.0,
                "kv_free_blocks": sum(i.kv_free_blocks for i in infos),
                "kv_total_blocks": sum(i.kv_total_blocks for i in infos),
                "num_in_flight": self.num_in_flight, "num_unfinished": self.num_in_flight, **self.counters}

    def check_room(self, num_sequences: int) -> None:
        """No queue here: each instance refuses what it cannot queue (RESOURCE_EXHAUSTED, a 503)."""

    def shutdown(self) -> None:
        """Stop polling and refuse new requests (create_app calls this once uvicorn has drained)."""
        self._stopping = True
        if self._poller is not None:
            self._poller.cancel()

    async def aclose(self) -> None:
        """shutdown(), then wait for pending releases and close the channels."""
        self.shutdown()
        await asyncio.gather(*self._releases, return_exceptions=True)
        await asyncio.gather(*(i.channel.close() for i in self.instances))

    # ---- requests ----------------------------------------------------------------------

    async def add_request(self, prompt: dict, params: SamplingParams, request_id: str | None = None, *,
                          priority: int = 0, cache_salt: str | None = None) -> RouterStream:
        """Run the prefill leg, start the decode leg and wait for its first output; returns the stream.

        `prompt` is create_app's {"prompt": text | None, "prompt_token_ids": ids}. Raises what
        AsyncEngine.add_request raises: ValueError for a bad request, QueueFullError when the consumer's
        queue is full, EngineDeadError when no consumer can take it.
        """
        if self._stopping:
            raise EngineDeadError("the router is shutting down")
        request_id = request_id or uuid.uuid4().hex
        ids = list(prompt["prompt_token_ids"])
        params = self._checked(ids, params)
        metrics = RequestMetrics(time.monotonic())
        self.num_in_flight += 1
        try:
            producer = self._pick_producer() if (len(ids) - 1) // self.block_size > 0 else None
            kv, cached = None, None
            if producer is not None:
                try:
                    kv, cached = await self._prefill(producer, request_id, ids, params, cache_salt, priority)
                except _ProducerFailed as e:
                    producer.down_until = time.monotonic() + PRODUCER_RETRY_S
                    logger.warning("%s failed request %s (%s); it runs decode-only, and the producer gets no "
                                   "request for %g s", producer, request_id, e, PRODUCER_RETRY_S)
            outputs = OutputAssembler(request_id, prompt.get("prompt"), ids, params, metrics, cached)
            try:
                stream = await self._decode(request_id, ids, params, cache_salt, kv, outputs, priority)
            except BaseException:
                if kv is not None:      # the consumer may never pull it: do not leave it to the lease
                    self._release_soon(producer, kv.transfer_id)
                raise
        except BaseException:
            self.num_in_flight -= 1
            raise
        self.requests_by_path["disaggregated" if kv is not None else "decode_only"] += 1
        return stream

    def _checked(self, ids: list[int], params: SamplingParams) -> SamplingParams:
        """The engine's own checks of what the gRPC API cannot carry (same messages as LLMEngine's)."""
        bad = [t for t in ids if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"prompt token id {bad[0]} is out of range [0, {self.vocab_size})")
        uncarried = _uncarried(params)
        if uncarried:
            raise ValueError(f"{', '.join(uncarried)} is not available through `jaxserve router`: the gRPC API between "
                             "the router and the instances does not carry it")
        if params.output_kind == RequestOutputKind.CUMULATIVE:
            raise ValueError("the router hands out DELTA or FINAL_ONLY outputs, not CUMULATIVE")
        if params.max_tokens is None:    # until the context is full; the proto's unset max_tokens means 16
            params = params.clone(max_tokens=self.max_model_len - len(ids))
        return params

    def _pick_producer(self) -> _Instance | None:
        """The next producer in turn that is serving and has not failed lately; None if there is none."""
        now, n = time.monotonic(), len(self.producers)
        for _ in range(n):
            p = self.producers[self._turn["prefill"] % n]
            self._turn["prefill"] += 1
            if p.serving and now >= p.down_until:
                return p
        return None

    def _pick_consumer(self) -> _Instance:
        """The serving consumer with the fewest requests from this router (ties: round robin)."""
        k = self._turn["decode"] % len(self.consumers)
        self._turn["decode"] += 1
        serving = [c for c in self.consumers[k:] + self.consumers[:k] if c.serving]
        if not serving:
            raise EngineDeadError("no decode instance is serving")
        return min(serving, key=lambda c: c.in_flight)

    async def _prefill(self, producer: _Instance, request_id: str, ids: list[int], params: SamplingParams,
                       cache_salt: str | None, priority: int = 0) -> tuple[pb.KVTransferParams, int]:
        """Leg 1: the prompt prefilled on `producer`, its KV blocks exported; returns (the export, cached tokens).

        Raises ValueError if the producer refuses the request as invalid, _ProducerFailed on any other failure.
        """
        transfer_id = uuid.uuid4().hex
        one_token = params.clone(n=1, max_tokens=1, min_tokens=0, stop=[], logprobs=None, structured_outputs=None)
        call = producer.generation.Generate(_generate_request(
            f"{request_id}-prefill", ids, one_token, cache_salt,
            pb.KVTransferParams(role=pb.KV_ROLE_PRODUCE, transfer_id=transfer_id), priority))
        complete = None
        try:
            async for msg in call:      # to the end of the stream: cancelling early could drop the export
                if msg.WhichOneof("response") == "complete":
                    complete = msg.complete
        except grpc.aio.AioRpcError as e:
            if e.code() == grpc.StatusCode.INVALID_ARGUMENT:
                raise ValueError(e.details()) from None
            raise _ProducerFailed(f"{e.code().name}: {e.details()}") from None
        except asyncio.CancelledError:  # the client left: the export may exist already
            call.cancel()
            self._release_soon(producer, transfer_id)
            raise
        kv = complete.kv_transfer_params if complete is not None else None
        if kv is None or kv.role != pb.KV_ROLE_PRODUCE or kv.transfer_id != transfer_id:
            raise _ProducerFailed(f"no KV export in its answer (finish_reason "
                                  f"{complete.finish_reason if complete else None!r})")
        return pb.KVTransferParams(role=pb.KV_ROLE_CONSUME, transfer_id=transfer_id,
                                   producer_address=producer.address, num_full_blocks=kv.num_full_blocks,
                                   block_hashes=kv.block_hashes, block_size=kv.block_size,
                                   compat_hash=kv.compat_hash, lease_seconds=kv.lease_seconds), complete.cached_tokens

    async def _decode(self, request_id: str, ids: list[int], params: SamplingParams, cache_salt: str | None,
                      kv: pb.KVTransferParams | None, outputs: OutputAssembler, priority: int = 0) -> RouterStream:
        """Leg 2: the request on a consumer (pulling `kv` when given), once its first message arrived."""
        consumer = self._pick_consumer()
        call = consumer.generation.Generate(_generate_request(request_id, ids, params, cache_salt, kv, priority))
        consumer.in_flight += 1
        try:
            first = await read_message(call, consumer)
        except BaseException:
            call.cancel()
            consumer.in_flight -= 1
            raise
        return RouterStream(call, consumer, outputs, first, self._on_close)

    def _on_close(self, stream: RouterStream) -> None:
        stream.consumer.in_flight -= 1
        self.num_in_flight -= 1
        out = stream.outputs
        self.counters["generation_tokens"] += sum(len(s.token_ids) for s in out.seqs)
        if out.finished:
            self.counters["prompt_tokens"] += len(out.prompt_token_ids) - out.num_cached_tokens
            self.counters["prefix_cache_queries"] += len(out.prompt_token_ids)
            self.counters["prefix_cache_hits"] += out.num_cached_tokens

    def _release_soon(self, producer: _Instance, transfer_id: str) -> None:
        """Drop an export on `producer` in the background (the caller may be a cancelled task)."""
        async def release():
            try:
                await producer.kv.Release(pb.LeaseRequest(transfer_id=transfer_id), timeout=_RPC_TIMEOUT_S)
            except grpc.aio.AioRpcError as e:
                logger.warning("%s: releasing transfer %s failed (%s: %s); its lease will end it", producer,
                               transfer_id, e.code().name, e.details())
        task = asyncio.ensure_future(release())
        self._releases.add(task)
        task.add_done_callback(self._releases.discard)


def _uncarried(params: SamplingParams) -> list[str]:
    """The fields of `params` that differ from their default and that the proto's SamplingParams lacks
    (output_kind aside: the router hands out DELTA or FINAL_ONLY itself)."""
    return [f.name for f in dataclasses.fields(SamplingParams)
            if f.name not in (*_PROTO_FIELDS, "output_kind", "structured_outputs")
            and getattr(params, f.name) != f.default]


def _generate_request(request_id: str, ids: list[int], params: SamplingParams, cache_salt: str | None,
                      kv: pb.KVTransferParams | None, priority: int = 0) -> pb.GenerateRequest:
    try:
        sampling = pb.SamplingParams(**{name: getattr(params, name) for name in _PROTO_FIELDS},
                                     structured_outputs=_structured_outputs(params.structured_outputs))
    except ValueError as e:     # an integer past the proto's int64 / uint32 (a seed, a stop token id)
        raise ValueError(f"the request does not fit the gRPC API between the router and the instances: {e}") from None
    return pb.GenerateRequest(request_id=request_id, token_ids=pb.TokenIds(ids=ids), sampling_params=sampling,
                              cache_salt=cache_salt, kv_transfer_params=kv, priority=priority)


def _structured_outputs(so: StructuredOutputsParams | None) -> pb.StructuredOutputs | None:
    if so is None:
        return None
    kind, spec = so.key
    if kind == "json_object":
        return pb.StructuredOutputs(json_object=True)
    if kind == "choice":
        return pb.StructuredOutputs(choice=pb.Choices(choices=list(so.choice)))
    return pb.StructuredOutputs(**{kind: spec})


class _RouterCollector:
    """jaxserve:router_requests_total{path}: requests run disaggregated or decode-only."""

    def __init__(self, engine: RouterEngine, model_name: str) -> None:
        self.engine, self.model_name = engine, model_name

    def collect(self):
        c = CounterMetricFamily("jaxserve:router_requests", "Requests the router ran, by path (disaggregated: "
                                "prefill on a producer, decode on a consumer; decode_only: on a consumer alone)",
                                labels=["model_name", "path"])
        for path, count in self.engine.requests_by_path.items():
            c.add_metric([self.model_name, path], float(count))
        yield c


def router_app(engine: RouterEngine, *, api_key: str | None = None, tool_parser: str | None = None):
    """create_app over the router engine, under the instances' served model name, plus the router's metrics.
    `tool_parser` (--tool-call-parser with --enable-auto-tool-choice): tool calls are parsed here, from
    the text the instances generate."""
    app = create_app(engine, served_model_name=engine.served_model_name, api_key=api_key, tool_parser=tool_parser)
    app.state.metrics.registry.register(_RouterCollector(engine, engine.served_model_name))
    return app


def serve_router(model: str | None, *, prefill: list[str], decode: list[str], host: str = "127.0.0.1",
                 port: int = 8000, api_key: str | None = None, startup_timeout_s: float = 600.0,
                 tool_parser: str | None = None, generation_config: str = "auto") -> int:
    """Serve until SIGTERM/SIGINT (exit 0 after draining in-flight requests)."""
    import uvicorn

    tokenizer, vocab_size, defaults = load_model_files(model, generation_config)

    async def run() -> None:
        engine = await RouterEngine.connect(tokenizer, vocab_size, prefill, decode,
                                            startup_timeout_s=startup_timeout_s)
        engine.sampling_defaults = defaults
        if defaults:
            logger.info("sampling defaults from the model's generation config, for requests that leave them out: %s "
                        "(--generation-config none keeps jaxserve's)", defaults)
        try:
            app = router_app(engine, api_key=api_key, tool_parser=tool_parser)
            server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level="info",
                                                   timeout_graceful_shutdown=30))
            # uvicorn re-raises SIGTERM after its clean shutdown; a no-op handler lets the process exit 0.
            signal.signal(signal.SIGTERM, lambda signum, frame: None)
            logger.info("routing %s on http://%s:%d: prefill %s, decode %s", engine.served_model_name, host, port,
                        ", ".join(prefill), ", ".join(decode))
            await server.serve()
        finally:
            await engine.aclose()
    asyncio.run(run())
    return 0
