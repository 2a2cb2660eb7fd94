"""The leader-to-follower step protocol: the msgpack wire format and the acknowledged deletion.

The channel runs against a fake key-value client (a dict) and against jax's real
coordination service, started in this process with two clients (no jax.distributed state).
"""

from __future__ import annotations

import ast
import dataclasses
import pathlib
import pickle
import socket
import threading

import msgspec
import pytest

from jaxserve.core import Request, RequestOutputKind, SamplingParams, StructuredOutputsParams
from jaxserve.core.outputs import CachedRequestData, NewRequestData, SchedulerOutput
from sharding.distributed import (FORMAT_VERSION, STOP, StepChannel, StepMessageError, decode_step,
                                  encode_step)
from tests.core.sim import FakeRunner, make_scheduler

ROOT = pathlib.Path(__file__).resolve().parents[2]

# Every SamplingParams field away from its default, so a field the wire format drops or
# coerces shows up as a difference.
FULL_PARAMS = SamplingParams(n=3, presence_penalty=0.5, frequency_penalty=-0.25, repetition_penalty=1.1,
                             temperature=0.7, top_p=0.9, top_k=40, min_p=0.05, seed=1234, stop=["\n\n", "END"],
                             stop_token_ids=[2, 7], ignore_eos=True, max_tokens=None, min_tokens=3, logprobs=5,
                             prompt_logprobs=2, include_stop_str_in_output=True, skip_special_tokens=False,
                             output_kind=RequestOutputKind.DELTA,
                             structured_outputs=StructuredOutputsParams(choice=("yes", "no")),
                             logit_bias={7: -2.5, 11: 100.0}, allowed_token_ids=[3, 7, 11, 40], bad_words=["no"],
                             bad_words_token_ids=[[5], [9, 12]], truncate_prompt_tokens=64)


def replicas() -> list[SchedulerOutput]:
    """Two replicas' outputs: new, resumed and cached requests, preemptions and finishes; one replica idle."""
    busy = SchedulerOutput(
        scheduled_new_reqs=[
            NewRequestData("req-0", [101, 102, 103, 104, 105], [], FULL_PARAMS, 1234, [3, 4], 4),
            NewRequestData("req-1#2", [9, 8], [55, 56, 57], SamplingParams(temperature=0.0, max_tokens=8),
                           987654321, [5, 6, 7], 0),
        ],
        scheduled_cached_reqs=[CachedRequestData("req-2", [8], 16), CachedRequestData("req-3", [], 9)],
        num_scheduled_tokens={"req-0": 1, "req-1#2": 5, "req-2": 4, "req-3": 1},
        total_num_scheduled_tokens=11,
        preempted_req_ids={"req-4"},
        finished_req_ids={"req-5", "req-6"},
        scheduled_spec_decode_tokens={"req-2": [17, 18, 19]},
    )
    idle = SchedulerOutput([], [], {}, 0, set(), set())
    return [busy, idle]


def test_every_sampling_param_in_the_fixture_differs_from_its_default():
    default = SamplingParams()
    same = [f.name for f in dataclasses.fields(SamplingParams)
            if getattr(FULL_PARAMS, f.name) == getattr(default, f.name)]
    assert same == []


def test_a_step_message_round_trips_exactly():
    message = replicas()
    decoded = decode_step(encode_step(7, message), 7)
    assert decoded == message
    new = decoded[0].scheduled_new_reqs[0]
    assert type(new.sampling_params) is SamplingParams and new.sampling_params == FULL_PARAMS
    assert type(new.sampling_params.output_kind) is RequestOutputKind
    assert type(decoded[0].preempted_req_ids) is set and type(decoded[0].finished_req_ids) is set
    assert decoded[0].scheduled_new_reqs[1].sampling_params.greedy


def test_stop_round_trips_and_only_stop_or_scheduler_outputs_are_sent():
    assert decode_step(encode_step(3, STOP), 3) == STOP
    with pytest.raises(ValueError, match="'halt' is not a step message"):
        encode_step(0, "halt")
    with pytest.raises(ValueError, match="dict is not a step message"):
        encode_step(0, {"replicas": []})
    with pytest.raises(ValueError, match="list of SchedulerOutput"):
        encode_step(0, [object()])


