"""The producer's KVTransfer service: consumers pull exported KV blocks, renew and release leases.

Runs on the gRPC server's event loop beside the Generation service. It reads only the
engine's `exports` (jaxserve.core.kv_transfer.ExportRegistry, host copies made on the
engine thread), so a pull never touches the device or waits for a step. A pull streams the
requested blocks in chunks (the first one carries dtype, shape and size); a complete pull
releases the export, a cut one leaves it to a retry or its lease.
"""

from __future__ import annotations

import time

import grpc
import numpy as np

from jaxserve.proto import jaxserve_pb2 as pb
from jaxserve.proto import jaxserve_pb2_grpc as pb_grpc

CHUNK_BYTES = 4 * 2**20


class KVTransferServicer(pb_grpc.KVTransferServicer):
    def __init__(self, engine, chunk_bytes: int = CHUNK_BYTES) -> None:
        """`engine`: the AsyncEngine of a `--kv-role producer` instance."""
        self.llm = engine.engine
        self.exports = self.llm.exports
        self.chunk_bytes = chunk_bytes

    async def PullKV(self, request: pb.PullKVRequest, context: grpc.aio.ServicerContext):
        if request.compat_hash and request.compat_hash != self.llm.compat_hash:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                                f"the consumer's compat hash {request.compat_hash} differs from this producer's "
                                f"{self.llm.compat_hash} ({self.llm.model_name}, dtype {self.llm.config.dtype}, "
                                f"block size {self.llm.config.block_size})")
        export = self.exports.begin_pull(request.transfer_id)
        if export is None:
            await context.abort(grpc.StatusCode.NOT_FOUND,
                                f"no KV export {request.transfer_id!r} here: never made, already pulled, released, "
                                f"or its lease ({self.exports.lease_seconds:g} s) ran out")
        t0, complete, sent = time.perf_counter(), False, 0
        try:
            end = request.first_block + request.num_blocks
            if request.num_blocks == 0 or end > export.num_blocks:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                    f"blocks [{request.first_block}, {end}) are not in export {request.transfer_id!r} "
                                    f"of {export.num_blocks} blocks")
            blocks = np.ascontiguousarray(export.payload[request.first_block:end])
            data = memoryview(blocks.reshape(-1).view(np.uint8))
            for offset in range(0, len(data), self.chunk_bytes):
                piece = data[offset:offset + self.chunk_bytes]
                header = {} if offset else dict(dtype=export.dtype, shape=blocks.shape, total_bytes=len(data))
                yield pb.KVChunk(offset=offset, data=bytes(piece), **header)
                sent += len(piece)
            complete = True
        finally:
            self.exports.end_pull(export, complete)
            self.llm.kv_stats.record("sent" if complete else "broken", sent, time.perf_counter() - t0)

    async def ExtendLease(self, request: pb.LeaseRequest, context) -> pb.LeaseResponse:
        remaining = self.exports.extend(request.transfer_id)
        return pb.LeaseResponse(found=remaining is not None, lease_remaining_s=remaining or 0.0)

    async def Release(self, request: pb.LeaseRequest, context) -> pb.LeaseResponse:
        return pb.LeaseResponse(found=self.exports.release(request.transfer_id))
