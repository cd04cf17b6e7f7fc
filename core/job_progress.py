"""What ``loraplex up`` prints while jobs train: a line when a job is queued or starts, its step, loss and ETA
every few seconds while it runs, and how it ended (with the model name to call).

It reads the jobs and their metrics events from the database, the same rows the API serves, so the console
says what a client polling the job would see.
"""

from __future__ import annotations

from dataclasses import dataclass

from sqlalchemy.engine import Engine
from sqlmodel import col, select

from core.db import read_session
from core.models import FineTuneJob, JobEvent, JobStatus

PROGRESS_EVERY_S = 10.0  # between two progress lines of one running job


@dataclass
class _Seen:
    status: str
    step: int = 0
    printed_at: float = float("-inf")  # the first progress line comes at once


class JobProgress:
    """Call :meth:`poll` now and then; it returns the lines to print since the last call."""

    def __init__(self, engine: Engine, every_s: float = PROGRESS_EVERY_S) -> None:
        self._engine = engine
        self._every_s = every_s
        self._seen: dict[str, _Seen] = {}

    def poll(self, now: float) -> list[str]:
        """Lines for status changes and, at most every ``every_s`` per job, for training progress."""
        with read_session(self._engine) as session:
            watched = col(FineTuneJob.status).in_([JobStatus.QUEUED, JobStatus.RUNNING]) | col(FineTuneJob.id).in_(
                [job_id for job_id, seen in self._seen.items() if seen.status not in JobStatus.TERMINAL]
            )
            jobs = session.exec(select(FineTuneJob).where(watched).order_by(col(FineTuneJob.id))).all()
            latest = {job.id: _latest_step(session, job.id) for job in jobs if job.status == JobStatus.RUNNING}
        lines = []
        for job in jobs:
            seen = self._seen.setdefault(job.id, _Seen(status=""))
            if job.status != seen.status:
                seen.status = job.status
                lines.append(_status_line(job))
            event = latest.get(job.id)
            if event is None or event.data is None:
                continue
            step = int(event.data.get("step", 0))
            if step > seen.step and now - seen.printed_at >= self._every_s:
                seen.step, seen.printed_at = step, now
                lines.append(f"job {job.id}: {_progress(event.data)}")
        return lines


def _latest_step(session, job_id: str) -> JobEvent | None:  # type: ignore[no-untyped-def]
    stmt = (
        select(JobEvent)
        .where(JobEvent.job_id == job_id, JobEvent.type == "metrics", col(JobEvent.message).startswith("Step "))
        .order_by(col(JobEvent.id).desc())
        .limit(1)
    )
    return session.exec(stmt).first()


def _status_line(job: FineTuneJob) -> str:
    if job.status == JobStatus.SUCCEEDED:
        return f"job {job.id}: succeeded; call it as model {job.fine_tuned_model}"
    if job.status == JobStatus.FAILED:
        return f"job {job.id}: failed: {job.error_message}"
    return f"job {job.id}: {job.status}"


def _progress(data: dict) -> str:
    step, total = int(data.get("step", 0)), int(data.get("total_steps") or 0)
    parts = [f"step {step}/{total}" + (f" ({100 * step // total}%)" if total else "")]
    if data.get("train_loss") is not None:
        parts.append(f"loss {float(data['train_loss']):.4f}")
    if data.get("eta_seconds") is not None:
        parts.append(f"ETA {_duration(float(data['eta_seconds']))}")
    return ", ".join(parts)


def _duration(seconds: float) -> str:
    minutes, secs = divmod(round(seconds), 60)
    return f"{minutes}m{secs:02d}s" if minutes else f"{secs}s"
