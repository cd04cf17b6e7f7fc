"""Without a GPU, the Triton kernels still compile for sm_90 and stream adapter rows with 16-byte copies."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[3]


def _has_cuda_toolchain() -> bool:
    spec = importlib.util.find_spec("triton")
    if spec is None or spec.origin is None:
        return False
    return (Path(spec.origin).parent / "backends" / "nvidia" / "bin" / "ptxas").exists()


@pytest.mark.skipif(not _has_cuda_toolchain(), reason="this triton build has no CUDA backend / ptxas")
def test_kernels_compile_for_hopper_with_tensor_cores_and_vector_loads():
    # A child process: the kernels here are interpreted functions, which cannot be compiled.
    env = {**os.environ, "TRITON_INTERPRET": "0"}
    done = subprocess.run(
        [sys.executable, "-m", "tests.unit.kernels.compile_cuda"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout)
    for kernel in ("shrink/bf16/sm90/align8", "expand/bf16/sm90/align8", "decode/bf16/sm90", "prefill/bf16/sm90"):
        assert report[kernel]["tensor_cores"], kernel
        # Rows that start on ROW_ALIGN boundaries are fetched 16 bytes at a time, never element by element.
        assert report[kernel]["cp_async_16"] > 0, kernel
        assert report[kernel]["scalar_16bit_loads"] == 0, kernel
    assert "merge/bf16/sm90" in report
