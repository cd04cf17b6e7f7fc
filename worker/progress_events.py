"""Training progress as ``JobEvent`` rows of type ``metrics``, in OpenAI's shape."""

from __future__ import annotations

import logging

from sqlalchemy.engine import Engine

from core.db import session_scope
from core.jobs import record_event
from core.models import FineTuneJob
from trainer.progress import Progress

log = logging.getLogger(__name__)


def metrics_event(progress: Progress) -> tuple[str, dict]:
    """The message and data of one step (``train_loss``) or end-of-epoch evaluation (``valid_loss``)."""
    data: dict = {"step": progress.step, "total_steps": progress.total_steps, "epoch": round(progress.epoch, 4)}
    if progress.eval_loss is not None:
        data["valid_loss"] = progress.eval_loss
        if progress.eval_accuracy is not None:
            data["valid_mean_token_accuracy"] = progress.eval_accuracy
        return f"Epoch {round(progress.epoch)}: validation loss={progress.eval_loss:.4f}", data
    data.update(
        train_loss=progress.loss,
        train_mean_token_accuracy=progress.accuracy,
        learning_rate=progress.learning_rate,
        trained_tokens=progress.tokens,
        eta_seconds=round(progress.eta_seconds, 1) if progress.eta_seconds is not None else None,
    )
    loss = f"{progress.loss:.4f}" if progress.loss is not None else "n/a"
    return f"Step {progress.step}/{progress.total_steps}: training loss={loss}", data


class ProgressRecorder:
    """The trainer's ``on_progress``: one metrics event per step and per evaluation."""

    def __init__(self, engine: Engine, job: FineTuneJob) -> None:
        self.engine = engine
        self.job = job

    def __call__(self, progress: Progress) -> None:
        message, data = metrics_event(progress)
        try:
            with session_scope(self.engine) as session:
                record_event(session, self.job, message, type="metrics", data=data)
        except Exception:
            # Losing one metrics row is better than failing a training run over it.
            log.warning("job %s: could not record progress", self.job.id, exc_info=True)
