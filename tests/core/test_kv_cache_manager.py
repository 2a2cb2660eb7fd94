from jaxserve.core import KVCacheManager, Request, SamplingParams


def make_request(req_id, tokens, block_size=4, salt=None):
    r = Request(req_id, tokens, SamplingParams(), cache_salt=salt)
    r.update_block_hashes(block_size)
    return r


def test_allocate_grows_block_by_block():
    kv = KVCacheManager(num_blocks=10, block_size=4)
    r = make_request("a", list(range(6)))
    assert len(kv.allocate_slots(r, 6)) == 2
    r.num_computed_tokens = 6
    assert kv.allocate_slots(r, 2) == []        # 8 tokens still fit in 2 blocks
    r.num_computed_tokens = 8
    assert len(kv.allocate_slots(r, 1)) == 1    # the 9th needs a third
    assert len(kv.get_block_ids("a")) == 3


def test_returns_none_when_pool_is_short_and_allocates_nothing():
    kv = KVCacheManager(num_blocks=3, block_size=4)   # 2 usable blocks
    r = make_request("a", list(range(12)))
    free_before = kv.pool.num_free_blocks
    assert kv.allocate_slots(r, 12) is None
    assert kv.pool.num_free_blocks == free_before and kv.get_block_ids("a") == []


def test_prefix_hit_capped_at_prompt_minus_one():
    kv = KVCacheManager(num_blocks=10, block_size=4)
    a = make_request("a", list(range(8)))
    a_blocks = kv.allocate_slots(a, 8)
    a.num_computed_tokens = 8          # the step ran
    kv.free(a)
    b = make_request("b", list(range(8)))        # identical 8-token prompt: 2 full blocks
    blocks, n = kv.get_computed_blocks(b)
    assert n == 4 and len(blocks) == 1           # the last block is recomputed so one token is sampled
    c = make_request("c", list(range(9)))
    blocks, n = kv.get_computed_blocks(c)
    assert n == 8 and [x.block_id for x in blocks] == a_blocks
    assert kv.stats.queries == 0, "lookups are counted only when the scheduler admits the request"
    kv.record_prefix_lookup(9, 8)
    assert (kv.stats.queries, kv.stats.hits) == (9, 8)


def test_salt_separates_tenants():
    kv = KVCacheManager(num_blocks=10, block_size=4)
    a = make_request("a", list(range(9)), salt="t1")
    kv.allocate_slots(a, 9)
    assert kv.get_computed_blocks(make_request("b", list(range(9)), salt="t2"))[1] == 0
    assert kv.get_computed_blocks(make_request("c", list(range(9))))[1] == 0
    assert kv.get_computed_blocks(make_request("d", list(range(9)), salt="t1"))[1] == 8


def test_shared_blocks_are_ref_counted_and_freed():
    kv = KVCacheManager(num_blocks=10, block_size=4)
    a = make_request("a", list(range(9)))
    kv.allocate_slots(a, 9)
    b = make_request("b", list(range(9)))
    blocks, n = kv.get_computed_blocks(b)
    kv.allocate_slots(b, 1, blocks, n)
    assert kv.get_block_ids("b")[:2] == kv.get_block_ids("a")[:2]
    assert [blk.ref_cnt for blk in blocks] == [2, 2]
    kv.free(a)
    kv.free(b)
    assert kv.pool.num_free_blocks == 9 and all(blk.ref_cnt == 0 for blk in kv.pool.blocks)


def test_disabled_caching_never_hits():
    kv = KVCacheManager(num_blocks=10, block_size=4, enable_caching=False)
    a = make_request("a", list(range(9)))
    kv.allocate_slots(a, 9)
    assert kv.get_computed_blocks(make_request("b", list(range(9)))) == ([], 0)
    assert kv.pool.cached == {}


def test_blocks_freed_before_their_tokens_were_computed_leave_the_cache():
    kv = KVCacheManager(num_blocks=10, block_size=4)
    a = make_request("a", list(range(12)))
    kv.allocate_slots(a, 4)
    a.num_computed_tokens = 4           # first chunk computed
    kv.allocate_slots(a, 8)             # second chunk scheduled (registers blocks 1 and 2) ...
    kv.free(a)                          # ... but the request is preempted before the step runs
    b = make_request("b", list(range(12)) + [99])
    assert kv.get_computed_blocks(b)[1] == 4   # only the computed block is a hit
