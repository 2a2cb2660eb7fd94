"""Disaggregated prefill/decode at the engine level: a producer engine exports, a consumer
engine pulls over gRPC (loopback), and the tokens are those of one engine doing both. Every
failure the protocol names is injected, and no block or export is left behind."""

import dataclasses
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from jaxserve.core import SamplingParams
from jaxserve.core.kv_transfer import IncompatibleKVError, KVTransferParams
from jaxserve.engine.llm_engine import LLMEngine
from tests.conftest import TINY_ENGINE_OPTIONS

from .kv_harness import KVServer, consume, produce, run

GREEDY = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def kv_pair(tiny_models):
    model = str(tiny_models["llama"])
    producer = LLMEngine.from_kwargs(model, kv_role="producer", **TINY_ENGINE_OPTIONS)
    consumer = LLMEngine.from_kwargs(model, kv_role="consumer", **TINY_ENGINE_OPTIONS)
    server = KVServer(producer)
    yield producer, consumer, server
    server.stop()
    assert_nothing_held(producer, consumer)


@pytest.fixture
def pair(kv_pair):
    """(producer, consumer, the producer's KVTransfer address); both must end with nothing held."""
    producer, consumer, server = kv_pair
    return producer, consumer, server.address


@pytest.fixture
def kv_server_stall(kv_pair):
    """stall(seconds): the producer's gRPC event loop answers nothing for that long."""
    return lambda seconds: kv_pair[2].loop.call_soon_threadsafe(time.sleep, seconds)


def assert_nothing_held(*engines):
    for engine in engines:
        stats = engine.stats()
        assert stats["kv_free_blocks"] == stats["kv_total_blocks"], "leaked KV blocks"
        assert stats["num_running"] == stats["num_waiting"] == stats["num_waiting_for_kv"] == 0
        assert not engine.has_unfinished_requests()
        assert stats["compiles_after_warmup"] == 0
    producer = engines[0]
    deadline = time.monotonic() + 5
    while producer.exports is not None and len(producer.exports) and time.monotonic() < deadline:
        time.sleep(0.05)      # a release travels on a worker thread
    assert producer.exports is None or len(producer.exports) == 0, "leaked exports"


def prompt(n, seed=0):
    return [int(t) for t in np.random.default_rng(seed).integers(3, 500, size=n)]


def closed_port_address():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{s.getsockname()[1]}"


