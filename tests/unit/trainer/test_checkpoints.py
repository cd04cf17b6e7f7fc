"""Epoch checkpoints: each is a servable adapter with the state to resume from, and a resumed run ends exactly
where an uninterrupted one does."""

from __future__ import annotations

import json
import shutil
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from core.descriptor import ADAPTER_CONFIG, ADAPTER_MANIFEST, ADAPTER_WEIGHTS
from tests.unit.trainer.test_train import request, write_rows
from trainer.checkpoints import resume_layout
from trainer.errors import TrainingCancelled
from trainer.manifest import verify_adapter_dir
from trainer.progress import Checkpoint, Progress
from trainer.train import TrainingRequest, train_adapter

STATE_FILES = {"optimizer.pt", "scheduler.pt", "rng_state.pth", "trainer_state.json"}


class Keeper:
    """Copies each checkpoint away before training deletes its scratch copy, as the worker uploads it."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.kept: list[Checkpoint] = []

    def __call__(self, checkpoint: Checkpoint) -> None:
        dest = self.root / f"step-{checkpoint.step}"
        shutil.copytree(checkpoint.adapter_dir, dest / "adapter")
        shutil.copytree(checkpoint.state_dir, dest / "state")
        self.kept.append(replace(checkpoint, adapter_dir=dest / "adapter", state_dir=dest / "state"))


def train_until_cancelled(request: TrainingRequest, keeper: Keeper, steps: int) -> None:
    """Train with checkpoints into ``keeper`` and stop after ``steps`` steps, as a killed worker would."""
    done: list[int] = []
    with pytest.raises(TrainingCancelled):
        train_adapter(
            request,
            on_progress=lambda p: done.append(p.step),
            should_cancel=lambda: len(done) >= steps,
            on_checkpoint=keeper,
        )


def test_each_epoch_leaves_a_servable_checkpoint_and_the_last_is_the_adapter(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    base = request(tiny_model_dir, tmp_path, "out", n_epochs=4)
    validation = write_rows(tmp_path / "valid.jsonl", 4, seed=1)
    keeper = Keeper(tmp_path / "kept")
    seen: list[Progress] = []
    result = train_adapter(replace(base, validation_file=validation), on_progress=seen.append, on_checkpoint=keeper)

    assert [(c.step, c.epoch) for c in keeper.kept] == [(3, 1), (6, 2), (9, 3), (12, 4)]  # 12 examples, batches of 4
    steps = {p.step: p for p in seen if p.loss is not None}
    evals = [p for p in seen if p.eval_loss is not None]
    for checkpoint, evaluation in zip(keeper.kept, evals, strict=True):
        assert sorted(p.name for p in checkpoint.adapter_dir.iterdir()) == sorted(
            [ADAPTER_CONFIG, ADAPTER_WEIGHTS, ADAPTER_MANIFEST]
        )
        manifest = verify_adapter_dir(checkpoint.adapter_dir)
        assert manifest["steps"] == checkpoint.step
        assert json.loads((checkpoint.adapter_dir / ADAPTER_CONFIG).read_text())["base_model_name_or_path"] == "tiny"
        assert {p.name for p in checkpoint.state_dir.iterdir()} == STATE_FILES
        step = steps[checkpoint.step]
        assert checkpoint.metrics == {
            "step": float(checkpoint.step),
            "train_loss": pytest.approx(step.loss),
            "train_mean_token_accuracy": pytest.approx(step.accuracy),
            "valid_loss": pytest.approx(evaluation.eval_loss),
            "full_valid_loss": pytest.approx(evaluation.eval_loss),
            "valid_mean_token_accuracy": pytest.approx(evaluation.eval_accuracy),
            "full_valid_mean_token_accuracy": pytest.approx(evaluation.eval_accuracy),
        }
    last = keeper.kept[-1].adapter_dir
    assert (last / ADAPTER_WEIGHTS).read_bytes() == (result.output_dir / ADAPTER_WEIGHTS).read_bytes()


def test_a_resumed_run_ends_where_an_uninterrupted_one_does(tiny_model_dir: Path, tmp_path: Path) -> None:
    straight = train_adapter(request(tiny_model_dir, tmp_path, "straight", n_epochs=4, seed=3, lora_dropout=0.1))

    interrupted = request(tiny_model_dir, tmp_path, "resumed", n_epochs=4, seed=3, lora_dropout=0.1)
    keeper = Keeper(tmp_path / "kept")
    train_until_cancelled(interrupted, keeper, steps=7)  # killed in the middle of epoch 3
    assert [c.step for c in keeper.kept] == [3, 6]
    last = keeper.kept[-1]
    resume = resume_layout(last.adapter_dir, last.state_dir, tmp_path / "resume")
    seen: list[Progress] = []
    resumed = train_adapter(replace(interrupted, resume_from=resume), on_progress=seen.append, on_checkpoint=keeper)

    assert [p.step for p in seen if p.loss is not None] == [7, 8, 9, 10, 11, 12]  # the step count continues
    assert [c.step for c in keeper.kept] == [3, 6, 9, 12]
    assert resumed.steps == straight.steps == 12
    assert resumed.train_loss == pytest.approx(straight.train_loss, abs=1e-6)
    a, b = load_file(straight.output_dir / ADAPTER_WEIGHTS), load_file(resumed.output_dir / ADAPTER_WEIGHTS)
    assert a.keys() == b.keys()
    for name in a:
        torch.testing.assert_close(b[name], a[name], rtol=0, atol=1e-5)


def test_early_epochs_checkpoint_at_most_once_per_interval(tiny_model_dir: Path, tmp_path: Path) -> None:
    keeper = Keeper(tmp_path / "kept")
    hourly = replace(request(tiny_model_dir, tmp_path, "out", n_epochs=5), checkpoint_interval_s=3600.0)
    train_adapter(hourly, on_checkpoint=keeper)
    assert [c.epoch for c in keeper.kept] == [3, 4, 5]  # the last three always: those a finished job lists
