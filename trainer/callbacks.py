"""The bridge between the transformers ``Trainer`` loop and our progress and cancellation callables."""

from __future__ import annotations

import time

from transformers import TrainerCallback, TrainerControl, TrainerState, TrainingArguments

from trainer.accuracy import EVAL_ACCURACY, TRAIN_ACCURACY
from trainer.errors import TrainingCancelled
from trainer.progress import CancelFn, Progress, ProgressFn


class ProgressBridge(TrainerCallback):
    """Calls ``on_progress`` for every logged step and evaluation; raises ``TrainingCancelled`` between steps."""

    def __init__(self, on_progress: ProgressFn | None, should_cancel: CancelFn | None) -> None:
        self._on_progress = on_progress
        self._should_cancel = should_cancel
        self._started = time.monotonic()
        self._first_step = 0  # the step this run started from: past 0 when resumed from a checkpoint

    def on_train_begin(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kw) -> None:
        self._started = time.monotonic()
        self._first_step = state.global_step

    def on_step_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kw) -> None:
        if self._should_cancel is not None and self._should_cancel():
            raise TrainingCancelled(state.global_step)

    def on_log(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, logs: dict | None = None, **kw
    ) -> None:
        logs = logs or {}
        if "loss" in logs:
            accuracy = logs.get(TRAIN_ACCURACY)
            self._emit(state, loss=float(logs["loss"]), learning_rate=logs.get("learning_rate"), accuracy=accuracy)
        elif "eval_loss" in logs:
            self._emit(state, eval_loss=float(logs["eval_loss"]), eval_accuracy=logs.get(EVAL_ACCURACY))

    def _emit(
        self,
        state: TrainerState,
        *,
        loss: float | None = None,
        learning_rate: float | None = None,
        eval_loss: float | None = None,
        accuracy: float | None = None,
        eval_accuracy: float | None = None,
    ) -> None:
        if self._on_progress is None:
            return
        step, total = state.global_step, state.max_steps
        elapsed = time.monotonic() - self._started
        done = step - self._first_step
        eta = elapsed / done * (total - step) if done > 0 else None
        self._on_progress(
            Progress(
                step=step,
                total_steps=total,
                epoch=float(state.epoch or 0.0),
                loss=loss,
                learning_rate=float(learning_rate) if learning_rate is not None else None,
                tokens=int(state.num_input_tokens_seen or 0),
                eta_seconds=eta,
                eval_loss=eval_loss,
                accuracy=accuracy,
                eval_accuracy=eval_accuracy,
            )
        )
