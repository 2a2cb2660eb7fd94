"""The gRPC API (jaxserve/proto/jaxserve.proto): `GenerationServicer` and `start_grpc_server`.

Handlers run on one asyncio event loop (uvicorn's, when `jaxserve serve --grpc-port` runs
both servers) and reach the engine only through AsyncEngine's public API, as the HTTP
routes do. A GenerateRequest is turned into the `/v1/completions` body that asks for the
same thing and validated by jaxserve.protocol on a worker thread, so both APIs accept the
same requests with the same error messages. Each Generate owns its RequestStream: the
engine's DELTA outputs are forwarded as Chunk / Complete messages, and whatever ends the
call (the client's cancel or deadline, Abort, an error, server shutdown) closes the
stream, which aborts the request and frees its KV blocks.

Errors leave as status codes: a bad request INVALID_ARGUMENT (the HTTP 400's message), a
full queue RESOURCE_EXHAUSTED, a dead engine UNAVAILABLE, KV blocks from an incompatible
producer FAILED_PRECONDITION, an unknown KV transfer NOT_FOUND, anything else INTERNAL
with only a request id (the traceback is logged under it).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

import grpc
import numpy as np
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from jaxserve.core import SamplingParams
from jaxserve.core.kv_transfer import IncompatibleKVError, KVTransferParams, UnknownTransferError
from jaxserve.engine.async_engine import AsyncEngine, EngineDeadError, QueueFullError, RequestFailedError, RequestStream
from jaxserve.engine.kv_connector import MAX_MESSAGE_BYTES      # the consumer's channels use the same limit
from jaxserve.outputs import CompletionOutput, RequestOutput
from jaxserve.proto import jaxserve_pb2 as pb
from jaxserve.proto import jaxserve_pb2_grpc as pb_grpc
from jaxserve.protocol import CompletionRequest, RequestLimits, new_id, parse, prepare
from server.streaming import internal_error

logger = logging.getLogger(__name__)

GENERATION = pb.DESCRIPTOR.services_by_name["Generation"].full_name
KV_TRANSFER = pb.DESCRIPTOR.services_by_name["KVTransfer"].full_name

_ROLES = {pb.KV_ROLE_PRODUCE: "produce", pb.KV_ROLE_CONSUME: "consume"}
_ROLE_VALUES = {name: value for value, name in _ROLES.items()}
_FLOATS = ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty")
_OTHER_OPTIONALS = ("top_k", "seed", "max_tokens", "min_tokens", "logprobs", "n", "skip_special_tokens",
                    "truncate_prompt_tokens")


# ---- requests ---------------------------------------------------------------------------


def kv_params_from_proto(p: pb.KVTransferParams) -> KVTransferParams | None:
    """The engine's KVTransferParams of a request; None for an ordinary one (role unset)."""
    if p.role == pb.KV_ROLE_UNSPECIFIED:
        return None
    if p.role not in _ROLES:
        raise ValueError(f"kv_transfer_params.role={p.role} is not a KVRole")
    return KVTransferParams(role=_ROLES[p.role], transfer_id=p.transfer_id, producer_address=p.producer_address,
                            num_full_blocks=p.num_full_blocks, block_hashes=list(p.block_hashes),
                            block_size=p.block_size, compat_hash=p.compat_hash, lease_seconds=p.lease_seconds)


def kv_params_to_proto(p: KVTransferParams) -> pb.KVTransferParams:
    return pb.KVTransferParams(role=_ROLE_VALUES.get(p.role, pb.KV_ROLE_UNSPECIFIED), transfer_id=p.transfer_id,
                               producer_address=p.producer_address, num_full_blocks=p.num_full_blocks,
                               block_hashes=p.block_hashes, block_size=p.block_size, compat_hash=p.compat_hash,
                               lease_seconds=p.lease_seconds)


def _float(x: float) -> float:
    """The shortest decimal a float32 field holds: what the client wrote (0.7, not 0.699999988), so
    that sampling and error messages see the same value as over HTTP."""
    return float(str(np.float32(x)))