def test_a_follower_sees_what_the_scheduler_sent_over_a_run_with_preemptions():
    # The leader's runner gets the scheduler's outputs; a follower's runner gets them through the
    # wire format. Both must hold the same cache contents and sample the same tokens.
    scheduler, leader = make_scheduler(num_blocks=9, max_num_batched_tokens=64)
    follower = FakeRunner(9, 4)
    for i, params in enumerate([FULL_PARAMS.clone(n=1, max_tokens=20, min_tokens=0, stop_token_ids=[]),
                                SamplingParams(max_tokens=20), SamplingParams(temperature=0.0, max_tokens=6)]):
        scheduler.add_request(Request(f"r{i}", list(range(10 * i, 10 * i + 8)), params))
    steps = preemptions = 0
    while scheduler.has_unfinished_requests():
        out = scheduler.schedule()
        mirrored = decode_step(encode_step(steps, [out]), steps)[0]
        assert mirrored == out
        expected = leader.execute(out)
        assert follower.execute(mirrored) == expected
        scheduler.update_from_output(out, expected)
        steps += 1
        preemptions += len(out.preempted_req_ids)
    assert preemptions > 0 and follower.slots == leader.slots


def envelope(**changes) -> bytes:
    fields = {"version": FORMAT_VERSION, "step": 0, "kind": "step", "replicas": []}
    fields.update(changes)
    return msgspec.msgpack.encode(fields)


@pytest.mark.parametrize("data, match", [
    (b"", "malformed step message for step 0"),
    (b"\xc1garbage", "malformed step message"),
    (encode_step(0, replicas())[:-3], "malformed step message"),
    (pickle.dumps(replicas()), "malformed step message"),
    (envelope(kind="go"), r"malformed step message.*\$\.kind"),
    (envelope(extra=1), "malformed step message.*extra"),
    (envelope(step="0"), r"Expected `int`, got `str` - at `\$\.step`"),
    (envelope(replicas=[{"scheduled_new_reqs": []}]), "missing required field"),
    (envelope(replicas=[dict(dataclasses.asdict(replicas()[1]), total_num_scheduled_tokens=True)]),
     r"Expected `int`, got `bool` - at `\$\.replicas\[0\]\.total_num_scheduled_tokens`"),
    (envelope(replicas=[dict(dataclasses.asdict(replicas()[0]), scheduled_new_reqs=[
        dict(dataclasses.asdict(replicas()[0].scheduled_new_reqs[0]), sampling_params={"top_p": 0.0})])]),
     r"top_p=0.0 is invalid.*sampling_params"),
    (envelope(kind="stop", replicas=[dataclasses.asdict(replicas()[1])]), "stop message for step 0 carries 1"),
])
def test_a_malformed_message_raises_a_clear_error(data, match):
    with pytest.raises(StepMessageError, match=match):
        decode_step(data, 0)


def test_another_format_version_is_refused_even_when_its_schema_differs():
    with pytest.raises(StepMessageError,
                       match=f"format version {FORMAT_VERSION + 1}, this process reads version {FORMAT_VERSION}"):
        decode_step(envelope(version=FORMAT_VERSION + 1), 0)
    other = FORMAT_VERSION + 1
    with pytest.raises(StepMessageError, match=f"format version {other}.*different jaxserve versions"):
        decode_step(msgspec.msgpack.encode({"version": other, "step": 0, "payload": [[1, 2]]}), 0)


def test_a_message_for_another_step_is_refused():
    with pytest.raises(StepMessageError, match="carries step 4 but this follower expects step 3"):
        decode_step(encode_step(4, replicas()), 3)


