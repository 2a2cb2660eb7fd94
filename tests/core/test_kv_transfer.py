"""The KV-transfer state in plain Python: exports under leases, a producer's exports, and a
consumer's requests parked while their blocks are pulled (property tests, as for the scheduler)."""

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from jaxserve.core import Request, RequestStatus, SamplingParams, Scheduler, SchedulerConfig
from jaxserve.core.kv_transfer import ExportRegistry, KVTransferParams, KVTransferStats, blocks_to_load

from .sim import FakeRunner, assert_pool_consistent, make_scheduler, run_until_done


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_an_export_lives_until_its_lease_runs_out_and_a_heartbeat_renews_it():
    clock, stats = Clock(), KVTransferStats()
    reg = ExportRegistry(10.0, clock=clock, stats=stats)
    reg.add("a", b"x", "float32", 1)
    clock.now = 9.0
    assert reg.extend("a") == 10.0
    clock.now = 18.0
    assert len(reg) == 1            # renewed at 9: lives to 19
    clock.now = 19.0
    assert len(reg) == 0 and reg.extend("a") is None and reg.begin_pull("a") is None
    assert stats.snapshot()["outcomes"] == {"expired": 1}


def test_a_complete_pull_releases_the_export_and_a_broken_one_keeps_it():
    clock = Clock()
    reg = ExportRegistry(5.0, clock=clock)
    reg.add("a", b"x", "float32", 1)
    export = reg.begin_pull("a")
    clock.now = 100.0
    assert len(reg) == 1, "an export is not expired under a running pull"
    reg.end_pull(export, complete=False)
    again = reg.begin_pull("a")
    assert again is export
    reg.end_pull(again, complete=True)
    assert len(reg) == 0 and not reg.release("a")


def test_release_drops_an_export_once():
    stats = KVTransferStats()
    reg = ExportRegistry(5.0, stats=stats)
    reg.add("a", b"x", "float32", 1)
    assert reg.release("a") and not reg.release("a")
    assert stats.snapshot()["outcomes"] == {"released": 1}


@pytest.mark.parametrize("bad", [dict(role="pull", transfer_id="t"), dict(role="produce"),
                                 dict(role="consume", transfer_id="t"),
                                 dict(role="consume", transfer_id="t", producer_address="h:1", num_full_blocks=2,
                                      block_hashes=[b"x"])])
def test_transfer_params_are_checked(bad):
    with pytest.raises(ValueError):
        KVTransferParams(**bad)


@pytest.mark.parametrize("prompt,remote,local,want", [(16, 1, 0, 0), (17, 1, 0, 1), (40, 2, 0, 2), (40, 2, 1, 2),
                                                       (40, 1, 2, 2), (33, 5, 0, 2)])
def test_blocks_to_load_never_takes_the_block_of_the_last_prompt_token(prompt, remote, local, want):
    assert blocks_to_load(prompt, 16, remote, local) == want


def test_a_producer_exports_the_full_prompt_blocks_of_a_finished_request_and_they_stay_cached():
    s, runner = make_scheduler(block_size=4)
    kv = KVTransferParams(role="produce", transfer_id="t")
    prompt = list(range(1, 15))       # 14 tokens: 3 full blocks
    s.add_request(Request("p", prompt, SamplingParams(max_tokens=1), kv_transfer=kv))
    s.add_request(Request("q", prompt, SamplingParams(max_tokens=1),
                          kv_transfer=KVTransferParams(role="produce", transfer_id="u")))
    s.finish_requests("q", RequestStatus.FINISHED_ABORTED)
    run_until_done(s, runner)
    (export,) = s.take_kv_exports()   # the aborted one exports nothing
    assert export.request_id == "p" and len(export.block_ids) == 3
    assert [runner.block_tokens(b) for b in export.block_ids] == [prompt[0:4], prompt[4:8], prompt[8:12]]
    assert s.kv.pool.num_free_blocks == s.kv.num_usable_blocks
    assert all(s.kv.pool.get_cached_block(h) is not None for h in export.block_hashes)


