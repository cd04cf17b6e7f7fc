"""A replica crash in the middle of a soak: a timer kills one replica (SIGKILL) while the clients run and
starts it again. Streams it was answering break with an error event; the soak reports those apart."""

from __future__ import annotations

import threading
import time

from bench.load_platform import SoakPlatform

BROKEN_WINDOW_S = 10.0  # a stream the crash broke ends this soon after it (the API sees the socket close)


class Crash:
    def __init__(self, platform: SoakPlatform, *, replica: int, after_s: float) -> None:
        self.platform = platform
        self.replica = replica
        self.after_s = after_s
        self.killed_at: float | None = None  # time.monotonic()
        self.restart_s: float | None = None
        self._timer = threading.Timer(after_s, self._crash)

    def __enter__(self) -> Crash:
        self._timer.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._timer.join()

    def _crash(self) -> None:
        self.killed_at = time.monotonic()
        self.restart_s = self.platform.crash_and_restart(self.replica)

    def broke(self, ended_at: float) -> bool:
        """Whether a request that ended at ``ended_at`` (a broken stream) ended because of the crash."""
        return self.killed_at is not None and self.killed_at <= ended_at <= self.killed_at + BROKEN_WINDOW_S

    def render(self) -> str:
        if self.killed_at is None:
            return "replica crash: did not happen (the soak ended first)"
        name = self.platform.replicas[self.replica].id
        return (
            f"replica crash: {name} killed {self.after_s:.0f} s into the measured soak, "
            f"serving again {self.restart_s:.1f} s later"
        )
