"""A stand-in runner for scheduler tests: keeps per-request state from SchedulerOutput
exactly as the real runner does, writes token ids into a fake KV pool, and returns
deterministic 'sampled' tokens, so tests can check what the cache really holds."""

from __future__ import annotations

from jaxserve.core import ModelRunnerOutput, SchedulerOutput


class FakeRunner:
    def __init__(self, num_blocks: int, block_size: int, vocab: int = 1000, eos: int | None = None) -> None:
        self.block_size = block_size
        self.vocab = vocab
        self.slots: list[int | None] = [None] * (num_blocks * block_size)  # token id written to each KV slot
        self.state: dict[str, dict] = {}   # req_id -> {"tokens": [...], "blocks": [...]}
        self.eos = eos

    def next_token(self, tokens: list[int]) -> int:
        return (sum(tokens) * 31 + len(tokens)) % self.vocab

    def execute(self, out: SchedulerOutput) -> ModelRunnerOutput:
        return self.collect(self.launch(out))

    def launch(self, out: SchedulerOutput) -> ModelRunnerOutput:
        """Compute the step at once (as the device would, in launch order) and hold its result
        for `collect`: with async scheduling the scheduler sees the tokens only then, while the
        next step, launched before that, already reads them (here: from this runner's state)."""
        for req_id in out.finished_req_ids | out.preempted_req_ids:
            self.state.pop(req_id, None)
        for new in out.scheduled_new_reqs:
            self.state[new.req_id] = {"tokens": new.prompt_token_ids + new.output_token_ids,
                                      "blocks": list(new.block_ids),
                                      "computed": new.num_computed_tokens}
        for cached in out.scheduled_cached_reqs:
            st = self.state[cached.req_id]
            st["blocks"].extend(cached.new_block_ids)
            assert st["computed"] == cached.num_computed_tokens, (cached, st["computed"])
        req_ids, sampled = [], []
        for req_id, n in out.num_scheduled_tokens.items():
            st = self.state[req_id]
            start = st["computed"]
            drafts = out.scheduled_spec_decode_tokens.get(req_id, [])
            tokens = st["tokens"] + drafts       # drafts follow the last real token
            assert n > 0 and start + n == len(tokens) if drafts else start + n <= len(tokens)
            for pos in range(start, start + n):
                block = st["blocks"][pos // self.block_size]
                assert block != 0, "wrote into the null block"
                self.slots[block * self.block_size + pos % self.block_size] = tokens[pos]
            st["computed"] = start + n
            req_ids.append(req_id)
            if st["computed"] >= len(st["tokens"]):
                assert req_id in out.sampling_req_ids, f"{req_id} samples, but the scheduler does not say so"
                # A token after the last real one and after each draft; drafts are kept while they match.
                new = [self.next_token(st["tokens"])]
                for d in drafts:
                    if d != new[-1]:
                        break
                    new.append(self.next_token(st["tokens"] + new))
                st["computed"] -= len(drafts) - (len(new) - 1)
                st["tokens"] += new
                sampled.append(new)
            else:
                assert req_id not in out.sampling_req_ids, f"{req_id} does not sample, but the scheduler says so"
                sampled.append([])
        return ModelRunnerOutput(req_ids=req_ids, sampled_token_ids=sampled)

    def collect(self, launched: ModelRunnerOutput) -> ModelRunnerOutput:
        return launched

    def block_tokens(self, block_id: int) -> list[int | None]:
        bs = self.block_size
        return self.slots[block_id * bs:(block_id + 1) * bs]


def make_scheduler(**overrides):
    from jaxserve.core import Scheduler, SchedulerConfig

    cfg = dict(max_model_len=256, max_num_batched_tokens=32, max_num_seqs=8, block_size=4, num_blocks=64)
    cfg.update(overrides)
    config = SchedulerConfig(**cfg)
    return Scheduler(config), FakeRunner(config.num_blocks, config.block_size)


def step(scheduler, runner):
    out = scheduler.schedule()
    return out, scheduler.update_from_output(out, runner.execute(out))


def run_until_done(scheduler, runner, max_steps=10_000):
    """Step until nothing is left; returns {req_id: (token_ids, finish_reason)} and the step count."""
    results: dict[str, tuple[list[int], str | None]] = {}
    for n in range(max_steps):
        if not scheduler.has_unfinished_requests():
            return results, n
        _, outs = step(scheduler, runner)
        for o in outs:
            toks, _ = results.get(o.req_id, ([], None))
            results[o.req_id] = (toks + o.new_token_ids, o.finish_reason)
    raise AssertionError("scheduler did not finish")


def assert_pool_consistent(scheduler, runner: FakeRunner, requests, hash_tokens: dict) -> None:
    """Every block's ref count is the number of requests holding it, free blocks are exactly the
    unreferenced ones, and every prefix-cache entry points at a block holding the hashed tokens.
    `hash_tokens` accumulates {block hash: tokens} over the `requests` seen so far."""
    pool = scheduler.kv.pool
    holders: dict[int, int] = {}
    for blocks in scheduler.kv.req_to_blocks.values():
        for b in blocks:
            holders[b.block_id] = holders.get(b.block_id, 0) + 1
    free_ids = {b.block_id for b in pool.free_queue}
    assert len(free_ids) == pool.num_free_blocks
    assert 0 not in free_ids and 0 not in holders
    for b in pool.blocks[1:]:
        assert b.ref_cnt == holders.get(b.block_id, 0)
        assert (b.block_id in free_ids) == (b.ref_cnt == 0), "a block is both free and in use, or neither"
    bs = scheduler.config.block_size
    for req in requests:
        for i, h in enumerate(req.block_hashes):
            hash_tokens[h] = tuple(req.all_token_ids[i * bs:(i + 1) * bs])
    for h, block in pool.cached.items():
        assert block.block_hash == h
        assert tuple(runner.block_tokens(block.block_id)) == hash_tokens[h], \
            "the prefix cache points at a block that does not hold the hashed tokens"
