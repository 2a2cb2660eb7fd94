"""Disaggregated prefill/decode: the KV-transfer state, as plain Python (no jax, no grpc).

A producer (`--kv-role producer`) prefills a request, samples one token and, when it
finishes, exports the prompt's full KV blocks: the runner gathers them into a host buffer
kept here under a lease until a consumer pulls them (or the lease runs out). A consumer
(`--kv-role consumer`) admits a request carrying the producer's `KVTransferParams`,
allocates blocks only for what its own prefix cache lacks, and holds the request in
WAITING_FOR_REMOTE_KV (jaxserve.core.scheduler) until the pulled bytes are written into
its pool; the request then continues as a prefix-cache hit.

`ExportRegistry` is shared by the engine thread (adds) and the gRPC threads (pulls,
heartbeats, releases), so it holds a lock; its clock is injectable for tests.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Callable
from typing import Any

ROLES = ("produce", "consume")
KV_ROLES = ("producer", "consumer")          # --kv-role values
LOAD_FAILURE_POLICIES = ("recompute", "fail")


@dataclasses.dataclass
class KVTransferParams:
    """What travels between the router, the producer and the consumer (the proto's KVTransferParams)."""

    role: str | None = None                   # "produce", "consume", or None (an ordinary request)
    transfer_id: str = ""                     # chosen by the router; names the export on the producer
    producer_address: str = ""                # host:port of the producer's gRPC server (consume)
    num_full_blocks: int = 0                  # full prompt blocks the producer exported
    block_hashes: list[bytes] = dataclasses.field(default_factory=list)
    block_size: int = 0
    compat_hash: str = ""
    lease_seconds: float = 0.0

    def __post_init__(self) -> None:
        if self.role not in (None, *ROLES):
            raise ValueError(f"kv transfer role={self.role!r} must be one of {ROLES} or None")
        if self.role is not None and not self.transfer_id:
            raise ValueError(f"a kv transfer with role {self.role!r} needs a transfer_id")
        if self.role == "consume" and not self.producer_address:
            raise ValueError("a kv transfer with role 'consume' needs the producer's address")
        if self.num_full_blocks < 0 or len(self.block_hashes) not in (0, self.num_full_blocks):
            raise ValueError(f"num_full_blocks={self.num_full_blocks} does not match {len(self.block_hashes)} "
                             "block hashes")


@dataclasses.dataclass
class Export:
    """A finished prefill's KV blocks, held for a consumer."""

    transfer_id: str
    payload: Any                  # host array [blocks, layers, 2, kv_heads, block_size, head_dim]
    dtype: str                    # the payload's dtype name ("float32", "bfloat16", ...)
    num_blocks: int
    expires_at: float
    pulls: int = 0                # pulls in progress (an export is not expired under a running pull)


class ExportRegistry:
    """Exports by transfer id, each under a lease that a pull or a heartbeat renews."""

    def __init__(self, lease_seconds: float = 30.0, clock: Callable[[], float] = time.monotonic,
                 stats: "KVTransferStats | None" = None) -> None:
        if not lease_seconds > 0:
            raise ValueError(f"lease_seconds={lease_seconds!r} must be > 0")
        self.lease_seconds = lease_seconds
        self._clock = clock
        self._exports: dict[str, Export] = {}
        self._lock = threading.Lock()
        self.stats = stats

    def __len__(self) -> int:
        """Exports held (expired ones are dropped first)."""
        with self._lock:
            self._expire_locked()
            return len(self._exports)

    def add(self, transfer_id: str, payload: Any, dtype: str, num_blocks: int) -> Export:
        """Hold a new export; an id already held is replaced (the router chose it again)."""
        with self._lock:
            self._expire_locked()
            export = Export(transfer_id, payload, dtype, num_blocks, self._clock() + self.lease_seconds)
            self._exports[transfer_id] = export
            return export

    def begin_pull(self, transfer_id: str) -> Export | None:
        """The export for a pull (None if unknown or expired); call `end_pull` after it."""
        with self._lock:
            self._expire_locked()
            export = self._exports.get(transfer_id)
            if export is not None:
                export.pulls += 1
                export.expires_at = self._clock() + self.lease_seconds
            return export

    def end_pull(self, export: Export, complete: bool) -> None:
        """A complete pull releases the export; a broken one leaves it (a retry, or the lease, ends it)."""
        with self._lock:
            export.pulls -= 1
            export.expires_at = self._clock() + self.lease_seconds
            if complete and self._exports.get(export.transfer_id) is export:
                del self._exports[export.transfer_id]

    def extend(self, transfer_id: str) -> float | None:
        """Renew the lease (a consumer's heartbeat); returns the seconds left, None if unknown."""
        with self._lock:
            self._expire_locked()
            export = self._exports.get(transfer_id)
            if export is None:
                return None
            export.expires_at = self._clock() + self.lease_seconds
            return self.lease_seconds

    def release(self, transfer_id: str) -> bool:
        with self._lock:
            found = self._exports.pop(transfer_id, None) is not None
        if found and self.stats is not None:
            self.stats.record("released")
        return found

    def expire(self) -> int:
        """Drop exports whose lease ran out; returns how many."""
        with self._lock:
            return self._expire_locked()

    def _expire_locked(self) -> int:
        now = self._clock()
        dead = [t for t, e in self._exports.items() if e.expires_at <= now and e.pulls == 0]
        for t in dead:
            del self._exports[t]
            if self.stats is not None:
                self.stats.record("expired")
        return len(dead)


def blocks_to_load(num_prompt_tokens: int, block_size: int, num_remote_blocks: int, num_local_blocks: int) -> int:
    """How many leading prompt blocks a consumer should end up with after the pull: the producer's
    full blocks, but never the block holding the last prompt token (the consumer computes at least
    that token itself, so it samples the first output token as a single instance would)."""
    return max(min(num_remote_blocks, (num_prompt_tokens - 1) // block_size), num_local_blocks)


@dataclasses.dataclass
class KVLoad:
    """A consumer's pull, decided by the scheduler: fill `block_ids` with the producer's blocks
    [first_block, first_block + len(block_ids)) of the request's prompt."""

    request_id: str
    params: KVTransferParams
    first_block: int
    block_ids: list[int]
    serial: int = -1     # the Request's: a pull that lands after its request ended never serves a new one of its id


@dataclasses.dataclass
class KVExport:
    """A producer's finished request whose first `len(block_ids)` prompt blocks are to be exported."""

    request_id: str
    params: KVTransferParams
    block_ids: list[int]
    block_hashes: list[bytes]


class KVTransferStats:
    """Counters of one instance's transfers, for /metrics (jaxserve:kv_transfers_total by outcome,
    jaxserve:kv_transfer_bytes_total, the jaxserve:kv_transfer_seconds histogram).

    Outcomes on a producer: "exported" (blocks gathered for a consumer), "sent" (a complete
    pull served), "broken" (a pull cut off), "expired" (a lease ran out), "released"; on a
    consumer: "received", "failed", "not_needed" (its prefix cache held every block).
    Updated from the engine thread and the gRPC threads, hence the lock.
    """

    BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.outcomes: dict[str, int] = {}
        self.bytes = 0
        self.bucket_counts = [0] * len(self.BUCKETS)    # observations <= each bound (cumulative)
        self.count = 0
        self.seconds_sum = 0.0

    def record(self, outcome: str, nbytes: int = 0, seconds: float | None = None) -> None:
        with self._lock:
            self.outcomes[outcome] = self.outcomes.get(outcome, 0) + 1
            self.bytes += nbytes
            if seconds is not None:
                self.count += 1
                self.seconds_sum += seconds
                for i, bound in enumerate(self.BUCKETS):
                    if seconds <= bound:
                        self.bucket_counts[i] += 1

    def snapshot(self) -> dict:
        with self._lock:
            return {"outcomes": dict(self.outcomes), "bytes": self.bytes, "count": self.count,
                    "sum": self.seconds_sum, "buckets": list(zip(self.BUCKETS, self.bucket_counts))}


class IncompatibleKVError(ValueError):
    """The producer's KV blocks cannot be used here (another model, dtype, block size or layout)."""


class UnknownTransferError(KeyError):
    """No export of that transfer id (never made, already pulled, released, or its lease ran out)."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else "unknown transfer"
