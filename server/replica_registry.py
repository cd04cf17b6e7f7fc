"""Tell the control plane this replica exists: a ``ReplicaStatus`` heartbeat and adapter residency increments.

Every ``interval`` seconds the status is written to ``replica_key(id)`` with a TTL (a replica that stops
heartbeating disappears by itself), the page-seconds each stored adapter spent in the pool since the
last beat are appended to ``RESIDENCY_STREAM``, and the audit events recorded since (``server.audit``) to
``AUDIT_STREAM``. Increments that could not be written are kept and sent
with the next beat, so Redis blips lose no metering.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable

import redis

from core.protocol import (
    AUDIT_STREAM,
    AUDIT_STREAM_MAXLEN,
    REPLICA_TTL_S,
    RESIDENCY_STREAM,
    RESIDENCY_STREAM_MAXLEN,
    ReplicaStatus,
    replica_key,
)
from server.audit import AuditTrail

log = logging.getLogger(__name__)


class ReplicaPublisher:
    """A thread writing heartbeats and residency to Redis."""

    def __init__(
        self,
        redis_url: str,
        replica_id: str,
        status: Callable[[], ReplicaStatus],
        residency: Callable[[], dict[str, float]],
        interval: float,
        audit: AuditTrail | None = None,
    ) -> None:
        self.client = redis.Redis.from_url(redis_url, socket_timeout=2, socket_connect_timeout=2)
        self.replica_id = replica_id
        self.status = status
        self.residency = residency
        self.interval = interval
        self.audit = audit
        self._unsent: dict[str, float] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="replica-heartbeat", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        """Stop beating, send the last residency, and remove the replica's key so routing drops it at once."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=10)
        try:
            self._send_residency()
            self._send_audit()
            self.client.delete(replica_key(self.replica_id))
        except redis.RedisError as exc:
            log.warning("could not deregister replica %s: %s", self.replica_id, exc)
        self.client.close()

    def beat(self) -> None:
        """One heartbeat and residency flush (raises ``redis.RedisError``)."""
        ttl = math.ceil(REPLICA_TTL_S)
        self.client.set(replica_key(self.replica_id), self.status().model_dump_json(), ex=ttl)
        self._send_residency()
        self._send_audit()

    def _send_audit(self) -> None:
        if self.audit is None:
            return
        events = self.audit.take()
        sent = 0
        try:
            for event in events:
                fields = {"event": event.model_dump_json()}
                self.client.xadd(AUDIT_STREAM, fields, maxlen=AUDIT_STREAM_MAXLEN, approximate=True)  # type: ignore[arg-type]
                sent += 1
        finally:
            if sent < len(events):
                self.audit.give_back(events[sent:])

    def _send_residency(self) -> None:
        for adapter_id, seconds in self.residency().items():
            self._unsent[adapter_id] = self._unsent.get(adapter_id, 0.0) + seconds
        now = f"{time.time():.3f}"
        while self._unsent:
            adapter_id, seconds = next(iter(self._unsent.items()))
            if seconds > 0:
                fields = {
                    "adapter_id": adapter_id,
                    "page_seconds": f"{seconds:.6f}",
                    "replica": self.replica_id,
                    "at": now,
                }
                self.client.xadd(RESIDENCY_STREAM, fields, maxlen=RESIDENCY_STREAM_MAXLEN, approximate=True)
            del self._unsent[adapter_id]

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.beat()
            except redis.RedisError as exc:
                log.warning("heartbeat to Redis failed (will retry): %s", exc)
            self._stop.wait(self.interval)
