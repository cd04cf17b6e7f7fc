"""The real S3 store with a test-controlled gate: downloads under a held prefix wait until the test opens it.

This lets a test observe what the server does *while* an adapter is loading, by events, not by time.
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field

from core.errors import StorageError
from core.storage import S3ObjectStore
from core.storage.base import CHUNK

GATE_TIMEOUT_S = 120.0  # a test that never opens its gate must not hang the loader forever


@dataclass
class Gate:
    entered: threading.Event = field(default_factory=threading.Event)  # a download reached the gate
    opened: threading.Event = field(default_factory=threading.Event)

    def open(self) -> None:
        self.opened.set()


class GatedS3Store(S3ObjectStore):
    """``S3ObjectStore`` that counts downloads per key and holds those under gated prefixes."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self.gates: dict[str, Gate] = {}
        self.downloads: Counter[str] = Counter()
        self._lock = threading.Lock()

    def hold(self, prefix: str) -> Gate:
        gate = self.gates[prefix] = Gate()
        return gate

    def iter_chunks(self, key: str, chunk_size: int = CHUNK) -> Iterator[bytes]:
        with self._lock:
            self.downloads[key] += 1
        gate = next((g for prefix, g in self.gates.items() if key.startswith(prefix)), None)
        if gate is not None:
            gate.entered.set()
            if not gate.opened.wait(GATE_TIMEOUT_S):
                raise StorageError(f"test gate on {key} was never opened")
        yield from super().iter_chunks(key, chunk_size)
