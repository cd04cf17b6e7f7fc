"""The job state machine: exactly the moves the lifecycle needs are allowed, every other one is refused
with a 409 and leaves the job as it was, and each status looks the same whoever moved the job there."""

from __future__ import annotations

import itertools

import pytest

from api.errors import loraplex_error_response
from core.job_states import (
    TRANSITIONS,
    IllegalTransition,
    JobStatus,
    check_move,
    mark_ended,
    mark_queued,
    mark_running,
    sources,
)
from core.models import FineTuneJob

S = JobStatus
# Written out independently of TRANSITIONS: the lifecycle as docs/users know it.
LEGAL = {
    (S.VALIDATING_FILES, S.QUEUED),  # files confirmed
    (S.VALIDATING_FILES, S.FAILED),  # submission interrupted
    (S.VALIDATING_FILES, S.CANCELLED),
    (S.QUEUED, S.QUEUED),  # lost message sent again
    (S.QUEUED, S.RUNNING),
    (S.QUEUED, S.SUCCEEDED),  # an earlier attempt's adapter found on claim
    (S.QUEUED, S.FAILED),  # out of attempts on claim
    (S.QUEUED, S.CANCELLED),
    (S.RUNNING, S.QUEUED),  # worker lost, or a platform outage
    (S.RUNNING, S.RUNNING),  # a new attempt over a dead one
    (S.RUNNING, S.SUCCEEDED),
    (S.RUNNING, S.FAILED),
    (S.RUNNING, S.CANCELLED),
}
ALL_MOVES = list(itertools.product(S.ALL, S.ALL))


def job_in(status: str) -> FineTuneJob:
    return FineTuneJob(
        id="ftjob-abc",
        tenant_id="tenant-a",
        base_model="base",
        training_file="file-1",
        status=status,
        attempts=1,
        worker_id="host:1" if status == S.RUNNING else None,
        heartbeat_at=100.0 if status == S.RUNNING else None,
        started_at=50 if status in (S.RUNNING, S.SUCCEEDED, S.FAILED) else None,
        finished_at=200 if status in S.TERMINAL else None,
        error_code="earlier" if status == S.FAILED else None,
        error_message="it broke" if status == S.FAILED else None,
    )


def move(job: FineTuneJob, target: str) -> None:
    """Move ``job`` to ``target`` the way callers do; validating_files has no mover, so it is only checked."""
    if target == S.QUEUED:
        mark_queued(job)
    elif target == S.RUNNING:
        mark_running(job, "host:2")
    elif target in S.TERMINAL:
        mark_ended(job, target, error="why", code="some_code")
    else:
        check_move(job, target)


def test_the_table_is_exactly_the_lifecycle() -> None:
    assert {(a, b) for a, targets in TRANSITIONS.items() for b in targets} == LEGAL
    assert set(TRANSITIONS) == set(S.ALL)
    assert {s for s, targets in TRANSITIONS.items() if not targets} == S.TERMINAL


@pytest.mark.parametrize(("current", "target"), [m for m in ALL_MOVES if m not in LEGAL])
def test_an_illegal_move_is_refused_and_changes_nothing(current: str, target: str) -> None:
    job = job_in(current)
    before = job.model_dump()

    with pytest.raises(IllegalTransition) as caught:
        move(job, target)

    assert job.model_dump() == before
    assert (caught.value.status, caught.value.target, caught.value.status_code) == (current, target, 409)
    assert f"already {current}" in caught.value.message


@pytest.mark.parametrize(("current", "target"), sorted(LEGAL))
def test_a_legal_move_happens(current: str, target: str) -> None:
    job = job_in(current)

    move(job, target)

    assert job.status == target


def test_sources_are_the_guard_for_each_target() -> None:
    assert sources(S.CANCELLED) == {S.VALIDATING_FILES, S.QUEUED, S.RUNNING}
    assert sources(S.RUNNING) == {S.QUEUED, S.RUNNING}
    assert sources(S.VALIDATING_FILES) == frozenset()


def test_a_failed_job_carries_the_error_a_user_reads() -> None:
    job = job_in(S.RUNNING)

    mark_ended(job, S.FAILED, error="out of memory at step 3", param="hyperparameters.batch_size")

    assert (job.error_code, job.error_message, job.error_param) == (
        "training_error",
        "out of memory at step 3",
        "hyperparameters.batch_size",
    )
    assert job.finished_at is not None and job.heartbeat_at is None


@pytest.mark.parametrize("status", [S.SUCCEEDED, S.CANCELLED])
def test_a_job_that_ends_otherwise_has_no_error(status: str) -> None:
    job = job_in(S.RUNNING)
    job.error_code = "stale"  # left by nothing today; an ended job must still not show it

    mark_ended(job, status, error="ignored")

    assert (job.status, job.error_code, job.error_message, job.heartbeat_at) == (status, None, None, None)
    assert job.finished_at is not None


def test_ending_needs_a_terminal_status() -> None:
    job = job_in(S.RUNNING)
    with pytest.raises(ValueError, match="does not end a job"):
        mark_ended(job, S.QUEUED)
    assert job.status == S.RUNNING


def test_queueing_releases_the_worker_and_a_new_attempt_is_counted() -> None:
    job = job_in(S.RUNNING)

    mark_queued(job, delay=30.0)
    assert (job.worker_id, job.heartbeat_at) == (None, None) and job.queued_at is not None
    mark_running(job, "host:2")

    assert (job.status, job.attempts, job.worker_id, job.started_at) == (S.RUNNING, 2, "host:2", 50)
    assert job.heartbeat_at is not None


def test_a_refused_cancel_is_a_409_clients_do_not_retry() -> None:
    job = job_in(S.SUCCEEDED)
    with pytest.raises(IllegalTransition) as caught:
        check_move(job, S.CANCELLED)

    response = loraplex_error_response(caught.value)

    assert (response.status_code, response.headers["x-should-retry"]) == (409, "false")
    assert b'"code":"job_not_cancellable"' in response.body
    assert b"only a validating_files, queued or running job can become cancelled" in response.body
