import os
import subprocess
import sys

import pytest

from jaxserve.core.block_pool import BlockPool, FreeBlockQueue, KVCacheBlock
from jaxserve.core.hashing import hash_block_tokens


def test_free_queue_removes_from_the_middle_in_order():
    blocks = [KVCacheBlock(i) for i in range(5)]
    q = FreeBlockQueue(blocks)
    q.remove(blocks[2])
    assert [b.block_id for b in q] == [0, 1, 3, 4] and q.num_free_blocks == 4
    assert q.popleft() is blocks[0]
    q.append(blocks[2])
    assert [b.block_id for b in q] == [1, 3, 4, 2]


def test_null_block_is_never_allocated():
    pool = BlockPool(4)
    got = pool.allocate(3)
    assert 0 not in [b.block_id for b in got]
    assert pool.num_free_blocks == 0
    with pytest.raises(ValueError, match="cannot allocate 1 blocks: only 0 free"):
        pool.allocate(1)


def test_freed_cached_block_stays_cached_until_reused_lru():
    pool = BlockPool(4)  # 3 usable
    a, b, c = pool.allocate(3)
    h = hash_block_tokens(None, [1, 2])
    pool.cache_block(a, h)
    pool.free([a])            # a: ref 0 but still cached, first in line for eviction
    assert pool.get_cached_block(h) is a and a.ref_cnt == 0
    pool.touch([a])           # a cache hit pulls it out of the free queue
    assert a.ref_cnt == 1 and pool.num_free_blocks == 0
    pool.free([a, b])         # a evicted before b
    (first,) = pool.allocate(1)
    assert first is a and pool.get_cached_block(h) is None and a.block_hash is None


def test_ref_counts_shared_blocks():
    pool = BlockPool(3)
    (a,) = pool.allocate(1)
    pool.touch([a])
    pool.free([a])
    assert a.ref_cnt == 1 and pool.num_free_blocks == 1
    pool.free([a])
    assert a.ref_cnt == 0 and pool.num_free_blocks == 2
    with pytest.raises(AssertionError):
        pool.free([a])


def test_reset_prefix_cache_only_when_idle():
    pool = BlockPool(3)
    (a,) = pool.allocate(1)
    pool.cache_block(a, b"h" * 16)
    assert not pool.reset_prefix_cache()
    pool.free([a])
    assert pool.reset_prefix_cache() and pool.get_cached_block(b"h" * 16) is None


def test_hash_is_stable_chained_and_salted():
    h1 = hash_block_tokens(None, [1, 2, 3])
    assert h1 == hash_block_tokens(None, [1, 2, 3])
    assert h1 != hash_block_tokens(None, [1, 2, 4])
    assert hash_block_tokens(h1, [5]) != hash_block_tokens(None, [5])
    assert hash_block_tokens(None, [1, 2, 3], "tenant-a") != h1


def test_hash_is_the_same_in_another_process():
    """Python's hash() is randomized per process; block hashes must not be."""
    code = "from jaxserve.core.hashing import hash_block_tokens as h; print(h(h(None, [1, 2]), [3], 's').hex())"
    outs = {subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                           env={**os.environ, "PYTHONHASHSEED": seed}).stdout.strip() for seed in ("1", "2")}
    assert outs == {hash_block_tokens(hash_block_tokens(None, [1, 2]), [3], "s").hex()}
