"""One engine across several processes (hosts), on JAX's multi-controller runtime.

Every process runs the same program: `initialize` joins the processes through
`jax.distributed` (process 0 hosts the coordinator), after which `jax.devices()` lists
every process's devices and the engine's mesh spans them all. Each step is one SPMD
program that every process must run with the same inputs, so one process decides and
the others follow, through the coordinator's key-value store (`StepChannel`, called on
the engine's thread):

- process 0 (the leader) schedules and serves; before it launches step k it publishes
  that step's scheduler outputs (one per data-parallel replica) under
  `jaxserve/step/<k>` (`StepChannel.publish`). Its last message, on shutdown, is STOP;
- every other process p (a follower) blocks on `jaxserve/step/<k>`
  (`StepChannel.receive`), checks it, acknowledges it by writing k to `jaxserve/ack/<p>`,
  then applies the same scheduler outputs to its own runner and launches the same step;
- as it publishes, the leader reads the acknowledgements (one non-blocking directory
  read) and deletes every step key that all followers have acknowledged. Nothing
  assumes the processes stay in lockstep: a slow follower only keeps more keys alive.

A message is msgpack (msgspec) with a typed schema, never pickle: an `_Envelope` of
{format version, step index, kind "step" | "stop", replicas: list[SchedulerOutput]}.
Decoding checks every field's type (down to each request's `SamplingParams`, whose own
checks run again); a follower that reads a malformed message, another format version or
a step index other than the one it waits for raises `StepMessageError` and stops.

On CPU the cross-process collectives go through gloo (JAX's default for CPU).
"""

from __future__ import annotations

import logging
from typing import Literal

import jax
import msgspec

from jaxserve.core.outputs import SchedulerOutput

logger = logging.getLogger(__name__)

STOP = "stop"          # the leader's last message: followers return from their loop
FORMAT_VERSION = 3     # bump on any change to the message schema
_STEP_PREFIX = "jaxserve/step/"
_ACK_PREFIX = "jaxserve/ack/"


class StepMessageError(ValueError):
    """A step message (or acknowledgement) that does not follow the protocol."""


class _Header(msgspec.Struct):
    """The fields every format version keeps, read to explain a message that fails to decode."""

    version: int
    step: int


class _Envelope(msgspec.Struct, forbid_unknown_fields=True):
    version: int                                         # FORMAT_VERSION of the writer
    step: int                                            # the step index k, as in the key
    kind: Literal["step", "stop"]                        # "stop": the leader is shutting down
    replicas: list[SchedulerOutput] = msgspec.field(default_factory=list)   # one per replica; [] for stop


_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(_Envelope)


def encode_step(step: int, message: list[SchedulerOutput] | str) -> bytes:
    """The wire form of step `step`'s message: a list of scheduler outputs, or STOP."""
    if isinstance(message, str):
        if message != STOP:
            raise ValueError(f"message={message!r} is not a step message: expected STOP or a list of "
                             f"SchedulerOutput")
        return _encoder.encode(_Envelope(FORMAT_VERSION, step, "stop"))
    if not isinstance(message, list) or not all(isinstance(so, SchedulerOutput) for so in message):
        raise ValueError(f"message of type {type(message).__name__} is not a step message: expected STOP or a "
                         f"list of SchedulerOutput")
    return _encoder.encode(_Envelope(FORMAT_VERSION, step, "step", message))


def decode_step(data: bytes, expected_step: int) -> list[SchedulerOutput] | str:
    """The message of step `expected_step` from its wire form; raises StepMessageError if it is not one."""
    try:
        envelope = _decoder.decode(data)
    except msgspec.DecodeError as e:
        try:
            header = msgspec.msgpack.decode(data, type=_Header)
        except msgspec.DecodeError:
            header = None
        if header is not None and header.version != FORMAT_VERSION:
            raise StepMessageError(f"step message has format version {header.version}, this process reads "
                                   f"version {FORMAT_VERSION}: leader and followers run different jaxserve "
                                   f"versions") from e
        raise StepMessageError(f"malformed step message for step {expected_step}: {e}") from e
    if envelope.version != FORMAT_VERSION:
        raise StepMessageError(f"step message has format version {envelope.version}, this process reads "
                               f"version {FORMAT_VERSION}: leader and followers run different jaxserve versions")
    if envelope.step != expected_step:
        raise StepMessageError(f"step message carries step {envelope.step} but this follower expects step "
                               f"{expected_step}")
    if envelope.kind == "stop":
        if envelope.replicas:
            raise StepMessageError(f"stop message for step {expected_step} carries {len(envelope.replicas)} "
                                   f"scheduler outputs")
        return STOP
    return envelope.replicas