def completion_body(request: pb.GenerateRequest, prompt: list[int] | None) -> dict:
    """The /v1/completions body asking for what `request` asks, with the prompt as token ids (None:
    no input, which the body's validation refuses); unset optional fields are left out."""
    sp = request.sampling_params
    body: dict = {"stream": True, "ignore_eos": sp.ignore_eos,   # stream: DELTA outputs, as the SSE route
                  "include_stop_str_in_output": sp.include_stop_str_in_output}
    if prompt is not None:
        body["prompt"] = prompt
    for name in _FLOATS + _OTHER_OPTIONALS:
        if sp.HasField(name):
            value = getattr(sp, name)
            body[name] = _float(value) if name in _FLOATS else value
    if sp.stop:
        body["stop"] = list(sp.stop)
    if sp.stop_token_ids:
        body["stop_token_ids"] = list(sp.stop_token_ids)
    if sp.allowed_token_ids:
        body["allowed_token_ids"] = list(sp.allowed_token_ids)
    if sp.bad_words:
        body["bad_words"] = list(sp.bad_words)
    if sp.logit_bias:
        body["logit_bias"] = {str(token): _float(bias) for token, bias in sp.logit_bias.items()}
    if request.HasField("cache_salt"):
        body["cache_salt"] = request.cache_salt
    if sp.HasField("structured_outputs"):
        body["structured_outputs"] = structured_outputs_body(sp.structured_outputs)
    return body


def structured_outputs_body(so: pb.StructuredOutputs) -> dict:
    """The HTTP body's structured_outputs for the proto's (an unset constraint is the body's error)."""
    which = so.WhichOneof("constraint")
    if which is None:
        return {}
    value = getattr(so, which)
    return {which: list(value.choices) if which == "choice" else value}


def _prompt_ids(request: pb.GenerateRequest, tokenizer) -> list[int] | None:
    """Token ids given, or the text tokenized as the request says (add_special_tokens); None if neither."""
    which = request.WhichOneof("input")
    if which == "text":
        add = request.add_special_tokens if request.HasField("add_special_tokens") else True   # as HTTP
        return tokenizer.encode(request.text, add_special_tokens=add)
    if which == "token_ids":
        return list(request.token_ids.ids)
    return None


# ---- responses --------------------------------------------------------------------------


def _token_logprobs(c: CompletionOutput, top_n: int) -> list[pb.TokenLogprobs]:
    """Each new token's logprob and the top `top_n` (the dicts also hold the sampled token when it
    is not among them)."""
    out = []
    for token_id, lps in zip(c.token_ids, c.logprobs or ()):
        top = sorted(lps.items(), key=lambda kv: -kv[1])[:top_n]
        out.append(pb.TokenLogprobs(token_id=token_id, logprob=lps[token_id],
                                    top=[pb.TopLogprob(token_id=t, logprob=lp) for t, lp in top]))
    return out


class _Choices:
    """What one Generate call has streamed, per choice: the counts its Complete messages report."""

    def __init__(self, n: int, prompt_token_ids: list[int], top_logprobs: int | None) -> None:
        self.prompt_token_ids = prompt_token_ids
        self.top_logprobs = top_logprobs
        self.num_tokens = [0] * n
        self.num_cached_tokens = 0

    def responses(self, out: RequestOutput) -> list[pb.GenerateResponse]:
        """The messages of one DELTA output: a Chunk per choice with news, a Complete per finished one."""
        self.num_cached_tokens = out.num_cached_tokens
        messages = []
        for c in out.outputs:
            self.num_tokens[c.index] += len(c.token_ids)
            if c.token_ids or c.text:
                lps = _token_logprobs(c, self.top_logprobs) if self.top_logprobs is not None else None
                messages.append(pb.GenerateResponse(chunk=pb.Chunk(index=c.index, token_ids=c.token_ids,
                                                                   text=c.text, logprobs=lps)))
            if c.finish_reason is not None:
                messages.append(self.complete(c.index, c.finish_reason, c.stop_reason, out.kv_transfer_params))
        return messages

    def complete(self, index: int, finish_reason: str, stop_reason: int | str | None = None,
                 kv: KVTransferParams | None = None) -> pb.GenerateResponse:
        msg = pb.Complete(index=index, finish_reason=finish_reason, prompt_tokens=len(self.prompt_token_ids),
                          completion_tokens=self.num_tokens[index], cached_tokens=self.num_cached_tokens,
                          prompt_token_ids=self.prompt_token_ids)
        if isinstance(stop_reason, str):
            msg.stop_string = stop_reason
        elif stop_reason is not None:
            msg.stop_token_id = stop_reason
        if kv is not None:
            msg.kv_transfer_params.CopyFrom(kv_params_to_proto(kv))
        return pb.GenerateResponse(complete=msg)


