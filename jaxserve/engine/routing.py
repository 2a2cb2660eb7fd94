"""Data-parallel routing: which replica (scheduler + runner on its own devices) takes a request.

Called on the engine thread when a request is added; the `n` siblings of a request go
to the same replica so that they share the prompt's KV blocks.
"""

from __future__ import annotations

from collections.abc import Sequence

from jaxserve.core import Request
from jaxserve.engine.builder import Replica


def route(replicas: Sequence[Replica], request: Request, *, block_size: int, max_num_seqs: int) -> Replica:
    """The least loaded replica, preferring one that holds the request's prefix.

    Among replicas within `max_num_seqs // 4` requests of the least loaded, the one with
    the longest cached prefix wins; ties go to the least loaded.
    """
    if len(replicas) == 1:
        return replicas[0]
    request.update_block_hashes(block_size)   # what the prefix lookup reads
    loads = [r.scheduler.num_running + r.scheduler.num_waiting for r in replicas]
    slack = max(1, max_num_seqs // 4)
    candidates = [i for i, load in enumerate(loads) if load <= min(loads) + slack]
    hits = {i: replicas[i].scheduler.kv.get_computed_blocks(request)[1] for i in candidates}
    return replicas[max(candidates, key=lambda i: (hits[i], -loads[i]))]
