"""The fine-tuning job state machine: the statuses, the moves allowed between them, and the one place a
job's status is written.

Every status change goes through :func:`mark_queued`, :func:`mark_running` or :func:`mark_ended`, which
check the move against ``TRANSITIONS`` and set the fields that belong to the new status, so a job looks
the same whoever moved it. Callers hold the job's row lock (``core.jobs.lock_job``) from reading the
status to writing the new one, so no other process can move the job in between.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import TYPE_CHECKING

from core.errors import Conflict
from core.ids import now

if TYPE_CHECKING:
    from core.models import FineTuneJob

TRAINING_ERROR_CODE = "training_error"


class JobStatus:
    """The OpenAI fine-tuning job states, in lifecycle order."""

    VALIDATING_FILES = "validating_files"
    QUEUED = "queued"
    RUNNING = "running"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    CANCELLED = "cancelled"

    ALL = (VALIDATING_FILES, QUEUED, RUNNING, SUCCEEDED, FAILED, CANCELLED)
    TERMINAL = frozenset({SUCCEEDED, FAILED, CANCELLED})


# Status -> the statuses a job in it may move to. Why each move happens:
#   validating_files -> queued     the API confirmed the files are stored
#   validating_files -> failed     the submitting API stopped midway (worker.requeue fails it)
#   queued -> queued               its lost queue message is sent again (worker.requeue)
#   queued -> running              a worker claims it
#   queued -> succeeded            an earlier attempt already stored the adapter; the claim only records it
#   queued -> failed               it is out of attempts when claimed
#   running -> queued              its worker was lost (worker.reaper) or a platform service was down (retry)
#   running -> running             a new attempt takes over from a dead one
#   any unfinished -> cancelled    the client cancelled; a running job ends once its worker or the reaper sees it
# Finished jobs never move again.
TRANSITIONS: Mapping[str, frozenset[str]] = {
    JobStatus.VALIDATING_FILES: frozenset({JobStatus.QUEUED, JobStatus.FAILED, JobStatus.CANCELLED}),
    JobStatus.QUEUED: frozenset({JobStatus.QUEUED, JobStatus.RUNNING, *JobStatus.TERMINAL}),
    JobStatus.RUNNING: frozenset({JobStatus.QUEUED, JobStatus.RUNNING, *JobStatus.TERMINAL}),
    JobStatus.SUCCEEDED: frozenset(),
    JobStatus.FAILED: frozenset(),
    JobStatus.CANCELLED: frozenset(),
}

# Codes clients already rely on, per target; other refusals get IllegalTransition's default code.
_REFUSAL_CODES = {JobStatus.CANCELLED: "job_not_cancellable"}


def sources(target: str) -> frozenset[str]:
    """The statuses a job may move to ``target`` from: the guard for whoever moves jobs there."""
    return frozenset(status for status, targets in TRANSITIONS.items() if target in targets)


def can_move(status: str, target: str) -> bool:
    """Whether a job in ``status`` may move to ``target``."""
    return target in TRANSITIONS.get(status, frozenset())


def _either(statuses: frozenset[str]) -> str:
    names = [s for s in JobStatus.ALL if s in statuses]
    return names[0] if len(names) == 1 else ", ".join(names[:-1]) + " or " + names[-1]


class IllegalTransition(Conflict):
    """A job was asked to move where its status forbids: it finished, or moved on, in the meantime."""

    default_code = "invalid_job_transition"

    def __init__(self, job_id: str, status: str, target: str) -> None:
        allowed = sources(target)
        hint = f"only a {_either(allowed)} job can become {target}" if allowed else f"no job can become {target}"
        super().__init__(f"job {job_id} already {status}; {hint}", code=_REFUSAL_CODES.get(target))
        self.job_id, self.status, self.target = job_id, status, target


def check_move(job: FineTuneJob, target: str) -> None:
    """Raise ``IllegalTransition`` unless ``job`` may move to ``target`` now."""
    if not can_move(job.status, target):
        raise IllegalTransition(job.id, job.status, target)


def _enter(job: FineTuneJob, target: str) -> None:
    # The only assignment of a job's status anywhere: everything else calls the mark_* functions.
    check_move(job, target)
    job.status = target


def mark_queued(job: FineTuneJob, *, delay: float = 0.0) -> None:
    """Move ``job`` to ``queued`` and note when its message is due, so a lost message can be noticed
    (``worker.requeue``). Send the message with ``core.jobs.enqueue_job`` once the row is written."""
    _enter(job, JobStatus.QUEUED)
    job.worker_id = None
    job.heartbeat_at = None
    job.queued_at = time.time() + delay


def mark_running(job: FineTuneJob, worker_id: str) -> None:
    """Move ``job`` to ``running`` as a new attempt by ``worker_id``; ``attempts`` counts it."""
    _enter(job, JobStatus.RUNNING)
    job.attempts += 1
    job.worker_id = worker_id
    job.heartbeat_at = time.time()
    job.started_at = job.started_at or now()


def mark_ended(
    job: FineTuneJob, status: str, *, error: str | None = None, code: str | None = None, param: str | None = None
) -> None:
    """Move ``job`` to the terminal ``status``; a ``failed`` one keeps ``error`` (and ``code``, ``param``)
    for the user to read, any other ends with no error."""
    if status not in JobStatus.TERMINAL:
        raise ValueError(f"{status!r} does not end a job; use one of {sorted(JobStatus.TERMINAL)}")
    _enter(job, status)
    job.finished_at = now()
    job.heartbeat_at = None  # nothing runs it any more: the reaper must not look at it
    if status == JobStatus.FAILED:
        job.error_code, job.error_message, job.error_param = code or TRAINING_ERROR_CODE, error, param
    else:
        job.error_code = job.error_message = job.error_param = None
