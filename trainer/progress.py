"""What the trainer reports while it runs, and the callables a caller passes in for progress and cancellation."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class Progress:
    """One optimizer step (``loss`` set) or one end-of-epoch evaluation (``eval_loss`` set)."""

    step: int
    total_steps: int
    epoch: float
    loss: float | None
    learning_rate: float | None
    tokens: int  # tokens trained on so far, padding excluded
    eta_seconds: float | None
    eval_loss: float | None = None


ProgressFn = Callable[[Progress], None]
CancelFn = Callable[[], bool]  # checked between steps; True stops training
