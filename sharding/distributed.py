"""One engine across several processes (hosts), on JAX's multi-controller runtime.

Every process runs the same program: `initialize` joins the processes through
`jax.distributed` (process 0 hosts the coordinator), after which `jax.devices()` lists
every process's devices and the engine's mesh spans them all. Each step is one SPMD
program that every process must run with the same inputs, so one process decides and
the others follow:

- process 0 (the leader) schedules and serves; before it launches step k it publishes
  that step's scheduler output under key k in the coordinator's key-value store
  (`StepChannel.publish`);
- every other process (a follower) blocks on key k (`StepChannel.receive`), applies the
  same scheduler output to its own runner and launches the same step. The step's
  collectives keep the processes in lockstep, so the leader deletes key k-2 as it
  publishes k.

On CPU the cross-process collectives go through gloo (JAX's default for CPU).
"""

from __future__ import annotations

import logging
import pickle

import jax

logger = logging.getLogger(__name__)

STOP = "stop"          # the leader's last message: followers return from their loop
_PREFIX = "jaxserve/step/"


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
    """Scheduler outputs from the leader to the followers, one key per step."""

    def __init__(self, poll_s: float = 60.0) -> None:
        from jax._src import distributed

        self._client = distributed.global_state.client
        if self._client is None:
            raise RuntimeError("StepChannel needs jax.distributed to be initialized")
        self._poll_ms = int(poll_s * 1000)
        self._step = 0

    def publish(self, message) -> None:
        self._client.key_value_set_bytes(f"{_PREFIX}{self._step}", pickle.dumps(message))
        if self._step >= 2:
            self._client.key_value_delete(f"{_PREFIX}{self._step - 2}")
        self._step += 1

    def receive(self):
        """The leader's next message; waits as long as the leader is idle (and alive)."""
        while True:
            try:
                data = self._client.blocking_key_value_get_bytes(f"{_PREFIX}{self._step}", self._poll_ms)
                break
            except RuntimeError as e:   # jax.errors.JaxRuntimeError; a dead coordinator raises another code
                if "DEADLINE_EXCEEDED" not in str(e):
                    raise
        self._step += 1
        return pickle.loads(data)
