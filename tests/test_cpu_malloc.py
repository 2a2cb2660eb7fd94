"""On a CPU the engine keeps large freed buffers in the heap: a step's buffer is reused with its
pages mapped, instead of mapped afresh (page faults) every step."""

import os
import platform
import subprocess
import sys

import pytest

from jaxserve.engine import cpu_malloc

GLIBC_LINUX = platform.system() == "Linux" and platform.libc_ver()[0] == "glibc"

# Allocates, fills and frees a 63 MB buffer (a step's temporaries at 64 rows of the default model)
# on a worker thread (XLA runs steps on its own threads), three times; prints the page faults of
# the last round.
_ROUNDS = """
import ctypes, resource, sys, threading
from jaxserve.engine import cpu_malloc
print(cpu_malloc.keep_buffers_in_heap())
libc = ctypes.CDLL("libc.so.6")
libc.malloc.restype = ctypes.c_void_p
libc.free.argtypes = [ctypes.c_void_p]
size = 63 << 20
kept = []
def step():
    kept.append(libc.malloc(1 << 20))   # the thread's arena holds something, so the big one needs a heap of its own
    p = libc.malloc(size)
    ctypes.memset(p, 1, size)
    libc.free(p)
def faults():
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for round in range(3):
    before = faults()
    t = threading.Thread(target=step)
    t.start()
    t.join()
print(faults() - before)
"""


def rounds(env: dict) -> tuple[bool, int]:
    out = subprocess.run([sys.executable, "-c", _ROUNDS], env=env, capture_output=True, text=True, check=True)
    was_set, faults = out.stdout.split()
    return was_set == "True", int(faults)


@pytest.mark.skipif(not GLIBC_LINUX, reason="glibc on Linux only")
def test_a_freed_large_buffer_is_reused_without_page_faults():
    env = {k: v for k, v in os.environ.items() if k not in ("GLIBC_TUNABLES", "JAXSERVE_GLIBC_TUNABLES")}
    was_set, faults = rounds(env)
    assert was_set and faults < 500, faults                       # the pages stayed mapped
    was_set, faults = rounds({**env, "JAXSERVE_GLIBC_TUNABLES": "0"})
    assert not was_set and faults > 63 * 256 // 2, faults         # glibc's default: mapped afresh (16k pages)


@pytest.mark.parametrize("environ, want", [
    ({}, GLIBC_LINUX),
    ({"JAXSERVE_GLIBC_TUNABLES": "0"}, False),                             # opted out
    ({"GLIBC_TUNABLES": "glibc.malloc.arena_max=2"}, False),               # the user's own setting wins
    ({"JAXSERVE_GLIBC_TUNABLES": "1"}, GLIBC_LINUX),
])
def test_when_it_applies(environ, want):
    assert cpu_malloc.wanted(environ) == want
