"""Errors the trainer raises on purpose: bad data (the user can fix it) and cooperative cancellation."""

from __future__ import annotations

from core.dataset_format import DatasetReport
from core.errors import InvalidRequest


class TrainingCancelled(Exception):
    """Raised between steps when the caller's ``should_cancel`` answered True."""

    def __init__(self, step: int) -> None:
        super().__init__(f"training cancelled after step {step}")
        self.step = step


class InvalidTrainingData(InvalidRequest):
    """A training or validation file failed validation; the message lists problems with line numbers."""

    default_code = "invalid_training_file"

    def __init__(self, report: DatasetReport, *, param: str = "training_file") -> None:
        what = param.replace("_", " ")
        super().__init__(report.summary(what=what), code=f"invalid_{param}", param=param)
        self.report = report
