"""The KV block pool: a fixed set of blocks, reference counts, LRU free queue, hash map.

Owned by the engine thread. Blocks are allocated once at start-up; the free queue is a
doubly linked list that is also the eviction order (least recently freed first), so a
cached block can be taken back out of the middle in O(1) when a new request hits it.
Block 0 is the null block: never allocated, used by the runner for padding.
"""

from __future__ import annotations

from collections.abc import Iterable

from jaxserve.core.hashing import BlockHash


class KVCacheBlock:
    __slots__ = ("block_id", "ref_cnt", "block_hash", "prev_free", "next_free")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: BlockHash | None = None   # set while the block is in the prefix cache
        self.prev_free: KVCacheBlock | None = None
        self.next_free: KVCacheBlock | None = None

    def __repr__(self) -> str:
        return f"KVCacheBlock(id={self.block_id}, ref={self.ref_cnt}, cached={self.block_hash is not None})"


class FreeBlockQueue:
    """Doubly linked list of free blocks with O(1) popleft, append and remove."""

    def __init__(self, blocks: Iterable[KVCacheBlock]) -> None:
        self._head = KVCacheBlock(-1)   # sentinels
        self._tail = KVCacheBlock(-1)
        self._head.next_free, self._tail.prev_free = self._tail, self._head
        self.num_free_blocks = 0
        for block in blocks:
            self.append(block)

    def popleft(self) -> KVCacheBlock:
        block = self._head.next_free
        if block is self._tail:
            raise ValueError("no free blocks")
        self.remove(block)
        return block

    def remove(self, block: KVCacheBlock) -> None:
        assert block.prev_free is not None and block.next_free is not None, f"{block} is not free"
        block.prev_free.next_free = block.next_free
        block.next_free.prev_free = block.prev_free
        block.prev_free = block.next_free = None
        self.num_free_blocks -= 1

    def append(self, block: KVCacheBlock) -> None:
        last = self._tail.prev_free
        last.next_free = block
        block.prev_free, block.next_free = last, self._tail
        self._tail.prev_free = block
        self.num_free_blocks += 1

    def __iter__(self):
        block = self._head.next_free
        while block is not self._tail:
            yield block
            block = block.next_free


class BlockPool:
    def __init__(self, num_blocks: int, enable_caching: bool = True) -> None:
        if num_blocks < 2:
            raise ValueError(f"num_blocks={num_blocks} is too small: need the null block and at least one more")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        self.null_block = self.blocks[0]
        self.free_queue = FreeBlockQueue(self.blocks[1:])
        self.cached: dict[BlockHash, KVCacheBlock] = {}

    @property
    def num_free_blocks(self) -> int:
        return self.free_queue.num_free_blocks

    @property
    def usage(self) -> float:
        """Fraction of allocatable blocks in use (cached-but-free blocks count as free)."""
        return 1.0 - self.num_free_blocks / (self.num_blocks - 1)

    def get_cached_block(self, block_hash: BlockHash) -> KVCacheBlock | None:
        return self.cached.get(block_hash)

    def allocate(self, n: int) -> list[KVCacheBlock]:
        """Take n blocks from the LRU end, evicting their cached hashes."""
        if n > self.num_free_blocks:
            raise ValueError(f"cannot allocate {n} blocks: only {self.num_free_blocks} free")
        blocks = []
        for _ in range(n):
            block = self.free_queue.popleft()
            self._evict(block)
            block.ref_cnt = 1
            blocks.append(block)
        return blocks

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Take a reference on cache-hit blocks, pulling free ones out of the queue."""
        for block in blocks:
            if block.ref_cnt == 0:
                self.free_queue.remove(block)
            block.ref_cnt += 1

    def free(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Drop a reference; blocks reaching 0 join the queue in the given order (first evicted first)."""
        for block in blocks:
            assert block.ref_cnt > 0, f"double free of {block}"
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self.free_queue.append(block)

    def cache_block(self, block: KVCacheBlock, block_hash: BlockHash) -> None:
        """Register a full block under its hash (the first block with a hash wins)."""
        if not self.enable_caching or block.block_hash is not None:
            return
        if block_hash in self.cached:
            return  # same tokens already cached in another block; this one stays uncached
        block.block_hash = block_hash
        self.cached[block_hash] = block

    def uncache(self, block: KVCacheBlock) -> None:
        """Drop a block's hash if the map points at it (its contents are not what was hashed)."""
        if block.block_hash is not None and self.cached.get(block.block_hash) is block:
            self._evict(block)

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash. Refused (False) while any block is in use."""
        if self.num_free_blocks != self.num_blocks - 1:
            return False
        for block in self.blocks:
            block.block_hash = None
        self.cached.clear()
        return True

    def _evict(self, block: KVCacheBlock) -> None:
        if block.block_hash is not None:
            del self.cached[block.block_hash]
            block.block_hash = None
