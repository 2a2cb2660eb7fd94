"""In-process producer/consumer engines for KV-transfer tests: a producer's KVTransfer service
on a loopback gRPC server (its own event loop thread), and helpers that run one request's two
legs the way the router does."""

from __future__ import annotations

import asyncio
import dataclasses
import threading

import grpc

from jaxserve.core import SamplingParams
from jaxserve.core.kv_transfer import KVTransferParams
from jaxserve.proto import jaxserve_pb2_grpc as pb_grpc
from server.kv_transfer import KVTransferServicer


class KVServer:
    """The producer's KVTransfer service on 127.0.0.1 (a free port), until `stop()`."""

    def __init__(self, producer) -> None:
        self.loop = asyncio.new_event_loop()
        threading.Thread(target=self.loop.run_forever, daemon=True, name="kv-server").start()
        self.server, port = asyncio.run_coroutine_threadsafe(self._start(producer), self.loop).result()
        self.address = f"127.0.0.1:{port}"

    async def _start(self, producer):
        server = grpc.aio.server()
        pb_grpc.add_KVTransferServicer_to_server(KVTransferServicer(dataclasses.make_dataclass(
            "Async", [("engine", object)])(producer)), server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        return server, port

    def stop(self) -> None:
        asyncio.run_coroutine_threadsafe(self.server.stop(None), self.loop).result()
        self.loop.call_soon_threadsafe(self.loop.stop)


def run(engine, request_id, prompt, params, **kwargs):
    """Add one request and step the engine until it finishes; returns its final output."""
    engine.add_request(request_id, prompt, params, **kwargs)
    final = None
    for _ in range(10_000):
        if not engine.has_unfinished_requests():
            return final
        for out in engine.step():
            if out.request_id == request_id and out.finished:
                final = out
    raise AssertionError("the engine did not finish")


def produce(producer, request_id, prompt, params: SamplingParams, transfer_id: str) -> KVTransferParams:
    """The prefill leg: one token, then the export's parameters."""
    out = run(producer, request_id, prompt, params.clone(max_tokens=1, min_tokens=0, n=1, stop=[]),
              kv_transfer=KVTransferParams(role="produce", transfer_id=transfer_id))
    assert out.kv_transfer_params is not None, "the producer's final output carries no transfer"
    return out.kv_transfer_params


def consume(consumer, request_id, prompt, params: SamplingParams, kv: KVTransferParams, address: str):
    """The decode leg: pull from the producer at `address`, then generate."""
    return run(consumer, request_id, prompt, params,
               kv_transfer=dataclasses.replace(kv, role="consume", producer_address=address))
