"""The consumer's side of a KV transfer: pulls, heartbeats and releases, over gRPC.

The engine thread decides what to pull (jaxserve.core.scheduler parks the request and
hands out a `KVLoad`) and alone writes pulled bytes into the pool; this connector only
moves bytes. Pulls run on worker threads into host buffers, and each finished pull
(payload or error) waits in `done()` for the engine thread, which checks that the request
is still parked before writing: a request aborted meanwhile never has late data land in
blocks that were handed to another. A heartbeat thread renews the producer's lease of
every transfer whose request still waits for room in the pool.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import logging
import queue
import threading
import time

import grpc
import jax.numpy as jnp
import numpy as np

from jaxserve.core.kv_transfer import KVLoad, KVTransferParams

logger = logging.getLogger(__name__)

MAX_MESSAGE_BYTES = 64 * 2**20       # gRPC's default 4 MB: below a large model's KV chunk or a long prompt
_CHANNEL_OPTIONS = [("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
                    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES)]


@dataclasses.dataclass
class PullResult:
    replica: object                   # the replica whose scheduler parked the request
    load: KVLoad
    payload: np.ndarray | None        # [blocks, layers, 2, kv_heads, block_size, head_dim]; None on failure
    error: str | None = None
    nbytes: int = 0
    seconds: float = 0.0


class KVConnector:
    def __init__(self, compat_hash: str, *, max_workers: int = 2, pull_timeout_s: float = 60.0) -> None:
        self.compat_hash = compat_hash
        self.pull_timeout_s = pull_timeout_s
        self._workers = concurrent.futures.ThreadPoolExecutor(max_workers, thread_name_prefix="jaxserve-kv-pull")
        self._done: queue.SimpleQueue[PullResult] = queue.SimpleQueue()
        self._channels: dict[str, grpc.Channel] = {}
        self._lock = threading.Lock()          # guards _channels, _watched, _pending
        self._watched: dict[str, KVTransferParams] = {}   # request id -> transfer whose lease to renew
        self._pending = 0                                  # pulls started and not yet taken by done()
        self._closed = threading.Event()
        self._wake = threading.Event()         # a new transfer to watch, or close()
        self._heartbeats = threading.Thread(target=self._heartbeat_loop, name="jaxserve-kv-heartbeat", daemon=True)
        self._heartbeats.start()

    @property
    def num_pending(self) -> int:
        with self._lock:
            return self._pending

    # ---- the engine thread's calls ---------------------------------------------------

    def watch(self, request_id: str, params: KVTransferParams) -> None:
        """Renew this transfer's lease until `unwatch` (the request waits for room in the pool)."""
        with self._lock:
            self._watched[request_id] = params
        self._wake.set()

    def unwatch(self, request_id: str) -> None:
        with self._lock:
            self._watched.pop(request_id, None)

    def start(self, replica: object, load: KVLoad) -> None:
        """Pull `load`'s blocks on a worker thread; its result comes out of `done()`."""
        self.unwatch(load.request_id)       # a pull renews the lease itself
        with self._lock:
            self._pending += 1
        self._workers.submit(self._pull, replica, load)

    def release(self, params: KVTransferParams) -> None:
        """Tell the producer its export will not be pulled (in the background; best effort)."""
        self._workers.submit(self._release, params)

    def done(self, timeout: float = 0.0) -> list[PullResult]:
        """Finished pulls; waits up to `timeout` seconds for the first one when none is ready."""
        results = []
        try:
            results.append(self._done.get(timeout=timeout) if timeout > 0 else self._done.get_nowait())
            while True:
                results.append(self._done.get_nowait())
        except queue.Empty:
            pass
        with self._lock:
            self._pending -= len(results)
        return results

    def close(self) -> None:
        self._closed.set()
        self._wake.set()
        self._workers.shutdown(wait=False, cancel_futures=True)
        with self._lock:
            channels, self._channels = list(self._channels.values()), {}
        for channel in channels:
            channel.close()

    # ---- worker threads --------------------------------------------------------------

    def _stub(self, address: str):
        from jaxserve.proto import jaxserve_pb2_grpc as pb_grpc
        with self._lock:
            channel = self._channels.get(address)
            if channel is None:
                channel = self._channels[address] = grpc.insecure_channel(address, options=_CHANNEL_OPTIONS)
        return pb_grpc.KVTransferStub(channel)

    def _pull(self, replica: object, load: KVLoad) -> None:
        from jaxserve.proto import jaxserve_pb2 as pb
        t0 = time.perf_counter()
        params = load.params
        try:
            payload = _assemble(self._stub(params.producer_address).PullKV(
                pb.PullKVRequest(transfer_id=params.transfer_id, first_block=load.first_block,
                                 num_blocks=len(load.block_ids), compat_hash=self.compat_hash),
                timeout=self.pull_timeout_s))
            result = PullResult(replica, load, payload, nbytes=payload.nbytes, seconds=time.perf_counter() - t0)
        except grpc.RpcError as e:
            result = PullResult(replica, load, None, f"{e.code().name}: {e.details()}",
                                seconds=time.perf_counter() - t0)
        except Exception as e:  # noqa: BLE001 - a bad payload fails this pull only
            result = PullResult(replica, load, None, f"{type(e).__name__}: {e}", seconds=time.perf_counter() - t0)
        self._done.put(result)

    def _release(self, params: KVTransferParams) -> None:
        from jaxserve.proto import jaxserve_pb2 as pb
        try:
            self._stub(params.producer_address).Release(pb.LeaseRequest(transfer_id=params.transfer_id), timeout=5)
        except grpc.RpcError as e:
            logger.info("releasing transfer %s on %s failed (%s); its lease ends it", params.transfer_id,
                        params.producer_address, e.code().name)

    def _heartbeat_loop(self) -> None:
        from jaxserve.proto import jaxserve_pb2 as pb
        while not self._closed.is_set():
            with self._lock:
                watched = list(self._watched.values())
            for params in watched:
                try:
                    self._stub(params.producer_address).ExtendLease(
                        pb.LeaseRequest(transfer_id=params.transfer_id), timeout=5)
                except grpc.RpcError:
                    pass     # the pull will fail and the load-failure policy decides
            period = min((p.lease_seconds for p in watched if p.lease_seconds > 0), default=30.0) / 3
            self._wake.wait(max(0.2, period))
            self._wake.clear()


def _assemble(chunks) -> np.ndarray:
    """The payload array from a PullKV stream (layout and size in the first chunk)."""
    buf, shape, dtype, received = None, None, None, 0
    for chunk in chunks:
        if buf is None:
            dtype, shape = jnp.dtype(chunk.dtype), tuple(chunk.shape)
            expected = int(np.prod(shape)) * dtype.itemsize
            if chunk.total_bytes != expected:
                raise ValueError(f"the producer announced {chunk.total_bytes} bytes for shape {shape} of {dtype}, "
                                 f"which take {expected}")
            buf = np.empty(expected, np.uint8)
        end = chunk.offset + len(chunk.data)
        if end > buf.size:
            raise ValueError(f"a chunk ends at byte {end} of a {buf.size}-byte payload")
        buf[chunk.offset:end] = np.frombuffer(chunk.data, np.uint8)
        received += len(chunk.data)
    if buf is None or received != buf.size:
        raise ValueError(f"the pull ended after {received} of {0 if buf is None else buf.size} bytes")
    return buf.view(dtype).reshape(shape)
