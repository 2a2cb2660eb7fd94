"""Maps requests to KV blocks: prefix-cache lookup, slot allocation, freeing, counters.

Owned by the engine thread and driven by the scheduler. Block ids it hands out go to
the runner through `SchedulerOutput`; block 0 (the null block) is never handed out.
"""

from __future__ import annotations

import dataclasses

from jaxserve.core.block_pool import BlockPool, KVCacheBlock
from jaxserve.core.request import Request


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclasses.dataclass
class PrefixCacheStats:
    queries: int = 0   # prompt tokens looked up in the prefix cache
    hits: int = 0      # of those, tokens found cached


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True) -> None:
        if block_size < 1:
            raise ValueError(f"block_size={block_size} must be >= 1")
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.pool = BlockPool(num_blocks, enable_caching)
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        self.num_cached_blocks: dict[str, int] = {}   # leading blocks of each request already registered
        self.stats = PrefixCacheStats()

    @property
    def usage(self) -> float:
        return self.pool.usage

    @property
    def num_usable_blocks(self) -> int:
        return self.pool.num_blocks - 1

    def get_computed_blocks(self, request: Request) -> tuple[list[KVCacheBlock], int]:
        """Longest cached prefix of the request, capped so at least one token is computed."""
        if not self.enable_caching or request.skip_reading_prefix_cache:
            return [], 0
        max_blocks = (request.num_tokens - 1) // self.block_size
        blocks = []
        for block_hash in request.block_hashes[:max_blocks]:
            block = self.pool.get_cached_block(block_hash)
            if block is None:
                break
            blocks.append(block)
        return blocks, len(blocks) * self.block_size

    def record_prefix_lookup(self, num_tokens: int, num_hit: int) -> None:
        """Count one admitted request's lookup (not the retries of a request that had to wait)."""
        self.stats.queries += num_tokens
        self.stats.hits += num_hit

    def allocate_slots(self, request: Request, num_new_tokens: int,
                       computed_blocks: list[KVCacheBlock] | None = None,
                       num_computed_tokens: int | None = None, *, cache: bool = True) -> list[int] | None:
        """Make room for `num_new_tokens` more tokens; returns the new block ids, or None if the pool is short.

        `computed_blocks` are prefix-cache hits for a request being admitted; they cover
        `num_computed_tokens` tokens. `cache=False` leaves the new blocks out of the prefix
        cache (blocks a KV pull fills later: `cache_loaded_blocks` registers them once written).
        """
        req_id = request.request_id
        held = self.req_to_blocks.get(req_id, ())
        num_computed = request.num_computed_tokens if num_computed_tokens is None else num_computed_tokens
        total = num_computed + num_new_tokens
        num_hits = len(computed_blocks) if computed_blocks else 0
        num_new_blocks = max(-(-total // self.block_size) - len(held) - num_hits, 0)
        if num_new_blocks == 0 and not num_hits and held:
            # Decode fast path: the token fits in the blocks already held.
            self._cache_full_blocks(request, held, total)
            return []
        # Hits on free (ref 0) cached blocks take those blocks out of the free queue too.
        num_evictable_hits = sum(1 for b in computed_blocks if b.ref_cnt == 0) if num_hits else 0
        if num_new_blocks + num_evictable_hits > self.pool.num_free_blocks:
            return None
        if num_hits:
            self.pool.touch(computed_blocks)
        new_blocks = self.pool.allocate(num_new_blocks)
        blocks = self.req_to_blocks.setdefault(req_id, [])
        if num_hits:
            blocks.extend(computed_blocks)
        blocks.extend(new_blocks)
        if req_id not in self.num_cached_blocks:
            self.num_cached_blocks[req_id] = num_hits
        if cache:
            self._cache_full_blocks(request, blocks, total)
        return [b.block_id for b in new_blocks]

    def cache_loaded_blocks(self, request: Request, num_tokens: int) -> None:
        """Register the request's blocks up to `num_tokens` once their KV is in the pool (a pull landed)."""
        self._cache_full_blocks(request, self.req_to_blocks[request.request_id], num_tokens)

    def _cache_full_blocks(self, request: Request, blocks: list[KVCacheBlock], num_tokens: int) -> None:
        """Register blocks that will be full once this step's tokens are written."""
        start = self.num_cached_blocks[request.request_id]
        end = min(num_tokens // self.block_size, len(request.block_hashes))
        if not self.enable_caching or end <= start:
            return
        for i in range(start, end):
            self.pool.cache_block(blocks[i], request.block_hashes[i])
        self.num_cached_blocks[request.request_id] = max(start, end)

    def free(self, request: Request) -> None:
        """Release the request's blocks, tail first, so its last blocks are evicted first."""
        blocks = self.req_to_blocks.pop(request.request_id, [])
        num_registered = self.num_cached_blocks.pop(request.request_id, 0)
        # Blocks registered for tokens scheduled but never computed (a request preempted in the
        # step that allocated them) must not stay findable in the prefix cache.
        for block in blocks[request.num_computed_tokens // self.block_size:num_registered]:
            self.pool.uncache(block)
        self.pool.free(reversed(blocks))

    def get_block_ids(self, request_id: str) -> list[int]:
        return [b.block_id for b in self.req_to_blocks.get(request_id, [])]

    def reset_prefix_cache(self) -> bool:
        return self.pool.reset_prefix_cache()
