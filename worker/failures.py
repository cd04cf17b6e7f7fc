"""Turn what went wrong in an attempt into the error a user reads: a code, a message that says what to
do next, the parameter to change, and whether another attempt could succeed."""

from __future__ import annotations

import logging
from dataclasses import dataclass

from celery.exceptions import SoftTimeLimitExceeded
from pydantic import ValidationError

from core.errors import LoraplexError, ServiceUnavailable

log = logging.getLogger(__name__)
_TRANSIENT_NAMES = {"OperationalError", "ConnectionError", "TimeoutError"}  # DB, Redis and network blips


@dataclass(frozen=True)
class Failure:
    code: str
    message: str
    param: str | None = None
    retryable: bool = False


def classify_failure(exc: BaseException, job_id: str) -> Failure:
    """The user-facing failure for ``exc`` (unexpected ones are logged with their traceback)."""
    if isinstance(exc, ServiceUnavailable):
        return Failure(exc.code, exc.message, retryable=True)
    if isinstance(exc, LoraplexError):
        return Failure(exc.code, exc.message, exc.param)
    if isinstance(exc, SoftTimeLimitExceeded):
        return Failure(
            "time_limit_exceeded",
            "the job ran past the training time limit; use fewer epochs or a smaller training file",
            "n_epochs",
        )
    if type(exc).__name__ == "OutOfMemoryError":  # torch.OutOfMemoryError, without importing torch here
        return Failure(
            "out_of_memory", "the GPU ran out of memory; lower batch_size or max_seq_len and retry", "batch_size"
        )
    if isinstance(exc, ValidationError):
        return Failure("invalid_hyperparameters", f"the job's hyperparameters are invalid: {exc}", "hyperparameters")
    if type(exc).__name__ in _TRANSIENT_NAMES or isinstance(exc, ConnectionError | TimeoutError):
        return Failure("service_unavailable", f"a platform service was unreachable: {exc}", retryable=True)
    log.error("job %s failed unexpectedly", job_id, exc_info=exc)
    return Failure(
        "training_error",
        f"training failed unexpectedly ({type(exc).__name__}: {exc}); the operator's worker log has details "
        f"for job {job_id}",
    )
