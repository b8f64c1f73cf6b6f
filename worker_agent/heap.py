"""The C heap's policy for a process that holds a model of hundreds of megabytes.

glibc's malloc serves a request of at least M_MMAP_THRESHOLD bytes with a mapping of its
own, returned to the system on free, and anything smaller from its heaps, which keep freed
memory for reuse. The threshold starts at 128 KiB but rises, up to 32 MiB, each time a
mapped block is freed: after a unit's first tensors come and go, the 1-32 MiB tensors of a
150M path (a layer's weights, its moments, their Δ and their encodings: 3-9 MB each) are
served from the heaps, whose freed pages stay counted against the worker. At 150M that
is about 4 bytes a parameter more after each unit (measured with `smaps_rollup`'s PSS:
docs/benchmarks.md, "Worker memory"). Fixing the threshold at 1 MiB (which also stops its
rise) returns each such tensor's pages when it is freed; the cost is a page fault per
first touch of a fresh tensor, small next to a step at that size.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging

__all__ = ["MMAP_THRESHOLD_BYTES", "fix_mmap_threshold"]

M_MMAP_THRESHOLD = -3  # <malloc.h>
MMAP_THRESHOLD_BYTES = 1 << 20
log = logging.getLogger(__name__)


def fix_mmap_threshold(threshold: int = MMAP_THRESHOLD_BYTES) -> bool:
    """Set glibc's mmap threshold (module doc); False where the C library is not glibc
    (musl, macOS: their allocators return large blocks anyway) or refuses."""
    name = ctypes.util.find_library("c")
    if not name:
        return False
    try:
        libc = ctypes.CDLL(name)
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    done = bool(mallopt(M_MMAP_THRESHOLD, threshold))
    if not done:
        log.debug("mallopt(M_MMAP_THRESHOLD, %d) refused", threshold)
    return done
