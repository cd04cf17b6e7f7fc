"""A training worker's Prometheus metrics: its queue's depth, job attempt durations and failures.

Jobs run in Celery's pool processes (prefork), so counts are kept with prometheus_client's multiprocess
mode: ``loraplex worker`` points ``PROMETHEUS_MULTIPROC_DIR`` at a fresh directory before anything imports
prometheus_client (:func:`use_multiprocess_dir`), every pool process writes its samples there, and the main
process serves them all, with the queue depth read from Redis at each scrape, on
``--metrics-host``:``--metrics-port`` (``/metrics``). Names are listed in docs/operations.md.
"""

from __future__ import annotations

import atexit
import logging
import os
import shutil
import tempfile
from collections.abc import Iterator

log = logging.getLogger(__name__)

MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"
JOB_BUCKETS = (1, 5, 15, 30, 60, 120, 300, 600, 1200, 1800, 3600, 7200, 14400, 28800, 86400)


def use_multiprocess_dir() -> str:
    """Give this process and the pool processes it forks one fresh samples directory (removed at exit). Must
    run before prometheus_client is imported: it picks its storage then."""
    path = tempfile.mkdtemp(prefix="loraplex-worker-metrics-")
    os.environ[MULTIPROC_ENV] = path
    atexit.register(shutil.rmtree, path, True)
    return path


class _JobMetrics:
    """Created on first use, so that the multiprocess directory, if any, is set by then."""

    def __init__(self) -> None:
        from prometheus_client import Counter, Histogram

        self.attempt_seconds = Histogram(
            "loraplex_worker_job_duration_seconds",
            "Wall time of one attempt at a fine-tuning job, by method and how it ended.",
            ["method", "outcome"],
            buckets=JOB_BUCKETS,
        )
        self.failures = Counter(
            "loraplex_worker_job_failures_total",
            "Failed job attempts by error code; retryable ones are tried again.",
            ["code", "retryable"],
        )


_metrics: _JobMetrics | None = None


def job_metrics() -> _JobMetrics:
    global _metrics
    if _metrics is None:
        _metrics = _JobMetrics()
    return _metrics


class QueueDepth:
    """A collector reading the training queue's length from Redis at scrape time."""

    def __init__(self, redis_url: str, queue: str) -> None:
        import redis

        self.client = redis.Redis.from_url(redis_url, socket_timeout=2, socket_connect_timeout=2)
        self.queue = queue

    def collect(self) -> Iterator:
        from prometheus_client.core import GaugeMetricFamily

        gauge = GaugeMetricFamily(
            "loraplex_worker_queue_depth", "Fine-tuning jobs waiting in the queue for a worker.", labels=["queue"]
        )
        try:
            # Kombu's Redis transport keeps a queue's waiting messages in a list named after the queue.
            gauge.add_metric([self.queue], float(self.client.llen(self.queue)))
        except Exception as exc:  # a scrape must not fail because Redis blinked; the gauge is just absent
            log.warning("could not read the depth of %s: %s", self.queue, exc)
        yield gauge


def serve_metrics(host: str, port: int, redis_url: str, queue: str) -> bool:
    """Serve the pool processes' samples and the queue depth; False (logged) if the port cannot be had."""
    from prometheus_client import CollectorRegistry, start_http_server
    from prometheus_client.multiprocess import MultiProcessCollector

    registry = CollectorRegistry()
    if os.environ.get(MULTIPROC_ENV):
        MultiProcessCollector(registry)
    registry.register(QueueDepth(redis_url, queue))  # type: ignore[arg-type]
    try:
        start_http_server(port, addr=host, registry=registry)
    except OSError as exc:
        log.warning("worker metrics not served: %s:%d is unavailable (%s)", host, port, exc)
        return False
    log.info("worker metrics on http://%s:%d/metrics", host, port)
    return True
