"""What one API process sees of a base model's load, and the replica count that load wants."""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

TOKEN_WINDOW_S = 60.0


@dataclass
class TokenRate:
    """Output tokens delivered over the last ``window`` seconds."""

    window: float = TOKEN_WINDOW_S
    clock: Callable[[], float] = time.monotonic
    _events: deque[tuple[float, int]] = field(default_factory=deque)
    _total: int = 0

    def add(self, tokens: int) -> None:
        if tokens > 0:
            self._events.append((self.clock(), tokens))
            self._total += tokens

    def per_second(self) -> float:
        cutoff = self.clock() - self.window
        while self._events and self._events[0][0] < cutoff:
            self._total -= self._events.popleft()[1]
        return self._total / self.window


@dataclass
class BaseDemand:
    """One base model's requests as this API process sees them."""

    held: int = 0  # waiting here for a replica to start
    last_active: float = field(default_factory=time.time)  # a request started or ended (Unix seconds)
    tokens: TokenRate = field(default_factory=TokenRate)

    def touch(self, now: float | None = None) -> None:
        self.last_active = time.time() if now is None else now


def replicas_wanted(
    in_flight: int, held: int, idle_s: float, *, idle_ttl: float | None, target_requests: int, most: int
) -> int:
    """Replicas a base needs: none once idle for ``idle_ttl`` with nothing in flight or held; otherwise one
    per ``target_requests`` requests in flight or held, at least one and at most ``most``."""
    busy = in_flight + held
    if idle_ttl is not None and busy == 0 and idle_s >= idle_ttl:
        return 0
    return min(most, max(1, math.ceil(busy / target_requests)))
