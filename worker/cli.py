"""``loraplex worker``: a Celery training worker for the configured base model."""

from __future__ import annotations

import logging
import os
from typing import Annotated

import typer

from core.cli import console, ready_database, settings_or_exit
from core.settings import LOG_FORMAT
from core.thread_options import TrainThreads


def register(app: typer.Typer) -> None:
    """Add the ``worker`` command to the ``loraplex`` CLI."""

    @app.command("worker")
    def worker_cmd(
        concurrency: Annotated[int, typer.Option(min=1, help="Jobs trained at once (one per GPU).")] = 1,
        loglevel: Annotated[str, typer.Option(help="debug, info, warning or error.")] = "info",
        heartbeat_seconds: Annotated[
            float, typer.Option(envvar="LORAPLEX_WORKER_HEARTBEAT_SECONDS", help="Heartbeat of a running job.")
        ] = 10.0,
        stale_after_seconds: Annotated[
            float,
            typer.Option(
                envvar="LORAPLEX_WORKER_STALE_AFTER_SECONDS",
                help="Silence after which a running job is requeued (and a queued one without its message sent again).",
            ),
        ] = 120.0,
        reap_every_seconds: Annotated[
            float, typer.Option(envvar="LORAPLEX_WORKER_REAP_EVERY_SECONDS", help="How often to look for stale jobs.")
        ] = 30.0,
        retry_delay_seconds: Annotated[
            float,
            typer.Option(envvar="LORAPLEX_WORKER_RETRY_DELAY_SECONDS", help="Wait before retrying a transient error."),
        ] = 30.0,
        orphan_grace_seconds: Annotated[
            float,
            typer.Option(
                envvar="LORAPLEX_WORKER_ORPHAN_GRACE_SECONDS",
                help="Age after which stored objects that no row refers to (a crashed upload's) are removed.",
            ),
        ] = 3600.0,
        checkpoint_interval_seconds: Annotated[
            float,
            typer.Option(
                envvar="LORAPLEX_WORKER_CHECKPOINT_INTERVAL_SECONDS",
                help="Epochs before a job's last three checkpoint at most this often (0: every epoch).",
            ),
        ] = 60.0,
        threads: TrainThreads = None,
        metrics_port: Annotated[
            int,
            typer.Option(
                envvar="LORAPLEX_WORKER_METRICS_PORT", min=0, max=65535, help="Prometheus /metrics port (0: none)."
            ),
        ] = 9101,
        metrics_host: Annotated[
            str, typer.Option(envvar="LORAPLEX_WORKER_METRICS_HOST", help="Interface /metrics listens on.")
        ] = "127.0.0.1",
    ) -> None:
        """Train fine-tuning jobs from the queue of LORAPLEX_BASE_MODEL (Redis at LORAPLEX_REDIS_URL)."""
        from core.queue import train_queue
        from worker.metrics import serve_metrics, use_multiprocess_dir
        from worker.runtime import WorkerOptions

        settings = settings_or_exit()
        if settings.model_name is None:
            console.print("[red]error:[/red] LORAPLEX_BASE_MODEL is not set: give a model directory or hub id")
            raise typer.Exit(2)
        try:
            options = WorkerOptions(
                heartbeat_seconds,
                stale_after_seconds,
                reap_every_seconds,
                retry_delay_seconds,
                orphan_grace_seconds,
                checkpoint_interval_seconds,
                train_threads=threads,
            )
        except ValueError as exc:
            console.print(f"[red]error:[/red] {exc}")
            raise typer.Exit(2) from None
        ready_database(settings)
        logging.basicConfig(level=loglevel.upper(), format=LOG_FORMAT)
        if metrics_port:
            use_multiprocess_dir()  # before the app (and prometheus_client) is imported
        from core.queue import redis_url
        from worker.app import create_worker_app

        celery = create_worker_app(settings, options)
        if metrics_port:
            serve_metrics(metrics_host, metrics_port, redis_url(settings), train_queue(settings.model_name))
        celery.worker_main(
            [
                "worker",
                f"--loglevel={loglevel}",
                f"--concurrency={concurrency}",
                "--pool=prefork",  # the reaper and heartbeats start in pool processes (worker_process_init)
                f"--queues={train_queue(settings.model_name)}",
                f"--hostname=train-{os.getpid()}@%h",
                # Training workers need no cluster chatter: the database tracks jobs and liveness.
                "--without-gossip",
                "--without-mingle",
                "--without-heartbeat",
            ]
        )