def test_no_pickle_in_sharding():
    for path in sorted((ROOT / "sharding").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                names = [node.module or ""]
            else:
                continue
            assert not any(n.split(".")[0] in ("pickle", "cloudpickle", "dill", "marshal") for n in names), path


# ---- the channel -------------------------------------------------------------------------


class FakeKV:
    """The parts of jax's DistributedRuntimeClient that StepChannel uses, over one dict."""

    def __init__(self) -> None:
        self.store: dict[str, bytes | str] = {}

    def key_value_set_bytes(self, key: str, value: bytes, allow_overwrite: bool = False) -> None:
        self._set(key, value, allow_overwrite)

    def key_value_set(self, key: str, value: str, allow_overwrite: bool = False) -> None:
        self._set(key, value, allow_overwrite)

    def _set(self, key, value, allow_overwrite):
        if key in self.store and not allow_overwrite:
            raise RuntimeError(f"ALREADY_EXISTS: key {key} already exists.")
        self.store[key] = value

    def blocking_key_value_get_bytes(self, key: str, timeout_in_ms: int) -> bytes:
        if key not in self.store:
            raise RuntimeError(f"DEADLINE_EXCEEDED: GetKeyValue() timed out with key: {key}")
        return self.store[key]

    def key_value_dir_get(self, key: str) -> list[tuple[str, str]]:
        return [(k, v) for k, v in self.store.items() if k.startswith(key) and isinstance(v, str)]

    def key_value_delete(self, key: str) -> None:
        self.store.pop(key, None)

    def steps(self) -> list[int]:
        return sorted(int(k.rsplit("/", 1)[1]) for k in self.store if k.startswith("jaxserve/step/"))


def channels(kv, num_processes=3):
    return [StepChannel(client=kv, num_processes=num_processes, process_id=p) for p in range(num_processes)]


def test_the_leader_deletes_a_step_only_once_every_follower_has_read_it():
    kv = FakeKV()
    leader, fast, slow = channels(kv)
    messages = [[so] for so in replicas()] + [replicas()]
    for k, message in enumerate(messages):
        leader.publish(message)
        assert fast.receive() == message
    assert kv.steps() == [0, 1, 2]                       # the slow follower has read nothing
    assert slow.receive() == messages[0]
    leader.publish(STOP)
    assert kv.steps() == [1, 2, 3]                       # step 0 read by both
    assert [slow.receive(), slow.receive()] == messages[1:]
    assert fast.receive() == slow.receive() == STOP
    assert kv.store["jaxserve/ack/1"] == kv.store["jaxserve/ack/2"] == "2"   # STOP is not acknowledged


def test_a_follower_waits_through_idle_polls():
    kv = FakeKV()
    leader, follower = channels(kv, 2)
    calls = []
    get = kv.blocking_key_value_get_bytes

    def slow_get(key, timeout_in_ms):
        calls.append(key)
        if len(calls) == 3:
            leader.publish(STOP)
        return get(key, timeout_in_ms)

    kv.blocking_key_value_get_bytes = slow_get
    assert follower.receive() == STOP and calls == ["jaxserve/step/0"] * 3


def test_a_forged_step_message_stops_the_follower():
    kv = FakeKV()
    leader, follower = channels(kv, 2)
    kv.store["jaxserve/step/0"] = encode_step(1, replicas())     # a step 1 message under key 0
    with pytest.raises(StepMessageError, match="carries step 1 but this follower expects step 0"):
        follower.receive()
    kv.store["jaxserve/step/0"] = pickle.dumps(replicas())
    with pytest.raises(StepMessageError, match="malformed"):
        follower.receive()
    assert "jaxserve/ack/1" not in kv.store


@pytest.mark.parametrize("ack, match", [("two", "acknowledged step 'two', not a step index"),
                                        ("5", "acknowledged step 5, but the leader has published steps 0..0")])
def test_a_bad_acknowledgement_is_refused(ack, match):
    kv = FakeKV()
    leader, _ = channels(kv, 2)
    kv.store["jaxserve/ack/1"] = ack
    with pytest.raises(StepMessageError, match=match):
        leader.publish(replicas())


def test_each_side_only_does_its_own_part():
    leader, follower = channels(FakeKV(), 2)
    with pytest.raises(RuntimeError, match="publish\\(\\) is for the leader"):
        follower.publish(STOP)
    with pytest.raises(RuntimeError, match="receive\\(\\) is for followers"):
        leader.receive()
    with pytest.raises(ValueError, match="needs num_processes and process_id"):
        StepChannel(client=FakeKV())
    with pytest.raises(ValueError, match="process_id=2 is not in"):
        StepChannel(client=FakeKV(), num_processes=2, process_id=2)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_the_channel_over_jax_coordination_service():
    from jax._src.lib import _jax

    address = f"127.0.0.1:{free_port()}"
    service = _jax.get_distributed_runtime_service(address, 2)
    clients = [_jax.get_distributed_runtime_client(address, p, init_timeout=30) for p in range(2)]

    def both(method):   # connect and shutdown are barriers over both clients
        threads = [threading.Thread(target=getattr(c, method)) for c in clients]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=60)

    both("connect")
    try:
        leader = StepChannel(client=clients[0], num_processes=2, process_id=0)
        follower = StepChannel(poll_s=0.05, client=clients[1], num_processes=2, process_id=1)
        received = []
        reader = threading.Thread(target=lambda: received.extend(follower.receive() for _ in range(2)))
        reader.start()                                    # polls before anything is published
        leader.publish(replicas())
        leader.publish(replicas()[:1])
        reader.join(timeout=60)
        assert received == [replicas(), replicas()[:1]]
        leader.publish(STOP)
        assert follower.receive() == STOP
        assert clients[0].key_value_dir_get("jaxserve/ack/") == [("jaxserve/ack/1", "1")]
        steps = [k for k, _ in clients[0].key_value_dir_get_bytes("jaxserve/step/")]
        assert steps == ["jaxserve/step/2"]                # 0 and 1 acknowledged, so deleted
    finally:
        both("shutdown")
        service.shutdown()
