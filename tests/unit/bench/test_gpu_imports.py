"""The GPU path imports nothing the GPU machines' image lacks beyond the wheels we carry there.

The image (bench/gpu/image_packages.txt) has torch, transformers and peft but no API stack (fastapi, sqlmodel,
pydantic, redis, minio, celery, ...) and nothing can be installed there except carried wheels
(bench/gpu/wheels.txt). A child process refuses every package installed here that is in neither list, when
our own code imports it, and imports the engine, the kernels, the GPU benchmarks and the kernel tests (which
run there with ``pytest --noconftest``). Imports made by third-party packages are let through: the image has its
own versions of those, with their own dependencies.
"""

from __future__ import annotations

import importlib.metadata
import json
import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]
GPU_DIR = REPO / "bench" / "gpu"

# Packages the GPU path must import, as module names: the whole of each package listed with ".*".
GPU_PATH = [
    "server.engine.*",
    "server.model.*",
    "server.offline",
    "loraplex_kernels.*",
    "bench.kernels_gpu",
    "bench.engine_gpu",
    "bench.gpu.parity",
    "bench.gpu.summary",
    "tests.integration.engine.models",
    "tests.unit.kernels.*",
]

# Runs in the child: argv[1] the repo, argv[2] JSON {"refused": [...], "modules": [...]}.
CHILD = r"""
import importlib, importlib.abc, pkgutil, sys, json

repo, spec = sys.argv[1], json.loads(sys.argv[2])
refused = set(spec["refused"])


def ours(filename):
    return filename.startswith(repo + "/") and "site-packages" not in filename


class RefuseMissing(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] not in refused:
            return None
        frame = sys._getframe(1)
        while frame and (frame.f_code.co_filename.startswith("<frozen") or "importlib" in frame.f_code.co_filename):
            frame = frame.f_back
        if frame is None or not ours(frame.f_code.co_filename):
            return None  # a third-party package's own import: the image has its own version of that package
        chain, f = [], frame
        while f:
            if ours(f.f_code.co_filename):
                chain.append(f"{f.f_code.co_filename[len(repo) + 1:]}:{f.f_lineno}")
            f = f.f_back
        raise ModuleNotFoundError(f"REFUSED {name} (not on the GPU image) via " + " <- ".join(chain), name=name)


sys.meta_path.insert(0, RefuseMissing())
for module in spec["modules"]:
    if module.endswith(".*"):
        package = importlib.import_module(module[:-2])
        for info in pkgutil.walk_packages(package.__path__, package.__name__ + "."):
            importlib.import_module(info.name)
    else:
        importlib.import_module(module)
print("imported", len(spec["modules"]), "entries")
"""


def names(path: Path) -> set[str]:
    """Normalised distribution names of a list file (one a line, ``name==version`` allowed, ``#`` comments)."""
    found = set()
    for line in path.read_text().splitlines():
        line = line.split("#")[0].strip()
        if line:
            found.add(normalise(re.split(r"[=<>!~ ]", line)[0]))
    return found


def normalise(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def refused_modules() -> set[str]:
    """Top-level modules installed here whose every distribution is neither on the image nor carried."""
    allowed = names(GPU_DIR / "image_packages.txt") | names(GPU_DIR / "wheels.txt")
    refused = set()
    for module, dists in importlib.metadata.packages_distributions().items():
        if module in sys.stdlib_module_names or (REPO / module).exists() or (REPO / f"{module}.py").exists():
            continue
        if not any(normalise(d) in allowed for d in dists):
            refused.add(module)
    return refused


def import_refusing(modules: list[str], refused: set[str]) -> subprocess.CompletedProcess:
    spec = json.dumps({"refused": sorted(refused), "modules": modules})
    return subprocess.run(
        [sys.executable, "-c", CHILD, str(REPO), spec],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
        env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin", "TRITON_INTERPRET": "1", "OPENBLAS_NUM_THREADS": "1"},
    )


def test_the_api_stack_is_refused_and_what_the_image_has_is_not() -> None:
    refused = refused_modules()
    assert {"fastapi", "starlette", "sqlmodel", "sqlalchemy", "pydantic", "redis", "minio", "celery"} <= refused
    assert not {"torch", "triton", "transformers", "peft", "numpy", "safetensors", "llguidance"} & refused


def test_the_refusal_names_the_import_chain_of_our_code() -> None:
    """The harness itself: the HTTP server needs fastapi, and the child says which of our lines imported it."""
    done = import_refusing(["server.http"], refused_modules())
    assert done.returncode != 0
    assert "REFUSED fastapi" in done.stderr and "server/http.py" in done.stderr


def test_the_gpu_path_imports_without_the_api_stack() -> None:
    done = import_refusing(GPU_PATH, refused_modules())
    refusals = [line for line in done.stderr.splitlines() if "REFUSED" in line]
    assert done.returncode == 0, "\n".join(refusals) or done.stderr[-3000:]