@pytest.mark.parametrize("n", [5, 16, 17, 40, 100])
def test_greedy_tokens_equal_one_engine_doing_both(pair, tiny_engine, n):
    producer, consumer, address = pair
    ids = prompt(n, seed=n)
    want = run(tiny_engine, "ref", ids, GREEDY)
    kv = produce(producer, "p", ids, GREEDY, f"t-greedy-{n}")
    assert kv.num_full_blocks == n // 16 and len(kv.block_hashes) == kv.num_full_blocks
    got = consume(consumer, "c", ids, GREEDY, kv, address)
    assert got.outputs[0].token_ids == want.outputs[0].token_ids
    # The consumer computed only what the pull did not bring: the last block (or the last token).
    assert got.num_cached_tokens == min(kv.num_full_blocks, (n - 1) // 16) * 16
    assert_nothing_held(producer, consumer)


def test_seeded_sampling_and_n_siblings_equal_one_engine(pair, tiny_engine):
    producer, consumer, address = pair
    ids = prompt(70, seed=1)
    params = SamplingParams(max_tokens=12, temperature=1.0, top_k=40, seed=7, n=3, ignore_eos=True)
    want = run(tiny_engine, "ref", ids, params)
    kv = produce(producer, "p", ids, params, "t-seeded")
    got = consume(consumer, "c", ids, params, kv, address)
    assert [o.token_ids for o in got.outputs] == [o.token_ids for o in want.outputs]
    assert consumer.kv_stats.snapshot()["outcomes"]["received"] >= 1
    assert_nothing_held(producer, consumer)


def test_a_consumer_prefix_hit_pulls_only_the_blocks_it_lacks(pair, tiny_engine):
    producer, consumer, address = pair
    shared = prompt(48, seed=2)
    first, second = shared + prompt(20, seed=3), shared + prompt(30, seed=4)
    run(consumer, "warm", first, GREEDY)          # the consumer caches the shared 3 blocks itself
    kv = produce(producer, "p", second, GREEDY, "t-prefix")
    before = consumer.kv_stats.snapshot()["bytes"]
    got = consume(consumer, "c", second, GREEDY, kv, address)
    assert got.outputs[0].token_ids == run(tiny_engine, "ref", second, GREEDY).outputs[0].token_ids
    per_block = producer.replicas[0].runner.gather_blocks([1]).nbytes
    assert consumer.kv_stats.snapshot()["bytes"] - before == 1 * per_block   # block 3 only (blocks 0-2 hit)
    # All of it cached already: nothing is pulled and the export is released.
    kv = produce(producer, "p2", second, GREEDY, "t-prefix-all")
    consume(consumer, "c2", second, GREEDY, kv, address)
    assert consumer.kv_stats.snapshot()["outcomes"]["not_needed"] >= 1
    assert_nothing_held(producer, consumer)


def test_an_unreachable_producer_means_the_consumer_computes_the_prompt(pair, tiny_engine):
    producer, consumer, address = pair
    ids = prompt(60, seed=5)
    kv = produce(producer, "p", ids, GREEDY, "t-unreachable")
    failed = consumer.kv_stats.snapshot()["outcomes"].get("failed", 0)
    got = consume(consumer, "c", ids, GREEDY, kv, closed_port_address())
    assert got.outputs[0].token_ids == run(tiny_engine, "ref", ids, GREEDY).outputs[0].token_ids
    assert got.outputs[0].finish_reason == "length"
    assert consumer.kv_stats.snapshot()["outcomes"]["failed"] == failed + 1
    assert producer.exports.release("t-unreachable")   # never pulled: still held until its lease ends
    assert_nothing_held(producer, consumer)


def test_the_fail_policy_aborts_the_request_instead(pair):
    producer, consumer, _ = pair
    ids = prompt(60, seed=6)
    kv = produce(producer, "p", ids, GREEDY, "t-fail")
    consumer.config = dataclasses.replace(consumer.config, kv_load_failure_policy="fail")
    try:
        got = consume(consumer, "c", ids, GREEDY, kv, closed_port_address())
    finally:
        consumer.config = dataclasses.replace(consumer.config, kv_load_failure_policy="recompute")
    assert got.outputs[0].finish_reason == "abort" and got.outputs[0].token_ids == []
    producer.exports.release("t-fail")
    assert_nothing_held(producer, consumer)


def test_an_expired_lease_is_a_failed_pull_and_the_prompt_is_computed_here(pair, tiny_engine):
    producer, consumer, address = pair
    ids = prompt(50, seed=7)
    lease = producer.exports.lease_seconds
    producer.exports.lease_seconds = 0.05
    try:
        kv = produce(producer, "p", ids, GREEDY, "t-expired")
        time.sleep(0.2)
        assert len(producer.exports) == 0
    finally:
        producer.exports.lease_seconds = lease
    got = consume(consumer, "c", ids, GREEDY, kv, address)
    assert got.outputs[0].token_ids == run(tiny_engine, "ref", ids, GREEDY).outputs[0].token_ids
    assert producer.kv_stats.snapshot()["outcomes"]["expired"] >= 1
    assert_nothing_held(producer, consumer)


def test_aborting_a_request_whose_pull_is_in_flight_frees_everything(pair, kv_server_stall):
    producer, consumer, address = pair
    ids = prompt(100, seed=8)
    kv = produce(producer, "p", ids, GREEDY, "t-abort")
    kv_server_stall(1.0)                          # the pull cannot be answered for a second
    consumer.add_request("c", ids, GREEDY, kv_transfer=dataclasses.replace(kv, role="consume",
                                                                           producer_address=address))
    consumer.step()                               # parks the request and starts its pull
    assert consumer.stats()["num_waiting_for_kv"] == 1
    consumer.abort_request("c")
    for _ in range(100):                          # the late pull lands and is dropped
        consumer.step()
        if not consumer.kv_connector.num_pending:
            break
        time.sleep(0.01)
    assert_nothing_held(producer, consumer)


def test_aborting_a_request_before_its_pull_releases_the_export(pair):
    producer, consumer, address = pair
    ids = prompt(40, seed=9)
    kv = produce(producer, "p", ids, GREEDY, "t-abort-early")
    consumer.add_request("c", ids, GREEDY, kv_transfer=dataclasses.replace(kv, role="consume",
                                                                           producer_address=address))
    consumer.abort_request("c")
    assert_nothing_held(producer, consumer)       # waits for the release to reach the producer


def test_a_heartbeat_keeps_an_export_alive_while_its_request_waits(pair):
    producer, consumer, address = pair
    kv = produce(producer, "p", prompt(40, seed=10), GREEDY, "t-heartbeat")
    lease = producer.exports.lease_seconds
    producer.exports.lease_seconds = 0.9
    try:
        producer.exports.extend("t-heartbeat")
        consumer.kv_connector.watch("waiting", dataclasses.replace(kv, role="consume", producer_address=address,
                                                                   lease_seconds=0.9))
        time.sleep(2.0)
        assert len(producer.exports) == 1, "the heartbeats did not renew the lease"
        consumer.kv_connector.unwatch("waiting")
        time.sleep(1.2)
        assert len(producer.exports) == 0
    finally:
        producer.exports.lease_seconds = lease
    assert_nothing_held(producer, consumer)


def test_bad_transfers_are_refused_with_the_reason(pair):
    producer, consumer, address = pair
    ids = prompt(40, seed=11)
    kv = produce(producer, "p", ids, GREEDY, "t-bad")
    consume_kv = dataclasses.replace(kv, role="consume", producer_address=address)
    with pytest.raises(IncompatibleKVError, match="compat hash"):
        consumer.add_request("c", ids, GREEDY, kv_transfer=dataclasses.replace(consume_kv, compat_hash="other"))
    with pytest.raises(ValueError, match="another prompt"):
        consumer.add_request("c", ids[:-1] + [ids[-1] + 1] if len(ids) % 16 == 0 else [ids[0] + 1] + ids[1:],
                             GREEDY, kv_transfer=consume_kv)
    with pytest.raises(ValueError, match="another prompt"):
        consumer.add_request("c", ids, GREEDY, kv_transfer=consume_kv, cache_salt="tenant")
    with pytest.raises(ValueError, match="--kv-role producer"):
        consumer.add_request("c", ids, GREEDY, kv_transfer=KVTransferParams(role="produce", transfer_id="x"))
    with pytest.raises(ValueError, match="--kv-role consumer"):
        producer.add_request("c", ids, GREEDY, kv_transfer=consume_kv)
    with pytest.raises(ValueError, match="n=1"):
        producer.add_request("c", ids, GREEDY.clone(n=2), kv_transfer=KVTransferParams(role="produce",
                                                                                     transfer_id="x"))
    with pytest.raises(ValueError, match="prompt_logprobs"):
        consumer.add_request("c", ids, GREEDY.clone(prompt_logprobs=1), kv_transfer=consume_kv)
    assert producer.exports.release("t-bad")
    assert_nothing_held(producer, consumer)


def test_a_multi_process_engine_refuses_a_kv_role():
    from jaxserve.config import EngineConfig
    config = EngineConfig(kv_role="producer", num_processes=2, process_id=1, coordinator_address="127.0.0.1:1")
    assert config.kv_role == "producer"      # refused when the engine starts (LLMEngine._start_kv_role)
    with pytest.raises(ValueError, match="kv_role"):
        EngineConfig(kv_role="prefill")


ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_producers_with_tensor_parallelism_feed_a_consumer_without(tiny_models):
    """tp=2 (KV heads split) and tp=4 (KV heads repeated in the pool) producers, a tp=1 consumer."""
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS="--xla_force_host_platform_device_count=4")
    proc = subprocess.run([sys.executable, "-m", "tests.engine.kv_transfer_worker", str(tiny_models["llama"])],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "tp=2 identical 3/3, pulls received so far 3" in proc.stdout, proc.stdout
    assert "tp=4 identical 3/3, pulls received so far 6" in proc.stdout, proc.stdout


def test_a_producer_request_that_fails_leaves_no_export(pair, monkeypatch):
    from jaxserve.core.kv_transfer import KVTransferParams
    from tests.faults import MARKER, fail_marked_requests
    producer, _, _ = pair
    fail_marked_requests(monkeypatch, after=1)     # its one token's processing raises
    out = run(producer, "fails", prompt(40) + MARKER, GREEDY.clone(max_tokens=1),
              kv_transfer=KVTransferParams(role="produce", transfer_id="t-fails"))
    assert "InjectedFault" in out.error and out.kv_transfer_params is None
    assert len(producer.exports) == 0      # nothing gathered for a consumer that will never pull it


class HeldPulls:       # a consumer's connector, with each pull held until the test delivers it
    def __init__(self):
        self.started, self.results = [], []
    num_pending = property(lambda self: len(self.started))
    def watch(self, *a): pass
    def unwatch(self, *a): pass
    def release(self, *a): pass
    def start(self, replica, load): self.started.append((replica, load))
    def done(self, timeout=0.0):
        out, self.results = self.results, []
        return out
    def deliver(self, load, marker):
        from jaxserve.engine.kv_connector import PullResult
        replica = next(r for r, held in self.started if held is load)
        self.started = [(r, held) for r, held in self.started if held is not load]
        payload = np.full((len(load.block_ids), *replica.runner.kv_block_shape), marker, np.float32)
        self.results.append(PullResult(replica, load, payload))


def consume_params(engine, ids, transfer_id, blocks):
    from jaxserve.core import Request
    from jaxserve.core.kv_transfer import KVTransferParams
    probe = Request("probe", ids, SamplingParams())
    probe.update_block_hashes(16)
    return KVTransferParams(role="consume", transfer_id=transfer_id, producer_address="producer:1",
                            num_full_blocks=blocks, block_hashes=probe.block_hashes[:blocks], block_size=16,
                            compat_hash=engine.compat_hash)


def test_a_request_ending_while_only_a_pull_is_pending_leaves_no_state_in_the_runner(tiny_models):
    """While a pull is all that is left, the consumer waits for it instead of stepping; a request that
    ended just before must still reach the runner as ended (the scheduler names it once), or its
    state (token ids, block ids) stays in the runner for good."""
    engine = LLMEngine.from_kwargs(str(tiny_models["llama"]), kv_role="consumer", **TINY_ENGINE_OPTIONS)
    engine.kv_connector.close()
    engine.kv_connector = held = HeldPulls()
    ids = prompt(40, seed=3)
    engine.add_request("plain", prompt(8, seed=4), GREEDY.clone(max_tokens=1))
    engine.add_request("pulled", ids, GREEDY.clone(max_tokens=2), kv_transfer=consume_params(engine, ids, "t", 2))
    finished = [o.request_id for o in engine.step() if o.finished]
    assert finished == ["plain"] and held.num_pending == 1
    engine.step()                       # nothing to compute: only the pull is pending
    assert "plain" not in engine.runner.states
    held.deliver(held.started[0][1], 1.0)
    while engine.has_unfinished_requests():
        engine.step()


def test_a_pull_landing_after_its_request_ended_does_not_serve_a_new_request_of_its_id(tiny_models):
    """A client's retry reuses the request id (the gRPC API takes the client's): the aborted request's
    pull, landing late, must neither be written nor mark the new request's own pull done (it was
    written into the freed blocks, and the new request ran on blocks nothing had written)."""
    engine = LLMEngine.from_kwargs(str(tiny_models["llama"]), kv_role="consumer",
                                   **{**TINY_ENGINE_OPTIONS, "num_kv_blocks": 9})
    engine.kv_connector.close()
    engine.kv_connector = held = HeldPulls()
    ids = prompt(100)

    def kv(transfer_id):
        return consume_params(engine, ids, transfer_id, 6)

    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    engine.add_request("x", ids, params, kv_transfer=kv("t-old"))
    engine.step()
    old = held.started[0][1]
    engine.abort_request("x")
    engine.add_request("x", ids, params, kv_transfer=kv("t-new"))
    engine.step()
    new = held.started[-1][1]
    held.deliver(old, 1.0)
    engine.step()
    assert "x" in engine.scheduler.loading                       # still waiting for its own pull
    held.deliver(new, 2.0)
    while engine.has_unfinished_requests():
        engine.step()
    for block in new.block_ids:                                  # its pull's data, all of it
        assert (engine.runner.gather_blocks([block]) == 2.0).all()
