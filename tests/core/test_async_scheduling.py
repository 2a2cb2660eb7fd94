"""Async scheduling at the scheduler: step N + 1 is scheduled and launched before step N's
tokens come back (the engine's default). Driven with the stand-in runner, which computes a
step when it is launched (as the device does, in order) and hands its tokens over only at
collect."""

from jaxserve.core import Request, RequestStatus, SamplingParams

from .sim import assert_pool_consistent, make_scheduler, run_until_done


class Overlapped:
    """The engine's loop with async scheduling: launch the next step, then collect the one before."""

    def __init__(self, scheduler, runner):
        self.s, self.r = scheduler, runner
        self.in_flight = None
        self.outputs: list = []     # every SchedulerOutput, in order
        self.max_pending = 0

    def schedule(self):
        out = self.s.schedule()
        self.outputs.append(out)
        self.max_pending = max([self.max_pending] + [r.num_pending for r in self.s.running])
        return out, self.r.launch(out)

    def step(self) -> list:
        current = self.in_flight or self.schedule()
        self.in_flight = self.schedule() if self.s.has_unfinished_requests() else None
        return self.s.update_from_output(current[0], self.r.collect(current[1]))

    def run(self, max_steps: int = 10_000) -> dict:
        results = {}
        for _ in range(max_steps):
            if not self.s.has_unfinished_requests():
                break
            for o in self.step():
                toks, _ = results.get(o.req_id, ([], None))
                results[o.req_id] = (toks + o.new_token_ids, o.finish_reason)
        if self.in_flight is not None:   # launched for requests that ended meanwhile: nothing comes of it
            assert self.s.update_from_output(self.in_flight[0], self.r.collect(self.in_flight[1])) == []
            self.in_flight = None
        return results


def workload(eos=None):
    """Prompts longer than the budget (chunked), shared prefixes, max_tokens from 1 up."""
    reqs = []
    for i in range(10):
        prompt = [5] * 8 * (i % 3) + list(range(100 * i, 100 * i + 3 + 5 * i))   # up to 64 tokens
        reqs.append(Request(f"r{i}", prompt, SamplingParams(max_tokens=1 + 2 * i, ignore_eos=eos is None),
                            eos_token_ids=() if eos is None else (eos,)))
    return reqs


def test_overlapped_steps_give_the_tokens_of_steps_run_one_by_one():
    # A pool small enough that requests are preempted while a step for them is in flight.
    for num_blocks in (64, 28):
        s, r = make_scheduler(num_blocks=num_blocks, max_num_batched_tokens=16)
        for q in workload():
            s.add_request(q)
        expected, _ = run_until_done(s, r)

        s, r = make_scheduler(num_blocks=num_blocks, max_num_batched_tokens=16)
        reqs = workload()
        for q in reqs:
            s.add_request(q)
        loop = Overlapped(s, r)
        assert loop.run() == expected
        assert loop.max_pending == 2          # the steps did overlap
        assert num_blocks == 64 or s.num_preemptions > 0
        assert_pool_consistent(s, r, reqs, {})
        assert s.kv.pool.num_free_blocks == s.kv.pool.num_blocks - 1


def test_a_request_stopped_by_a_token_has_one_more_step_computed_and_dropped():
    s, r = make_scheduler()
    stop = r.next_token(list(range(5)) + [r.next_token(list(range(5)))])   # its second token
    s.add_request(Request("a", list(range(5)), SamplingParams(max_tokens=10), eos_token_ids=(stop,)))
    loop = Overlapped(s, r)
    results = loop.run()
    assert results["a"][1] == "stop" and len(results["a"][0]) == 2
    # Three steps sampled for it: the third was launched before the second's EOS came back.
    assert sum("a" in out.sampling_req_ids for out in loop.outputs) == 3
    assert s.kv.pool.num_free_blocks == s.kv.pool.num_blocks - 1


