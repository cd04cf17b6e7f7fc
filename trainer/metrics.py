"""The Trainer's log in OpenAI's metric names: per checkpoint, and per step (a job's result file).

A resumed run's log carries the entries from before the interruption (they are in its checkpoint's
``trainer_state.json``), so both cover the whole job whether or not it was interrupted. Accuracies are
``trainer.accuracy``'s; the validation loss is over the whole validation file, so ``valid_*`` and
``full_valid_*`` are the same numbers. DPO runs (``trainer.preference``) add TRL's implicit-reward statistics:
the mean margin between the preferred and the other answer's reward, and the share of pairs it orders right.
"""

from __future__ import annotations

import csv
import io
from typing import Any

from trainer.accuracy import EVAL_ACCURACY, TRAIN_ACCURACY

STEP_METRICS_FILE = "step_metrics.csv"  # OpenAI's result file name
STEP_COLUMNS = ("step", "train_loss", "train_mean_token_accuracy", "valid_loss", "valid_mean_token_accuracy")
# TRL's DPO log keys (eval_ ones for the validation file) and ours.
PREFERENCE_NAMES = {"rewards/margins": "reward_margin", "rewards/accuracies": "reward_accuracy"}
PREFERENCE_COLUMNS = tuple(f"{split}_{name}" for split in ("train", "valid") for name in PREFERENCE_NAMES.values())


def _openai_names(entry: dict[str, Any]) -> dict[str, float]:
    named: dict[str, float] = {}
    if "loss" in entry:
        named["train_loss"] = float(entry["loss"])
        if TRAIN_ACCURACY in entry:
            named["train_mean_token_accuracy"] = float(entry[TRAIN_ACCURACY])
    if "eval_loss" in entry:
        named["valid_loss"] = named["full_valid_loss"] = float(entry["eval_loss"])
        if EVAL_ACCURACY in entry:
            accuracy = float(entry[EVAL_ACCURACY])
            named["valid_mean_token_accuracy"] = named["full_valid_mean_token_accuracy"] = accuracy
    for key, name in PREFERENCE_NAMES.items():
        if key in entry and "loss" in entry:
            named[f"train_{name}"] = float(entry[key])
        if f"eval_{key}" in entry:
            named[f"valid_{name}"] = float(entry[f"eval_{key}"])
    return named


def checkpoint_metrics(log_history: list[dict[str, Any]], step: int) -> dict[str, float]:
    """A checkpoint's ``metrics``: the step's training loss and accuracy, and the epoch's validation ones when
    the job has a validation file."""
    metrics: dict[str, float] = {"step": float(step)}
    for entry in log_history:
        if entry.get("step") == step:
            metrics.update(_openai_names(entry))
    return metrics


def step_metrics_csv(log_history: list[dict[str, Any]]) -> str:
    """One row per step: its training loss and accuracy, and at epoch ends the validation ones (empty cells
    where there are none); for DPO, the reward margin and accuracy of each too."""
    preference = any("rewards/margins" in entry for entry in log_history)
    columns = STEP_COLUMNS + PREFERENCE_COLUMNS if preference else STEP_COLUMNS
    rows: dict[int, dict[str, Any]] = {}
    for entry in log_history:
        named = _openai_names(entry)
        if named and entry.get("step") is not None:
            row = rows.setdefault(int(entry["step"]), {"step": int(entry["step"])})
            row.update({k: v for k, v in named.items() if k in columns})
    out = io.StringIO()
    writer = csv.DictWriter(out, fieldnames=columns, lineterminator="\n")
    writer.writeheader()
    writer.writerows(rows[step] for step in sorted(rows))
    return out.getvalue()
