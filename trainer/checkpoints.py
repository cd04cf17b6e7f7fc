"""Epoch checkpoints of a training run: a servable adapter, plus the state that resumes training from it.

The transformers ``Trainer`` saves ``checkpoint-{step}`` when an epoch ends (adapter, optimizer, scheduler,
RNG and trainer state). :class:`CheckpointBridge` turns each save into a :class:`Checkpoint`: the adapter is
exported as the final one is (public base name, manifest with sha256s), the rest kept as resume state, and
the caller stores it before training goes on. :func:`resume_layout` puts the two halves back together in the
layout ``Trainer.train(resume_from_checkpoint=...)`` reads, which restores the optimizer, the learning-rate
schedule, the RNG, the data order and the step counter, so a resumed run continues the interrupted one.

Which epochs save: the last ``KEEP_CHECKPOINTS`` always (the ones a finished job lists, as OpenAI keeps its
last three), earlier ones at most once per ``min_interval_s`` of training: with many short epochs, uploading
every one would cost more than the training it protects.
"""

from __future__ import annotations

import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from transformers import TrainerCallback, TrainerControl, TrainerState, TrainingArguments

from core.descriptor import ADAPTER_CONFIG, ADAPTER_WEIGHTS
from trainer.metrics import checkpoint_metrics
from trainer.progress import KEEP_CHECKPOINTS, Checkpoint, CheckpointFn

HF_CHECKPOINT = "checkpoint-{step}"  # transformers' folder name under output_dir
# What resuming reads besides the adapter (rng_state.pth, or rng_state_{rank}.pth per process); the Trainer
# also saves the tokenizer, a model card and its arguments, which the job already has.
STATE_FILES = ("optimizer.pt", "scheduler.pt", "scaler.pt", "trainer_state.json")
RNG_STATE = "rng_state"


ExportFn = Callable[[Any, TrainerState, Path], None]  # writes the model's adapter and manifest into a directory


class CheckpointBridge(TrainerCallback):
    """Decides which epoch ends save, and hands each save to ``on_checkpoint`` as a :class:`Checkpoint`."""

    def __init__(
        self, on_checkpoint: CheckpointFn, export: ExportFn, *, num_epochs: int, min_interval_s: float
    ) -> None:
        self._on_checkpoint = on_checkpoint
        self._export = export
        self._num_epochs = num_epochs
        self._min_interval_s = min_interval_s
        self._last_saved = time.monotonic()

    def on_train_begin(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kw) -> None:
        self._last_saved = time.monotonic()

    def on_epoch_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kw) -> None:
        epoch = round(state.epoch or 0)
        late = epoch > self._num_epochs - KEEP_CHECKPOINTS
        control.should_save = late or time.monotonic() - self._last_saved >= self._min_interval_s

    def on_save(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kw) -> None:
        saved = Path(args.output_dir) / HF_CHECKPOINT.format(step=state.global_step)
        root = Path(args.output_dir) / f"loraplex-{state.global_step}"
        try:
            adapter_dir, state_dir = root / "adapter", root / "state"
            self._export(kw["model"], state, adapter_dir)
            state_dir.mkdir(parents=True)
            for path in saved.iterdir():
                if path.name in STATE_FILES or (path.name.startswith(RNG_STATE) and path.suffix == ".pth"):
                    path.replace(state_dir / path.name)
            metrics = checkpoint_metrics(state.log_history, state.global_step)
            self._on_checkpoint(Checkpoint(state.global_step, round(state.epoch or 0), adapter_dir, state_dir, metrics))
        finally:
            shutil.rmtree(root, ignore_errors=True)
            shutil.rmtree(saved, ignore_errors=True)
        self._last_saved = time.monotonic()


def resume_layout(adapter_dir: Path, state_dir: Path, into: Path) -> Path:
    """One directory in the layout ``Trainer`` resumes from: the adapter's PEFT files and the state files."""
    into.mkdir(parents=True, exist_ok=True)
    for source in (adapter_dir / ADAPTER_CONFIG, adapter_dir / ADAPTER_WEIGHTS, *sorted(state_dir.iterdir())):
        shutil.copyfile(source, into / source.name)
    return into
