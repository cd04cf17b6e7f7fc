"""The CPU engine's malloc settings: freed activation memory is reused, not faulted back in every step."""

from __future__ import annotations

import platform
import subprocess
import sys

import pytest

pytestmark = pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc malloc settings")

# Allocates four 12 MiB tensors (a prefill chunk's MLP activations are that size) and frees them, 20 times,
# as steps do, and prints the page faults it took. A fresh process each time: the settings are process-wide.
PROBE = """
import resource, sys, torch
if sys.argv[1] == "tuned":
    from server.engine.host_memory import reuse_freed_host_memory
    assert reuse_freed_host_memory()
def step():
    tensors = [torch.ones(3 << 20) for _ in range(4)]
    del tensors
step()  # warm: the first step faults its pages in either way
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(20):
    step()
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def page_faults(mode: str) -> int:
    done = subprocess.run([sys.executable, "-c", PROBE, mode], capture_output=True, text=True, check=True)
    return int(done.stdout.strip())


def test_freed_activations_are_reused_without_page_faults():
    # 20 steps of 4 x 3,072 pages. Untuned, glibc hands much of the freed 48 MiB back and faults it in again
    # (measured 24,000 to 58,000 faults, varying with the heap's layout); tuned, the heap keeps it (measured
    # 3,072 every time: one tensor's pages, once).
    assert page_faults("default") > 5 * 3072
    assert page_faults("tuned") < 4 * 3072


def test_settings_apply_once():
    from server.engine.host_memory import reuse_freed_host_memory

    assert reuse_freed_host_memory() is reuse_freed_host_memory()
