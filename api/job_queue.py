"""Hands fine-tuning jobs to the workers through Celery on Redis; a broker outage becomes a retryable 503."""

from __future__ import annotations

import logging

from celery import Celery
from kombu.exceptions import KombuError
from redis.exceptions import RedisError

from core.errors import ServiceUnavailable
from core.jobs import enqueue_job
from core.models import FineTuneJob

log = logging.getLogger(__name__)

RETRY_AFTER_SECONDS = 5.0


class JobQueue:
    """The producer side of the training queue."""

    def __init__(self, celery: Celery) -> None:
        self.celery = celery

    def submit(self, job: FineTuneJob) -> None:
        """Publish ``job`` to its base model's queue; raises ``ServiceUnavailable`` when Redis is unreachable."""
        try:
            enqueue_job(self.celery, job)
        except (KombuError, RedisError, OSError) as exc:
            log.warning("cannot publish job %s: %s", job.id, exc)
            raise ServiceUnavailable(
                "the job queue (Redis) is unreachable; no job was created, retry shortly",
                retry_after=RETRY_AFTER_SECONDS,
                code="queue_unavailable",
            ) from exc

    def ping(self) -> None:
        """Check the broker answers; raises ``ServiceUnavailable`` otherwise."""
        try:
            with self.celery.connection_for_write() as conn:
                conn.ensure_connection(max_retries=1)
        except (KombuError, RedisError, OSError) as exc:
            # The cause (with Redis' address) goes to the log, not to whoever asked /ready.
            log.warning("the job queue is unreachable: %s", exc)
            raise ServiceUnavailable("the job queue (Redis) is unreachable", code="queue_unavailable") from exc

    def close(self) -> None:
        """Release broker connections."""
        self.celery.close()
