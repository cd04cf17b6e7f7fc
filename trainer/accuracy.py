"""Mean token accuracy beside the loss: the share of supervised tokens whose argmax prediction is the label.

OpenAI reports it per step (``train_mean_token_accuracy``) and per evaluation (``valid_mean_token_accuracy``);
the transformers ``Trainer`` logs losses only. :class:`AccuracyTrainer` counts correct and supervised tokens
from the logits the forward pass already made (no extra pass, no gradient) over the steps a logged loss covers,
and adds their ratio to that log entry: ``mean_token_accuracy`` beside ``loss``, ``eval_mean_token_accuracy``
beside ``eval_loss``. Positions are shifted as the causal loss shifts them. The counts stay on the device until
a log reads them, so a GPU step does not wait on them.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers import Trainer

from trainer.tokenize import IGNORE_INDEX

TRAIN_ACCURACY, EVAL_ACCURACY = "mean_token_accuracy", "eval_mean_token_accuracy"


class AccuracyTrainer(Trainer):
    """A ``Trainer`` whose logs carry the mean token accuracy of the steps (or the evaluation) they cover."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._counts: dict[bool, list[torch.Tensor | int]] = {True: [0, 0], False: [0, 0]}  # training -> counts

    def compute_loss(  # type: ignore[override]
        self, model: Any, inputs: dict[str, Any], return_outputs: bool = False, num_items_in_batch: Any = None
    ) -> Any:
        loss, outputs = super().compute_loss(model, inputs, return_outputs=True, num_items_in_batch=num_items_in_batch)
        labels, logits = inputs.get("labels"), getattr(outputs, "logits", None)
        if labels is not None and logits is not None:
            with torch.no_grad():
                target = labels[:, 1:]
                supervised = target != IGNORE_INDEX
                correct = (logits[:, :-1].argmax(-1) == target) & supervised
                counts = self._counts[model.training]
                counts[0] = counts[0] + correct.sum()
                counts[1] = counts[1] + supervised.sum()
        return (loss, outputs) if return_outputs else loss

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        for training, key, beside in ((True, TRAIN_ACCURACY, "loss"), (False, EVAL_ACCURACY, "eval_loss")):
            correct, supervised = (int(c) for c in self._counts[training])
            if beside in logs and supervised:
                logs[key] = correct / supervised
                self._counts[training] = [0, 0]
        super().log(logs, start_time)
