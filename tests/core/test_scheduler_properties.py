"""Property tests: random add / step / abort / finish sequences keep every invariant."""

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from jaxserve.core import Request, RequestStatus, SamplingParams, Scheduler, SchedulerConfig
from jaxserve.core.speculative import SpeculativeConfig

from .sim import FakeRunner, assert_pool_consistent

PREFIXES = [[], [7] * 9, list(range(50, 70))]   # shared prefixes make prefix-cache hits likely


class SchedulerMachine(RuleBasedStateMachine):
    @initialize(
        block_size=st.sampled_from([1, 2, 4, 8]),
        num_blocks=st.integers(4, 40),
        budget=st.integers(4, 64),
        max_num_seqs=st.integers(1, 8),
        policy=st.sampled_from(["fcfs", "priority"]),
        chunked=st.booleans(),
        caching=st.booleans(),
        threshold=st.sampled_from([0, 0, 3]),
        speculative=st.sampled_from([None, None, (3, 1, 2), (1, 2, 4)]),
        overlap=st.booleans(),
    )
    def setup(self, block_size, num_blocks, budget, max_num_seqs, policy, chunked, caching, threshold, speculative,
              overlap):
        spec = None if speculative is None else SpeculativeConfig("ngram", *speculative)
        # Async scheduling (the engine's): each step is scheduled and launched before the one in
        # flight is collected. The engine runs drafts one step at a time.
        self.overlap = overlap and spec is None
        self.in_flight = None
        self.config = SchedulerConfig(
            max_model_len=64 if chunked else budget, max_num_batched_tokens=budget, max_num_seqs=max_num_seqs,
            block_size=block_size, num_blocks=num_blocks, enable_prefix_caching=caching,
            enable_chunked_prefill=chunked, long_prefill_token_threshold=threshold, policy=policy, speculative=spec)
        self.s = Scheduler(self.config)
        # A small vocabulary repeats n-grams, so drafts are proposed and often accepted.
        self.runner = FakeRunner(num_blocks, block_size, vocab=1000 if spec is None else 3)
        self.live: dict[str, Request] = {}
        self.done: list[Request] = []
        self.hash_tokens: dict[bytes, tuple[int, ...]] = {}
        self.counter = 0

    @rule(prefix=st.sampled_from(PREFIXES), tail=st.lists(st.integers(0, 20), min_size=1, max_size=30),
          max_tokens=st.integers(1, 20), priority=st.integers(0, 3), salt=st.sampled_from([None, None, "x"]),
          reuse=st.booleans())
    def add(self, prefix, tail, max_tokens, priority, salt, reuse):
        self.counter += 1
        # A finished request's id again: a step still in flight for the old one must not touch it.
        free = sorted({r.request_id for r in self.done} - set(self.live) - set(self.s.requests))
        req_id = free[-1] if reuse and free else f"r{self.counter}"
        req = Request(req_id, prefix + tail, SamplingParams(max_tokens=max_tokens),
                      priority=priority, arrival_time=float(self.counter), cache_salt=salt)
        try:
            self.s.add_request(req)
        except ValueError:
            cfg = self.config
            max_len = min(req.num_prompt_tokens + max_tokens, cfg.max_model_len)
            assert req.num_prompt_tokens >= cfg.max_model_len or \
                -(-(max_len - 1) // cfg.block_size) > cfg.num_blocks - 1
            return
        self.live[req.request_id] = req

    @rule()
    def step(self):
        if not self.overlap:
            out = self.schedule()
            self.update(out, self.runner.execute(out))
            return
        if self.in_flight is None:
            out = self.schedule()
            self.in_flight = (out, self.runner.launch(out))
        out, launched = self.in_flight
        following = self.schedule() if self.s.has_unfinished_requests() else None
        self.in_flight = None if following is None else (following, self.runner.launch(following))
        self.update(out, self.runner.collect(launched))

    def update(self, out, runner_output):
        for o in self.s.update_from_output(out, runner_output):
            if o.finished:
                self.done.append(self.live.pop(o.req_id))

    def schedule(self):
        out = self.s.schedule()
        cfg = self.config
        assert out.total_num_scheduled_tokens <= cfg.max_num_batched_tokens
        assert out.total_num_scheduled_tokens == sum(out.num_scheduled_tokens.values())
        assert len(out.num_scheduled_tokens) <= cfg.max_num_seqs
        assert all(n > 0 for n in out.num_scheduled_tokens.values())
        drafts = out.scheduled_spec_decode_tokens
        if cfg.long_prefill_token_threshold:   # a prefill cap: a decode's drafts come on top
            assert all(n - len(drafts.get(r, [])) <= cfg.long_prefill_token_threshold
                       for r, n in out.num_scheduled_tokens.items())
        for r, d in drafts.items():
            assert cfg.speculative and 1 <= len(d) <= cfg.speculative.num_speculative_tokens
            assert out.num_scheduled_tokens[r] == 1 + len(d)
        for r in self.live.values():
            assert r.num_pending <= (2 if self.in_flight else 1)
        return out

    @precondition(lambda self: self.live)
    @rule(data=st.data(), abort=st.booleans())
    def end_one(self, data, abort):
        req_id = data.draw(st.sampled_from(sorted(self.live)))
        status = RequestStatus.FINISHED_ABORTED if abort else RequestStatus.FINISHED_STOPPED
        self.s.finish_requests([req_id], status)
        req = self.live.pop(req_id)
        assert req.status == status
        self.done.append(req)

    @invariant()
    def blocks_are_consistent(self):
        if not hasattr(self, "s"):
            return
        assert_pool_consistent(self.s, self.runner, list(self.live.values()) + list(self.s.requests.values()),
                               self.hash_tokens)
        assert len(self.s.running) <= self.config.max_num_seqs

    def teardown(self):
        if not hasattr(self, "s"):
            return
        # Every live request finishes once nothing else is added, with the tokens it would get alone.
        for _ in range(5000):
            if not self.s.has_unfinished_requests():
                break
            self.step()
        if self.in_flight is not None:   # a step launched for requests that ended meanwhile
            out, launched = self.in_flight
            assert self.s.update_from_output(out, self.runner.collect(launched)) == []
        assert not self.s.has_unfinished_requests() and not self.live
        pool = self.s.kv.pool
        assert pool.num_free_blocks == pool.num_blocks - 1
        assert all(b.ref_cnt == 0 for b in pool.blocks)
        for req in self.done:
            if req.status == RequestStatus.FINISHED_ABORTED:
                continue
            expected = list(req.prompt_token_ids)
            while len(expected) - req.num_prompt_tokens < req.num_output_tokens:
                expected.append(self.runner.next_token(expected))
            assert req.all_token_ids == expected
            limit = min(req.sampling_params.max_tokens, self.config.max_model_len - req.num_prompt_tokens)
            assert req.num_output_tokens == limit or req.status == RequestStatus.FINISHED_STOPPED


TestSchedulerProperties = SchedulerMachine.TestCase
TestSchedulerProperties.settings = settings(max_examples=150, stateful_step_count=60, deadline=None,
                                            suppress_health_check=[HealthCheck.too_slow])
