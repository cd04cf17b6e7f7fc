"""glibc malloc settings for serving on CPU: reuse freed activation memory instead of faulting it back in.

torch's CPU allocator has no cache: every step allocates its activations with malloc and frees them. glibc
serves blocks above its mmap threshold (128 KiB at first, raised as such blocks are freed) with fresh
mappings, and hands the top of its heap back to the OS once more than twice that threshold is free. So a
step's large tensors (a prefill chunk's MLP activations are tens of MB) come back as new zeroed pages,
faulted in 4 KiB at a time, step after step. Measured on ``bench/engine_cpu.py``: about 200,000 page faults
per run, half the prefill time, and run-to-run swings of 20%. With the settings below: under 16,000 faults
on the first run and almost none after, and prefill about twice as fast.

The cost: the process keeps up to ``TRIM_THRESHOLD_BYTES`` of freed heap rather than returning it, which is
what a caching allocator does anyway.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import platform

log = logging.getLogger(__name__)

# mallopt parameters (<malloc.h>).
M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
# Blocks up to this size come from the heap (32 MiB is glibc's default ceiling for its dynamic threshold);
# larger ones are still mapped and unmapped on their own.
MMAP_THRESHOLD_BYTES = 32 << 20
# Free memory at the top of the heap is returned to the OS only beyond this much.
TRIM_THRESHOLD_BYTES = 256 << 20


@functools.cache
def reuse_freed_host_memory() -> bool:
    """Apply the settings to this process (once); False where the C library is not glibc."""
    if platform.libc_ver()[0] != "glibc":
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    # Both together: fixing the trim threshold alone also fixes the mmap threshold at 128 KiB, which makes
    # things worse (measured: 485,000 faults per benchmark run).
    applied = (
        mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES) == 1 and mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES) == 1
    )
    log.info("glibc malloc: mmap threshold %d MiB, trim threshold %d MiB (%s)",
             MMAP_THRESHOLD_BYTES >> 20, TRIM_THRESHOLD_BYTES >> 20, "applied" if applied else "refused")  # fmt: skip
    return applied
