"""Keep a CPU step's large buffers in the heap instead of mapping them afresh each step.

XLA:CPU allocates each step's temporaries as one buffer with glibc's malloc (63 MB at 64
sampling rows of the default model: the sampler's [rows, vocab] arrays). glibc maps anything
over 32 MB with `mmap` and unmaps it when freed, so every step touched fresh pages: thousands
of page faults a step, ~6 ms of a ~100 ms bfloat16 decode step in the lm head alone, which
writes its [64, 49152] logits into that buffer (benchmarks/RESULTS.md, seventh round).

`keep_buffers_in_heap()` tells the running process's malloc to serve every allocation from its
heap (`M_MMAP_MAX` 0), never to give freed heap back (`M_TRIM_THRESHOLD` at its largest), and to
keep a thread arena's heap whose one block was freed (`M_TOP_PAD` of a whole 64 MB heap: glibc
deletes such a heap whatever the trim threshold, and XLA's worker threads allocate in their own
arenas), so the step's buffer is reused with its pages already mapped. glibc's tunables
(`GLIBC_TUNABLES`, which the CLI used to restart itself with) miss that last case
(tests/test_cpu_malloc.py). The cost: memory the process frees stays with it. It runs when an engine starts on a CPU-only JAX (the library and the CLI alike),
only under glibc, and not when the environment sets `GLIBC_TUNABLES` (the user chose) or
`JAXSERVE_GLIBC_TUNABLES=0`.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import os
import platform

logger = logging.getLogger(__name__)

_M_TRIM_THRESHOLD = -1   # glibc's mallopt parameters (malloc.h)
_M_TOP_PAD = -2
_M_MMAP_MAX = -4
_HEAP_MAX = 64 << 20     # the most a thread's arena heap holds (glibc on 64-bit)
_INT_MAX = 2**31 - 1


def wanted(environ=os.environ) -> bool:
    """True on Linux with glibc unless GLIBC_TUNABLES is set or JAXSERVE_GLIBC_TUNABLES is 0."""
    if environ.get("JAXSERVE_GLIBC_TUNABLES") == "0" or "GLIBC_TUNABLES" in environ:
        return False
    return platform.system() == "Linux" and platform.libc_ver()[0] == "glibc"


@functools.cache
def keep_buffers_in_heap() -> bool:
    """Set the process's malloc as above (once a process); True when it was set."""
    if not wanted():
        return False
    try:
        libc = ctypes.CDLL("libc.so.6")
        ok = all(libc.mallopt(param, value) == 1 for param, value in (
            (_M_MMAP_MAX, 0), (_M_TRIM_THRESHOLD, _INT_MAX), (_M_TOP_PAD, _HEAP_MAX)))
    except (OSError, AttributeError) as e:
        logger.warning("could not set malloc's options (%s); each CPU step maps its large buffers afresh", e)
        return False
    if ok:
        logger.info("CPU: malloc serves every allocation from the heap and keeps what is freed "
                    "(a step's buffers are reused, not mapped afresh; JAXSERVE_GLIBC_TUNABLES=0 turns it off)")
    return ok
