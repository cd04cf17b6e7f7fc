"""`loraplex up` as a test runs it: started on a free port with a clean environment, stopped with Ctrl-C."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest

from core.local_services import free_port

BIN = Path(sys.executable).parent
REPO_ROOT = Path(__file__).resolve().parents[2]


@dataclass
class RunningPlatform:
    process: subprocess.Popen
    data_dir: Path
    api_url: str
    admin_key: str
    log: Path

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def child_pids(self) -> dict[str, int]:
        return {name: int(pid) for name, pid in re.findall(r"([\w-]+) running \(pid (\d+)\)", self.output())}

    def cli(self, *args: str) -> str:
        env = {**os.environ, "LORAPLEX_DATA_DIR": str(self.data_dir)}
        return subprocess.run(
            [str(BIN / "loraplex"), *args], env=env, capture_output=True, text=True, check=True
        ).stdout


def wait_for(predicate, what: str, platform: RunningPlatform, timeout: float) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if platform.process.poll() is not None:
            pytest.fail(f"`loraplex up` exited while waiting for {what}:\n{platform.output()}")
        if predicate():
            return
        time.sleep(0.25)
    pytest.fail(f"timed out after {timeout:.0f}s waiting for {what}:\n{platform.output()}")


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie still answers kill(0); it is gone for our purposes once it no longer runs.
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except OSError:
        return False


@contextmanager
def running_up(data_dir: Path, *args: str, components: set[str] | None = None) -> Iterator[RunningPlatform]:
    """`loraplex up` with ``args``, on a free port, until every component (``components``, default api, server
    and worker) runs; Ctrl-C at the end."""
    port = free_port()
    data_dir.mkdir(parents=True, exist_ok=True)
    log = data_dir / "up.log"
    # One torch thread per process: on a 2-core machine several spinning thread pools starve each other.
    env = {**os.environ, "OMP_NUM_THREADS": "1", "LORAPLEX_LOG_LEVEL": "info"}
    for var in [v for v in env if v.startswith("LORAPLEX_")]:
        if var not in ("LORAPLEX_LOG_LEVEL",):
            env.pop(var)
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [str(BIN / "loraplex"), "up", "--data-dir", str(data_dir), "--port", str(port), *args],
            stdout=out,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,
        )
    running = RunningPlatform(proc, data_dir, f"http://127.0.0.1:{port}", "", log)
    wanted = components or {"api", "server", "worker"}
    try:
        wait_for(lambda: "admin key:" in running.output(), "the admin key", running, 120)
        running.admin_key = re.search(r"admin key:\s+(\S+)", running.output()).group(1)  # type: ignore[union-attr]
        wait_for(lambda: wanted <= set(running.child_pids()), "every component", running, 180)
        yield running
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