def test_a_consumer_request_waits_for_its_pull_then_runs_as_a_prefix_hit():
    s, runner = make_scheduler(block_size=4)
    prompt = list(range(1, 15))
    req = consume_request("c", prompt, 4)
    s.add_request(req)
    out = s.schedule()
    assert out.is_empty and req.status == RequestStatus.WAITING_FOR_REMOTE_KV
    (load,) = s.take_kv_loads()
    assert load.first_block == 0 and len(load.block_ids) == 3
    assert s.kv.pool.get_cached_block(req.block_hashes[0]) is None, "registered before the data landed"
    write(runner, load, prompt)
    assert s.finish_kv_load("c", ok=True)
    out = s.schedule()
    assert out.num_scheduled_tokens == {"c": 2} and req.num_cached_tokens == 12


def test_a_pool_too_short_for_the_pull_makes_the_request_wait_not_fail():
    s, runner = make_scheduler(block_size=4, num_blocks=5)    # 4 usable blocks
    s.add_request(Request("big", list(range(100, 113)), SamplingParams(max_tokens=3)))
    out = s.schedule()                                        # holds all 4 blocks
    s.update_from_output(out, runner.execute(out))
    req = consume_request("c", list(range(1, 10)), 4)
    s.add_request(req)
    out = s.schedule()
    s.update_from_output(out, runner.execute(out))
    assert req.status == RequestStatus.WAITING and req.kv_load_pending and not s.take_kv_loads()
    finished = run_until_done_with_loads(s, runner, {"c": list(range(1, 10))})
    assert finished["c"] == "length" and req.num_cached_tokens == 8


def consume_request(req_id, prompt, block_size, *, num_full=None, max_tokens=4, wait_for=None, salt=None):
    probe = Request("probe", prompt, SamplingParams(), cache_salt=salt)
    probe.update_block_hashes(block_size)
    n = len(prompt) // block_size if num_full is None else num_full
    kv = KVTransferParams(role="consume", transfer_id=f"t-{req_id}", producer_address="producer:1",
                          num_full_blocks=n, block_hashes=probe.block_hashes[:n], block_size=block_size)
    return Request(req_id, prompt, SamplingParams(max_tokens=max_tokens), kv_transfer=kv, wait_for=wait_for,
                   cache_salt=salt)


def write(runner: FakeRunner, load, prompt):
    """What a good pull does: the producer's blocks (the prompt's tokens) land in the load's blocks."""
    bs = runner.block_size
    for i, block in enumerate(load.block_ids):
        first = (load.first_block + i) * bs
        runner.slots[block * bs:(block + 1) * bs] = prompt[first:first + bs]


def run_until_done_with_loads(s, runner, prompts) -> dict[str, str]:
    """Step (landing every pull right after the step that started it) until nothing is left;
    returns each request's finish reason."""
    finished = {}
    for _ in range(1000):
        if not s.has_unfinished_requests():
            return finished
        out = s.schedule()
        for o in s.update_from_output(out, runner.execute(out)):
            if o.finished:
                finished[o.req_id] = o.finish_reason
        for load in s.take_kv_loads():
            if load.block_ids:
                write(runner, load, prompts[load.request_id])
                s.finish_kv_load(load.request_id, ok=True)
    raise AssertionError("did not finish")


PREFIXES = [[], [7] * 9, list(range(50, 70))]