def test_no_step_is_scheduled_past_max_tokens_or_the_context_length():
    s, r = make_scheduler(max_model_len=12)
    s.add_request(Request("short", [1, 2, 3], SamplingParams(max_tokens=4, ignore_eos=True)))
    s.add_request(Request("long", [4, 5, 6], SamplingParams(max_tokens=100, ignore_eos=True)))
    s.add_request(Request("one", [7, 8, 9], SamplingParams(max_tokens=1, ignore_eos=True)))
    loop = Overlapped(s, r)
    results = loop.run()
    assert [len(results[k][0]) for k in ("short", "long", "one")] == [4, 9, 1]
    for req_id, n in (("short", 4), ("long", 9), ("one", 1)):
        assert sum(req_id in out.sampling_req_ids for out in loop.outputs) == n


def test_a_step_in_flight_leaves_a_new_request_with_the_same_id_alone():
    s, r = make_scheduler()
    s.add_request(Request("x", list(range(6)), SamplingParams(max_tokens=20, ignore_eos=True)))
    loop = Overlapped(s, r)
    for _ in range(3):
        loop.step()
    assert "x" in loop.in_flight[0].sampling_req_ids         # a step sampling for it is in flight
    s.finish_requests("x", RequestStatus.FINISHED_ABORTED)
    new = Request("x", [50, 51, 52, 53], SamplingParams(max_tokens=5, ignore_eos=True))
    s.add_request(new)
    results = loop.run()
    expected = [50, 51, 52, 53]
    for _ in range(5):
        expected.append(r.next_token(expected))
    assert results["x"] == (expected[4:], "length")
    assert new.all_token_ids == expected


def test_an_abort_while_a_step_is_in_flight_returns_every_block():
    s, r = make_scheduler(num_blocks=32)
    for i in range(4):
        s.add_request(Request(f"r{i}", list(range(10 * i, 10 * i + 9)), SamplingParams(max_tokens=30)))
    loop = Overlapped(s, r)
    for _ in range(4):
        loop.step()
    s.finish_requests(["r1", "r2"], RequestStatus.FINISHED_ABORTED)
    results = loop.run()
    assert set(results) >= {"r0", "r3"} and results["r0"][1] == results["r3"][1] == "length"
    assert s.kv.pool.num_free_blocks == s.kv.pool.num_blocks - 1


def test_a_request_preempted_with_its_token_in_flight_samples_that_token_again():
    # Two decoding requests and a pool that holds 6 of the 8 blocks they need: the newer one is
    # preempted (while a step samples for it) when the older one needs a block.
    def run(overlap: bool):
        s, r = make_scheduler(num_blocks=7, block_size=4)
        for name, start in (("a", 0), ("b", 100)):
            s.add_request(Request(name, list(range(start, start + 8)), SamplingParams(max_tokens=8, ignore_eos=True)))
        results = Overlapped(s, r).run() if overlap else run_until_done(s, r)[0]
        return results, s.num_preemptions
    expected, _ = run(False)
    results, preemptions = run(True)
    assert preemptions > 0 and results == expected
    assert all(len(tokens) == 8 for tokens, _ in results.values())


def test_a_request_whose_last_token_is_in_flight_is_not_preempted_for_blocks_it_frees():
    # y (older) and x (newer, one token to sample) fill the pool's 3 blocks. While x's only token is
    # in flight, y's next token needs a block: y waits one step for the blocks x's update frees
    # instead of a preemption (of x, which would compute x again, or of y itself).
    def run(overlap: bool):
        s, r = make_scheduler(num_blocks=4, block_size=4)
        s.add_request(Request("y", [1, 2, 3, 4], SamplingParams(max_tokens=6, ignore_eos=True)))
        s.add_request(Request("x", [5, 6, 7, 8, 9, 10, 11], SamplingParams(max_tokens=1, ignore_eos=True)))
        results = Overlapped(s, r).run() if overlap else run_until_done(s, r)[0]
        return results, s.num_preemptions
    expected, preemptions = run(False)
    assert preemptions == 0
    assert run(True) == (expected, 0)
