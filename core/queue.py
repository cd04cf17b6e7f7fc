"""The Celery wiring the API (producer) and workers (consumers) share: app config, task names, queues.

Training jobs are long and expensive, so a message is acknowledged only after the task finishes
(``acks_late``) and goes back to the queue if the worker dies (``reject_on_worker_lost``); the job row's
attempt counter, not Celery, bounds how often that can happen.
"""

from __future__ import annotations

import base64
import json
import re

from celery import Celery

from core.errors import ConfigError
from core.settings import Settings

TRAIN_TASK = "loraplex.train_job"
DEFAULT_MAX_JOB_SECONDS = 24 * 3600
_QUEUE_SAFE = re.compile(r"[^A-Za-z0-9_.-]+")


def redis_url(settings: Settings) -> str:
    """The Redis URL in effect; embedded Redis exists only under `loraplex up`, which sets it for children."""
    if not settings.redis_url:
        raise ConfigError("LORAPLEX_REDIS_URL is not set: point it at Redis, or run everything with `loraplex up`")
    return settings.redis_url


def train_queue(base_model: str) -> str:
    """One queue per base model, so workers only take jobs for the model they hold."""
    return "train." + _QUEUE_SAFE.sub("-", base_model)


def make_celery(settings: Settings, *, max_job_seconds: int = DEFAULT_MAX_JOB_SECONDS) -> Celery:
    """A Celery app on the configured Redis (broker and result backend), tuned for long jobs."""
    url = redis_url(settings)
    app = Celery("loraplex", broker=url, backend=url)
    app.conf.update(
        task_acks_late=True,
        task_reject_on_worker_lost=True,
        worker_prefetch_multiplier=1,
        # Redis re-delivers an unacknowledged message after the visibility timeout; it must outlast
        # the longest job or a healthy long job would be handed to a second worker.
        broker_transport_options={"visibility_timeout": max_job_seconds + 3600},
        result_backend_transport_options={"visibility_timeout": max_job_seconds + 3600},
        task_time_limit=max_job_seconds + 600,
        task_soft_time_limit=max_job_seconds,
        task_serializer="json",
        result_serializer="json",
        accept_content=["json"],
        result_expires=7 * 24 * 3600,
        broker_connection_retry_on_startup=True,
        task_default_queue="default",
        worker_hijack_root_logger=False,
    )
    return app


def waiting_job_ids(celery: Celery, queue: str) -> set[str]:
    """Ids of the jobs whose messages wait in ``queue`` now (not those a worker already took).

    Kombu's Redis transport keeps a queue's waiting messages in a list named after the queue (we never
    send priorities, which would add sibling lists); each holds the task's arguments, ``[job_id]``.
    """
    with celery.connection_for_read() as conn:
        raw_messages = conn.default_channel.client.lrange(queue, 0, -1)
    return {job_id for raw in raw_messages if (job_id := _job_id(raw)) is not None}


def in_flight_job_ids(celery: Celery, queue: str, *, delivered_since: float) -> set[str]:
    """Ids of the jobs whose messages from ``queue`` a worker took at or after ``delivered_since`` (epoch
    seconds) and has not acknowledged yet: delivered, but maybe not yet claimed in the job row.

    Kombu's Redis transport moves a delivered message into the ``unacked`` hash (tag -> ``[message,
    exchange, routing key]``), scored by delivery time in ``unacked_index``. Older deliveries are left
    out on purpose: a worker that died holding one will not run it, and the visibility timeout that
    would hand it out again lasts a day.
    """
    with celery.connection_for_read() as conn:
        channel = conn.default_channel
        client = channel.client
        tags = client.zrange(channel.unacked_index_key, delivered_since, "+inf", byscore=True)
        raw_entries = client.hmget(channel.unacked_key, tags) if tags else []
    ids = set()
    for raw in raw_entries:
        try:
            message, _exchange, routing_key = json.loads(raw)
        except (TypeError, ValueError):
            continue  # acknowledged since we read the index, or not one of ours
        if routing_key == queue and (job_id := _job_id(message)) is not None:
            ids.add(job_id)
    return ids


def _job_id(message: bytes | str | dict) -> str | None:
    """The job id a Celery message of ``TRAIN_TASK`` carries (its only argument); None for anything else."""
    try:
        if not isinstance(message, dict):
            message = json.loads(message)
        body = message["body"]
        if message.get("properties", {}).get("body_encoding") == "base64":
            body = base64.b64decode(body)
        args = json.loads(body)[0]
    except (ValueError, KeyError, IndexError, TypeError):
        return None
    return args[0] if args and isinstance(args[0], str) else None


# Redis pub/sub channel on which workers announce adapter lifecycle events to the API:
# {"event": "prefetch" | "unload", "adapter": AdapterDescriptor JSON}. The API routes each to the right
# replica (prefetch on the adapter's chosen replica, unload everywhere). Best effort: a server that
# misses one still loads the adapter on its first request.
ADAPTER_EVENTS_CHANNEL = "loraplex:adapter-events"