def initialize(coordinator_address: str, num_processes: int, process_id: int) -> None:
    """Join the multi-process runtime (once per process; before any device is used)."""
    from jax._src import distributed

    if distributed.global_state.client is not None:
        if (distributed.global_state.num_processes, distributed.global_state.process_id) != (num_processes,
                                                                                               process_id):
            raise ValueError(f"jax.distributed is already initialized as process "
                             f"{distributed.global_state.process_id} of {distributed.global_state.num_processes}, "
                             f"not {process_id} of {num_processes}")
        return
    try:
        jax.distributed.initialize(coordinator_address=coordinator_address, num_processes=num_processes,
                                   process_id=process_id)
    except RuntimeError as e:
        raise ValueError(f"cannot join the {num_processes}-process runtime at {coordinator_address} as process "
                         f"{process_id}: {e}") from e
    logger.info("process %d of %d joined at %s: %d global devices, %d local", jax.process_index(),
                jax.process_count(), coordinator_address, jax.device_count(), jax.local_device_count())


class StepChannel:
    """Scheduler outputs from the leader to the followers, one key per step (protocol above)."""

    def __init__(self, poll_s: float = 60.0, *, client=None, num_processes: int | None = None,
                 process_id: int | None = None) -> None:
        if client is None:
            from jax._src import distributed

            client = distributed.global_state.client
            if client is None:
                raise RuntimeError("StepChannel needs jax.distributed to be initialized")
            num_processes, process_id = distributed.global_state.num_processes, distributed.global_state.process_id
        elif num_processes is None or process_id is None:
            raise ValueError("StepChannel(client=...) needs num_processes and process_id")
        if not 0 <= process_id < num_processes:
            raise ValueError(f"process_id={process_id} is not in [0, num_processes={num_processes})")
        self._client = client                       # jax's DistributedRuntimeClient (or a fake in tests)
        self._process_id = process_id
        self._followers = range(1, num_processes)   # process ids that acknowledge steps
        self._poll_ms = int(poll_s * 1000)
        self._step = 0                              # the next step to publish (leader) or receive (follower)
        self._deleted = -1                          # leader: step keys below and at this one are deleted

    def publish(self, message: list[SchedulerOutput] | str) -> None:
        """Leader: send step k's scheduler outputs (or STOP), then drop the keys every follower has read."""
        if self._process_id != 0:
            raise RuntimeError(f"publish() is for the leader (process 0), not process {self._process_id}")
        self._client.key_value_set_bytes(f"{_STEP_PREFIX}{self._step}", encode_step(self._step, message))
        read = self._acknowledged()
        for step in range(self._deleted + 1, read + 1):
            self._client.key_value_delete(f"{_STEP_PREFIX}{step}")
        self._deleted = max(self._deleted, read)
        self._step += 1

    def _acknowledged(self) -> int:
        """The last step every follower has acknowledged (-1 before all have acknowledged step 0)."""
        acks = dict(self._client.key_value_dir_get(_ACK_PREFIX))
        steps = []
        for p in self._followers:
            value = acks.get(f"{_ACK_PREFIX}{p}")
            if value is None:
                return -1
            try:
                step = int(value)
            except ValueError:
                raise StepMessageError(f"process {p} acknowledged step {value!r}, not a step index") from None
            if not 0 <= step <= self._step:
                raise StepMessageError(f"process {p} acknowledged step {step}, but the leader has published "
                                       f"steps 0..{self._step}")
            steps.append(step)
        return min(steps, default=self._step)

    def receive(self) -> list[SchedulerOutput] | str:
        """Follower: the leader's next message; waits as long as the leader is idle (and alive)."""
        if self._process_id == 0:
            raise RuntimeError("receive() is for followers (processes other than 0)")
        while True:
            try:
                data = self._client.blocking_key_value_get_bytes(f"{_STEP_PREFIX}{self._step}", self._poll_ms)
                break
            except RuntimeError as e:   # jax.errors.JaxRuntimeError; a dead coordinator raises another code
                if "DEADLINE_EXCEEDED" not in str(e):
                    raise
        message = decode_step(data, self._step)
        if message != STOP:   # after STOP the leader may be gone, and it deletes nothing more
            self._client.key_value_set(f"{_ACK_PREFIX}{self._process_id}", str(self._step), allow_overwrite=True)
        self._step += 1
        return message