# ---- errors -----------------------------------------------------------------------------


def status_of(e: BaseException, request_id: str | None = None, *,
              admitted: bool = False) -> tuple[grpc.StatusCode, str]:
    """The status code and message of a failure. As over HTTP, a ValueError is the client's fault
    only while its request is being admitted; after that it is ours (INTERNAL)."""
    if isinstance(e, IncompatibleKVError):        # a ValueError: before that rule
        return grpc.StatusCode.FAILED_PRECONDITION, str(e)
    if isinstance(e, UnknownTransferError):
        return grpc.StatusCode.NOT_FOUND, str(e)
    if isinstance(e, QueueFullError):
        return grpc.StatusCode.RESOURCE_EXHAUSTED, str(e)
    if isinstance(e, EngineDeadError):
        return grpc.StatusCode.UNAVAILABLE, str(e)
    if isinstance(e, RequestFailedError) and e.output.error_status == 400:
        return grpc.StatusCode.INVALID_ARGUMENT, e.output.error
    if isinstance(e, ValueError) and not admitted:
        return grpc.StatusCode.INVALID_ARGUMENT, str(e)
    return grpc.StatusCode.INTERNAL, str(internal_error(e, request_id))


# ---- the service --------------------------------------------------------------------------


class GenerationServicer(pb_grpc.GenerationServicer):
    def __init__(self, engine: AsyncEngine, *, served_model_name: str | None = None,
                 limits: RequestLimits | None = None) -> None:
        self.engine = engine
        self.served_model_name = served_model_name or engine.model_name
        self.limits = limits or RequestLimits(max_logprobs=engine.engine.config.max_logprobs)
        self._in_flight: set[str] = set()     # request ids of this server's Generate calls (what Abort finds)

    def _prepare(self, request: pb.GenerateRequest) -> tuple[dict, SamplingParams]:
        """(prompt, SamplingParams) through the /v1/completions checks; runs on a worker thread."""
        body = completion_body(request, _prompt_ids(request, self.engine.tokenizer))
        req = parse(CompletionRequest, body)
        ((prompt, params),) = prepare(req, self.engine.tokenizer, self.engine.max_model_len, self.limits,
                                      defaults=self.engine.sampling_defaults)
        return prompt, params

    async def _admit(self, request: pb.GenerateRequest,
                     request_id: str) -> tuple[RequestStream, dict, SamplingParams]:
        if not self.engine.is_healthy:
            raise EngineDeadError("the engine is not running")
        prompt, params = await asyncio.to_thread(self._prepare, request)
        self.engine.check_room(params.n)
        salt = request.cache_salt if request.HasField("cache_salt") else None
        stream = await self.engine.add_request(prompt, params, request_id, cache_salt=salt, priority=request.priority,
                                               kv_transfer=kv_params_from_proto(request.kv_transfer_params))
        return stream, prompt, params

    async def Generate(self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext) -> None:
        request_id = request.request_id or new_id("req")
        try:
            stream, prompt, params = await self._admit(request, request_id)
        except Exception as e:  # noqa: BLE001 - every failure leaves as a status code
            await context.abort(*status_of(e, request_id))    # raises: the call ends here
        self._in_flight.add(request_id)
        choices = _Choices(params.n, prompt["prompt_token_ids"], params.logprobs)
        try:
            async for out in stream:
                for message in choices.responses(out):
                    await context.write(message)
        except Exception as e:  # noqa: BLE001 - the engine died mid-stream, or a bug of ours
            await context.abort(*status_of(e, request_id, admitted=True))
        finally:   # a cancel or deadline lands here too (CancelledError): the request must not outlive the call
            stream.close()
            self._in_flight.discard(request_id)

    async def Abort(self, request: pb.AbortRequest, context: grpc.aio.ServicerContext) -> pb.AbortResponse:
        found = request.request_id in self._in_flight
        if found:   # its stream ends with each open choice's final "abort" output, sent as a Complete
            self.engine.abort(request.request_id)
        return pb.AbortResponse(found=found)

    async def GetModelInfo(self, request: pb.GetModelInfoRequest, context: grpc.aio.ServicerContext) -> pb.ModelInfo:
        core = self.engine.engine
        return pb.ModelInfo(served_model_name=self.served_model_name, model_name=self.engine.model_name,
                            max_model_len=self.engine.max_model_len, vocab_size=core.model_config.vocab_size,
                            block_size=core.config.block_size, compat_hash=core.compat_hash,
                            max_logprobs=self.limits.max_logprobs,
                            eos_token_ids=list(self.engine.tokenizer.eos_token_ids))

    async def GetServerInfo(self, request: pb.GetServerInfoRequest,
                            context: grpc.aio.ServicerContext) -> pb.ServerInfo:
        stats, core = self.engine.stats(), self.engine.engine
        return pb.ServerInfo(num_running=int(stats["num_running"]), num_waiting=int(stats["num_waiting"]),
                             kv_usage=stats["kv_usage"], kv_role=core.config.kv_role or "",
                             num_exports=int(stats.get("num_kv_exports", 0)),
                             num_waiting_for_kv=int(stats.get("num_waiting_for_kv", 0)),
                             kv_free_blocks=int(stats["kv_free_blocks"]), kv_total_blocks=int(stats["kv_total_blocks"]),
                             healthy=self.engine.is_healthy)


