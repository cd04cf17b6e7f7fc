"""Direct preference optimisation (DPO) of a LoRA adapter, with TRL's ``DPOTrainer``.

The policy is the adapter being trained; the reference is the same adapter as the job started: TRL keeps a
frozen copy of it (``ref``), which for a new adapter is the base model itself (LoRA's B matrices start at
zero), and for a job that continues a fine-tuned model is that model. DPO only moves probability between
the two answers of each pair, so it sharpens a model that can already produce both (a base model that
follows instructions, or a supervised fine-tune): run on a random model it widens the margin without
teaching it to say either answer.

Pairs arrive tokenized by ``trainer.tokenize.tokenize_preference``, the same rendering supervised training
and chat completions use; TRL's own tokenization (which would apply the chat template again, its way) is
skipped. TRL logs the loss, ``mean_token_accuracy`` of the preferred answers and ``rewards/*``, which
``trainer.metrics`` names as OpenAI does.
"""

from __future__ import annotations

from typing import Any

from trainer.tokenize import TokenizedPair


def _rows(pairs: list[TokenizedPair]) -> Any:
    from datasets import Dataset

    return Dataset.from_list(
        [{"prompt_ids": p.prompt_ids, "chosen_ids": p.chosen_ids, "rejected_ids": p.rejected_ids} for p in pairs]
    )


def preference_trainer(
    model: Any,
    tokenizer: Any,
    arguments: dict[str, Any],
    *,
    beta: float,
    train: list[TokenizedPair],
    valid: list[TokenizedPair] | None,
    callbacks: list[Any],
) -> Any:
    """A ``DPOTrainer`` over ``model`` (a PEFT model: the adapter to train) with the run's ``arguments`` (those
    of ``transformers.TrainingArguments``), the sigmoid loss and ``beta``."""
    from trl import DPOConfig, DPOTrainer

    class PreferenceTrainer(DPOTrainer):
        def _prepare_dataset(self, dataset: Any, processing_class: Any, args: Any, dataset_name: str) -> Any:
            return dataset  # already tokenized, as chat completions render the prompt

    config = DPOConfig(
        **arguments,
        beta=beta,
        loss_type=["sigmoid"],
        max_length=None,  # every pair fits max_seq_len (trainer.dataset refuses longer ones): nothing to cut
        gradient_checkpointing=False,  # TRL turns it on by default; LoRA on our sizes has the memory
        precompute_ref_log_probs=False,
    )
    return PreferenceTrainer(
        model=model,
        args=config,
        train_dataset=_rows(train),
        eval_dataset=_rows(valid) if valid is not None else None,
        processing_class=tokenizer,
        callbacks=callbacks,
    )
