"""`jaxserve serve` / `run-batch` restart themselves on a CPU with glibc's malloc tunables."""

import platform

import pytest

from jaxserve.cli import wants_glibc_restart

GLIBC_LINUX = platform.system() == "Linux" and platform.libc_ver()[0] == "glibc"


@pytest.mark.skipif(not GLIBC_LINUX, reason="glibc on Linux only")
def test_serve_and_run_batch_restart_on_a_cpu():
    assert wants_glibc_restart("serve", {"JAX_PLATFORMS": "cpu"})
    assert wants_glibc_restart("run-batch", {"JAX_PLATFORMS": "cpu"})


@pytest.mark.parametrize("command, environ", [
    ("convert", {"JAX_PLATFORMS": "cpu"}),                               # other commands: no
    ("router", {"JAX_PLATFORMS": "cpu"}),
    (None, {"JAX_PLATFORMS": "cpu"}),
    ("serve", {"JAX_PLATFORMS": "cpu", "GLIBC_TUNABLES": "glibc.malloc.arena_max=2"}),  # the user's own setting wins
    ("serve", {"JAX_PLATFORMS": "cpu", "JAXSERVE_GLIBC_TUNABLES": "0"}),  # opted out
    ("serve", {"JAX_PLATFORMS": "cuda"}),                                # an accelerator asked for
    ("serve", {"JAX_PLATFORMS": "tpu,cpu"}),
    ("serve", {"JAX_PLATFORMS": "cpu", "JAXSERVE_RESTARTED_WITH_GLIBC_TUNABLES": "1"}),   # once only
])
def test_no_restart(command, environ):
    assert not wants_glibc_restart(command, environ)