class ConsumerMachine(RuleBasedStateMachine):
    """A consumer's scheduler under random adds (ordinary and pulling, n > 1 siblings), steps,
    pulls that land, fail or come late, and aborts. The prefix cache must never point at a block
    whose pull has not landed, and nothing may leak."""

    @initialize(block_size=st.sampled_from([1, 2, 4]), num_blocks=st.integers(6, 40), budget=st.integers(4, 32),
                max_num_seqs=st.integers(1, 6), caching=st.booleans())
    def setup(self, block_size, num_blocks, budget, max_num_seqs, caching):
        self.config = SchedulerConfig(max_model_len=64, max_num_batched_tokens=budget, max_num_seqs=max_num_seqs,
                                      block_size=block_size, num_blocks=num_blocks, enable_prefix_caching=caching)
        self.s = Scheduler(self.config)
        self.runner = FakeRunner(num_blocks, block_size)
        self.prompts: dict[str, list[int]] = {}
        self.loads = []          # pulls in flight, in any order of landing
        self.live: set[str] = set()
        self.done: dict[str, Request] = {}
        self.hash_tokens: dict[bytes, tuple[int, ...]] = {}
        self.counter = 0

    @rule(prefix=st.sampled_from(PREFIXES), tail=st.lists(st.integers(0, 20), min_size=1, max_size=30),
          pull=st.booleans(), partial=st.booleans(), siblings=st.integers(1, 3), max_tokens=st.integers(1, 8))
    def add(self, prefix, tail, pull, partial, siblings, max_tokens):
        self.counter += 1
        prompt = prefix + tail
        bs = self.config.block_size
        ids = [f"r{self.counter}-{i}" for i in range(siblings)]
        for i, req_id in enumerate(ids):
            if pull and i == 0:
                full = len(prompt) // bs
                req = consume_request(req_id, prompt, bs, num_full=full // 2 if partial else full,
                                      max_tokens=max_tokens)
            else:
                req = Request(req_id, prompt, SamplingParams(max_tokens=max_tokens),
                              wait_for=ids[0] if pull and i else None)
            try:
                self.s.add_request(req)
            except ValueError:
                return            # too long for this pool: refused whole (siblings before it finish normally)
            self.prompts[req_id] = prompt
            self.live.add(req_id)

    @rule()
    def step(self):
        out = self.s.schedule()
        self.loads += [load for load in self.s.take_kv_loads() if load.block_ids]
        for o in self.s.update_from_output(out, self.runner.execute(out)):
            if o.finished:
                self.live.discard(o.req_id)

    @precondition(lambda self: self.loads)
    @rule(data=st.data(), ok=st.booleans())
    def land(self, data, ok):
        load = self.loads.pop(data.draw(st.integers(0, len(self.loads) - 1)))
        if load.request_id not in self.s.loading:
            return                # aborted meanwhile: the engine drops the late data
        if ok:
            write(self.runner, load, self.prompts[load.request_id])
        assert self.s.finish_kv_load(load.request_id, ok=ok)

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def abort(self, data):
        req_id = data.draw(st.sampled_from(sorted(self.live)))
        self.s.finish_requests([req_id], RequestStatus.FINISHED_ABORTED)
        self.live.discard(req_id)

    @invariant()
    def blocks_are_consistent(self):
        if not hasattr(self, "s"):
            return
        assert_pool_consistent(self.s, self.runner, self.s.requests.values(), self.hash_tokens)
        for req in self.s.loading.values():
            assert req.status == RequestStatus.WAITING_FOR_REMOTE_KV and req not in self.s.running
        assert len(self.s.running) <= self.config.max_num_seqs

    def teardown(self):
        if not hasattr(self, "s"):
            return
        for _ in range(5000):
            for load in self.loads:
                if load.request_id in self.s.loading:
                    write(self.runner, load, self.prompts[load.request_id])
                    self.s.finish_kv_load(load.request_id, ok=True)
            self.loads = []
            if not self.s.has_unfinished_requests():
                break
            self.step()
        assert not self.s.has_unfinished_requests() and not self.live and not self.s.loading
        pool = self.s.kv.pool
        assert pool.num_free_blocks == pool.num_blocks - 1 and all(b.ref_cnt == 0 for b in pool.blocks)


TestConsumerProperties = ConsumerMachine.TestCase
TestConsumerProperties.settings = settings(max_examples=120, stateful_step_count=50, deadline=None,
                                           suppress_health_check=[HealthCheck.too_slow])
