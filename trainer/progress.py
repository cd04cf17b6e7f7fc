"""What the trainer reports while it runs (progress, checkpoints), and the callables a caller passes in for them
and for cancellation."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path


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
    accuracy: float | None = None  # mean token accuracy of the step (with ``loss``)
    eval_accuracy: float | None = None  # of the evaluation (with ``eval_loss``)


ProgressFn = Callable[[Progress], None]
CancelFn = Callable[[], bool]  # checked between steps; True stops training


KEEP_CHECKPOINTS = 3  # a job's newest checkpoints kept, as OpenAI keeps the last three epochs'


@dataclass(frozen=True)
class Checkpoint:
    """The end of one epoch: a servable adapter directory and the state that resumes training from it."""

    step: int
    epoch: int
    adapter_dir: Path  # adapter_config.json, adapter_model.safetensors, manifest.json
    state_dir: Path  # optimizer.pt, scheduler.pt, rng_state.pth, trainer_state.json
    metrics: dict[str, float] = field(default_factory=dict)


CheckpointFn = Callable[[Checkpoint], None]  # stores the checkpoint; training goes on when it returns
