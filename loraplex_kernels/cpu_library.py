"""The CPU loops in C (``cpu_*.c``): built once per machine with the system compiler, loaded with ctypes.

No torch headers are needed, and nothing when there is no compiler: every caller has a torch fallback.
``LORAPLEX_CPU_SGMV=0`` turns the library off; ``LORAPLEX_KERNEL_CACHE`` says where builds are kept.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

log = logging.getLogger(__name__)

SOURCES = ("cpu_sgmv.c", "cpu_attention.c", "cpu_gemm.c", "cpu_sampling.c")
HEADERS = ("cpu_common.h",)
# No -ffast-math: linking with it sets flush-to-zero for the whole process (crtfastmath), which changes
# float behaviour for everything else loaded alongside (Hypothesis refuses to run, for one).
C_FLAGS = ("-O3", "-march=native", "-fno-math-errno", "-shared", "-fPIC")
C_LIBS = ("-lm",)
# Threads come from OpenMP (torch's own workers); a compiler without it builds single-threaded loops.
OPENMP_FLAGS = ("-fopenmp",)

_i64, _ptr, _f32 = ctypes.c_int64, ctypes.c_void_p, ctypes.c_float
SIGNATURES = {
    "lora_segments": [
        _ptr, _i64, _ptr, _i64, _ptr, _i64, _i64, _ptr, _ptr, _ptr, _ptr, _i64, _ptr, _ptr, _ptr, _ptr, _ptr, _i64,
        _i64, _ptr, _ptr, _i64, _i64, _ptr, _i64, _i64, _i64,
    ],
    "panel_linear": [_ptr, _i64, _ptr, _i64, _i64, _i64, _i64, _ptr, _ptr, _i64, _i64],
    "apply_token_bitmask": [_ptr, _i64, _ptr, _i64, _ptr, _i64, _i64],
    "paged_attention_decode": [
        _ptr, _ptr, _ptr, _i64, _i64, _ptr, _i64, _ptr, _i64, _i64, _i64, _i64, _i64, _i64, _f32, _f32, _ptr, _ptr,
        _i64, _i64, _i64, _i64,
    ],
}  # fmt: skip


def c_threads() -> int:
    """Threads for the C loops: torch's intra-op thread count, unless ``LORAPLEX_CPU_KERNEL_THREADS`` says
    otherwise. The loops run on torch's own OpenMP workers (see ``cpu_common.h``), so this many never
    oversubscribes the cores torch was given."""
    configured = os.environ.get("LORAPLEX_CPU_KERNEL_THREADS")
    return max(1, int(configured) if configured else torch.get_num_threads())


@functools.cache
def c_library() -> ctypes.CDLL | None:
    """The compiled loops, built on first use into a per-machine cache; None when they cannot be built."""
    if os.environ.get("LORAPLEX_CPU_SGMV", "1") == "0":
        return None
    compiler = shutil.which(os.environ.get("CC", "cc"))
    here = Path(__file__).parent
    files = [here / name for name in (*SOURCES, *HEADERS)]
    if compiler is None or not all(f.is_file() for f in files):
        return None
    cpu = platform.machine() + platform.processor()
    with contextlib.suppress(OSError, IndexError):
        cpu += Path("/proc/cpuinfo").read_text().split("flags", 1)[1].split("\n", 1)[0]
    flags = " ".join((*C_FLAGS, *OPENMP_FLAGS)).encode()
    key = hashlib.sha256(b"".join(f.read_bytes() for f in files) + flags + cpu.encode()).hexdigest()[:16]
    cache = Path(os.environ.get("LORAPLEX_KERNEL_CACHE", Path.home() / ".cache" / "loraplex" / "kernels"))
    target = cache / f"cpu_loops-{key}.so"
    try:
        if not target.is_file():
            cache.mkdir(parents=True, exist_ok=True)
            with tempfile.TemporaryDirectory(dir=cache) as tmp:
                built = Path(tmp) / target.name
                sources = [str(here / name) for name in SOURCES]
                for extra in (OPENMP_FLAGS, ()):
                    command = [compiler, *C_FLAGS, *extra, *sources, "-o", str(built), *C_LIBS]
                    done = subprocess.run(command, capture_output=True)
                    if done.returncode == 0:
                        break
                done.check_returncode()
                os.replace(built, target)  # atomic: concurrent builders race harmlessly
        lib = ctypes.CDLL(str(target))
    except (OSError, subprocess.CalledProcessError) as exc:
        log.warning("CPU loops unavailable (%s); using torch ops instead", exc)
        return None
    for name, argtypes in SIGNATURES.items():
        function = getattr(lib, name)
        function.restype, function.argtypes = None, argtypes
    lib.gemm_uses_avx512.restype, lib.gemm_uses_avx512.argtypes = ctypes.c_int, []
    lib.gemm_amx_ready.restype, lib.gemm_amx_ready.argtypes = ctypes.c_int, []
    return lib
