"""Keeps a running attempt's lease: a heartbeat thread, and the between-steps "should training stop?" check."""

from __future__ import annotations

import logging
import threading

from sqlalchemy.engine import Engine

from worker.lifecycle import Lease, heartbeat, read_lease

log = logging.getLogger(__name__)


class LeaseKeeper:
    """Use as a context manager around training; ``should_stop`` is the trainer's cancellation callable."""

    def __init__(self, engine: Engine, lease: Lease, interval: float) -> None:
        self.engine = engine
        self.lease = lease
        self.interval = interval
        self.lost = False  # the job was requeued or ended behind our back: stop and write nothing
        self.cancel_requested = False
        self._stopped = threading.Event()
        # A thread, not the training loop, beats: one long step (a big batch on a big model) must not
        # look like a dead worker.
        self._thread = threading.Thread(target=self._beat, name=f"heartbeat-{lease.job_id}", daemon=True)

    def __enter__(self) -> LeaseKeeper:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stopped.set()
        self._thread.join(timeout=30)

    def _beat(self) -> None:
        while not self._stopped.wait(self.interval):
            try:
                if not heartbeat(self.engine, self.lease):
                    log.warning("job %s: lease lost (requeued or ended elsewhere); stopping", self.lease.job_id)
                    self.lost = True
                    return
            except Exception:
                # A database blip: keep training; the reaper's staleness window is several beats long.
                log.warning("job %s: heartbeat failed", self.lease.job_id, exc_info=True)

    def should_stop(self) -> bool:
        """True when the job was cancelled or this attempt no longer owns it (checked between steps)."""
        if self.lost:
            return True
        try:
            held, cancel = read_lease(self.engine, self.lease)
        except Exception:
            log.warning("job %s: cancel check failed; continuing", self.lease.job_id, exc_info=True)
            return False
        self.lost = not held
        self.cancel_requested = cancel
        return self.lost or cancel