# ---- the server ---------------------------------------------------------------------------


class GrpcServer:
    """A started gRPC server and the task that keeps its health status in step with the engine."""

    def __init__(self, server: grpc.aio.Server, port: int, health_servicer: health.aio.HealthServicer,
                 watcher: asyncio.Task) -> None:
        self.server, self.port, self.health, self._watcher = server, port, health_servicer, watcher

    async def stop(self, grace: float | None = 30.0) -> None:
        """Refuse new calls (health NOT_SERVING), let those in flight finish for up to `grace`
        seconds, then cancel the rest (which aborts their requests)."""
        await self.health.enter_graceful_shutdown()
        self._watcher.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._watcher
        await self.server.stop(grace)


async def _watch_health(engine: AsyncEngine, health_servicer: health.aio.HealthServicer, services: list[str],
                        poll_s: float) -> None:
    """SERVING while the engine runs; NOT_SERVING once it died (for good: it never comes back)."""
    while engine.is_healthy:
        await asyncio.sleep(poll_s)
    for service in services:
        await health_servicer.set(service, health_pb2.HealthCheckResponse.NOT_SERVING)


async def start_grpc_server(engine: AsyncEngine, port: int, *, host: str = "127.0.0.1",
                            served_model_name: str | None = None, limits: RequestLimits | None = None,
                            health_poll_s: float = 0.5) -> GrpcServer:
    """Serve Generation, Health and reflection (and KVTransfer on a producer) on host:port, in the
    running event loop; port 0 picks a free one (GrpcServer.port)."""
    server = grpc.aio.server(options=[("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
                                      ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
                                      ("grpc.so_reuseport", 0)])   # a port in use is an error, not shared
    pb_grpc.add_GenerationServicer_to_server(
        GenerationServicer(engine, served_model_name=served_model_name, limits=limits), server)
    served = [GENERATION]
    if engine.engine.config.kv_role == "producer":
        from server.kv_transfer import KVTransferServicer   # the producer's side of the KV pull

        pb_grpc.add_KVTransferServicer_to_server(KVTransferServicer(engine), server)
        served.append(KV_TRANSFER)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    status = [""] + served          # "": the whole server
    for service in status:
        await health_servicer.set(service, health_pb2.HealthCheckResponse.SERVING)
    reflection.enable_server_reflection([*served, health.SERVICE_NAME, reflection.SERVICE_NAME], server)
    bound = server.add_insecure_port(_address(host, port))
    await server.start()
    watcher = asyncio.ensure_future(_watch_health(engine, health_servicer, status, health_poll_s))
    logger.info("gRPC API (%s) on %s", ", ".join(served), _address(host, bound))
    return GrpcServer(server, bound, health_servicer, watcher)


def _address(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def run_with_app(app, engine: AsyncEngine, port: int, *, grace: float = 30.0, **options) -> None:
    """Run the gRPC server for as long as the FastAPI `app` runs, in uvicorn's event loop: started
    before the app serves, stopped (draining its calls for up to `grace` s) after uvicorn drained
    HTTP and before the app's own shutdown stops the engine. `options`: start_grpc_server's."""
    inner = app.router.lifespan_context

    @contextlib.asynccontextmanager
    async def lifespan(app):
        async with inner(app) as state:
            grpc_server = await start_grpc_server(engine, port, **options)
            try:
                yield state
            finally:
                await grpc_server.stop(grace)
    app.router.lifespan_context = lifespan
