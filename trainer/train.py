"""Train a LoRA adapter with PEFT and the transformers ``Trainer``, and export it with its manifest.

The data is validated in full before the model is loaded, so a bad file fails in seconds. CUDA with
bf16 autocast when a GPU is present, fp32 on CPU. Same seed, data and hyperparameters give the same
adapter on CPU, whether the run went straight through or resumed from one of its checkpoints
(``trainer.checkpoints``).
"""

from __future__ import annotations

import gc
import logging
import math
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from core.base_fingerprint import BaseFingerprint, fingerprint_base
from core.dataset_format import DEFAULT_MIN_EXAMPLES, DatasetProblem, DatasetReport, method_format_problem
from core.descriptor import ADAPTER_WEIGHTS
from core.hyperparameters import DEFAULT_BETA, DPO, SUPERVISED, ResolvedHyperparameters
from core.projections import adapter_modules
from trainer.callbacks import ProgressBridge
from trainer.checkpoints import CheckpointBridge, CheckpointFn
from trainer.dataset import PreparedDataset, prepare_dataset
from trainer.errors import InvalidTrainingData, TrainingCancelled
from trainer.manifest import stamp_origin, write_manifest
from trainer.metrics import step_metrics_csv
from trainer.progress import CancelFn, ProgressFn
from trainer.tokenize import IGNORE_INDEX

log = logging.getLogger(__name__)
PEFT_MODEL_CARD = "README.md"  # PEFT writes one; an adapter directory holds only what servers load
# Examples per forward pass. A larger batch accumulates gradients over passes of this size (the Trainer
# normalises the loss over the whole batch's tokens): "auto" goes up to 256 examples, whose logits alone would
# not fit in a GPU for a model with a large vocabulary.
MAX_MICRO_BATCH = 16


def micro_batches(batch_size: int) -> tuple[int, int]:
    """(examples per pass, passes per step) for ``batch_size``: the largest pass of at most ``MAX_MICRO_BATCH``
    that divides it, so every step sees exactly ``batch_size`` examples."""
    per_pass = max(d for d in range(1, min(batch_size, MAX_MICRO_BATCH) + 1) if batch_size % d == 0)
    return per_pass, batch_size // per_pass


@dataclass(frozen=True)
class TrainingRequest:
    """Everything one training run needs; paths are local."""

    base_model_dir: Path
    training_file: Path
    output_dir: Path
    hyperparameters: ResolvedHyperparameters
    seed: int = 0
    validation_file: Path | None = None
    base_model_name: str | None = None  # recorded in the adapter; default: the directory's name
    base_fingerprint: BaseFingerprint | None = None  # pass one to skip fingerprinting the base again
    min_examples: int = DEFAULT_MIN_EXAMPLES
    num_threads: int | None = None  # CPU threads for torch (its share of a shared machine); None: torch's default
    resume_from: Path | None = None  # a checkpoint in the Trainer's layout (trainer.checkpoints.resume_layout)
    checkpoint_interval_s: float = 0.0  # epochs before the last few save at most this often (0: every epoch)
    method: str = SUPERVISED  # or DPO, on a file of preference pairs (trainer.preference)
    parent_adapter_dir: Path | None = None  # a fine-tuned model to continue: training starts from its adapter


@dataclass(frozen=True)
class TrainingResult:
    output_dir: Path
    manifest: dict[str, Any]
    trained_tokens: int
    train_loss: float
    eval_loss: float | None
    steps: int
    seconds: float
    step_metrics_csv: str = ""  # trainer.metrics.step_metrics_csv: the job's result file


def load_tokenizer(model_dir: str | Path):  # type: ignore[no-untyped-def]
    """The base model's tokenizer, with a pad token (EOS when it has none) for batching."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def check_method_format(method: str, data_format: str, param: str = "training_file") -> None:
    """``InvalidTrainingData`` saying what to change when the file's format does not train with ``method``."""
    problem = method_format_problem(method, data_format)
    if problem is not None:
        raise InvalidTrainingData(DatasetReport(data_format, problems=[DatasetProblem(0, problem)]), param=param)


def prepare_data(request: TrainingRequest, tokenizer) -> tuple[PreparedDataset, PreparedDataset | None]:  # type: ignore[no-untyped-def]
    """Validate and tokenize the training (and validation) file; raises ``InvalidTrainingData``."""
    max_len = request.hyperparameters.max_seq_len
    train = prepare_dataset(request.training_file, tokenizer, max_seq_len=max_len, min_examples=request.min_examples)
    check_method_format(request.method, train.format)
    valid = None
    if request.validation_file is not None:
        param = "validation_file"
        valid = prepare_dataset(request.validation_file, tokenizer, max_seq_len=max_len, min_examples=1, param=param)
        check_method_format(request.method, valid.format, param)
    return train, valid


def _lora_model(request: TrainingRequest, dtype):  # type: ignore[no-untyped-def]
    from peft import LoraConfig, PeftModel, get_peft_model
    from transformers import AutoModelForCausalLM

    hp = request.hyperparameters
    model = AutoModelForCausalLM.from_pretrained(str(request.base_model_dir), dtype=dtype, use_safetensors=True)
    if request.parent_adapter_dir is not None:
        # Its rank, alpha and targets are the job's (the API resolved them from it); dropout is this job's.
        model = PeftModel.from_pretrained(model, str(request.parent_adapter_dir), is_trainable=True)
        _set_lora_dropout(model, hp.lora_dropout)
        return model
    alpha = int(hp.lora_alpha) if float(hp.lora_alpha).is_integer() else hp.lora_alpha
    config = LoraConfig(
        r=hp.lora_r,
        lora_alpha=alpha,
        lora_dropout=hp.lora_dropout,
        target_modules=list(target_modules(model.config.model_type, hp)),
        bias="none",
        task_type="CAUSAL_LM",
    )
    return get_peft_model(model, config)


def _set_lora_dropout(model, p: float) -> None:  # type: ignore[no-untyped-def]
    """Give a loaded adapter this job's dropout: PEFT builds each layer's dropout from the saved config."""
    import torch
    from peft.tuners.lora import LoraLayer

    for module in model.modules():
        if isinstance(module, LoraLayer) and "default" in module.lora_dropout:
            module.lora_dropout["default"] = torch.nn.Dropout(p) if p > 0 else torch.nn.Identity()
    model.peft_config["default"].lora_dropout = p


def target_modules(model_type: str, hp: ResolvedHyperparameters) -> tuple[str, ...]:
    """The base model's modules for ``hp.target_modules``: the seven projections are Phi-3's four fused modules."""
    return adapter_modules(model_type).targets(hp.target_modules)


def _as_rows(data: PreparedDataset) -> list[dict[str, list[int]]]:
    return [{"input_ids": e.input_ids, "attention_mask": [1] * e.num_tokens, "labels": e.labels} for e in data.examples]


def _trainer(  # type: ignore[no-untyped-def]
    request: TrainingRequest,
    model,
    tokenizer,
    arguments: dict[str, Any],
    train_data: PreparedDataset,
    valid_data: PreparedDataset | None,
    callbacks: list[Any],
):
    """The Trainer for the job's method: supervised (``AccuracyTrainer``) or DPO (``trainer.preference``)."""
    from transformers import DataCollatorForSeq2Seq, PrinterCallback, TrainingArguments

    from trainer.accuracy import AccuracyTrainer
    from trainer.preference import preference_trainer

    if request.method == DPO:
        beta = request.hyperparameters.beta or DEFAULT_BETA
        valid = valid_data.examples if valid_data is not None else None
        trainer = preference_trainer(
            model, tokenizer, arguments, beta=beta, train=train_data.examples, valid=valid, callbacks=callbacks
        )
    else:
        trainer = AccuracyTrainer(
            model=model,
            args=TrainingArguments(**arguments),
            train_dataset=_as_rows(train_data),
            eval_dataset=_as_rows(valid_data) if valid_data is not None else None,
            data_collator=DataCollatorForSeq2Seq(tokenizer, padding=True, label_pad_token_id=IGNORE_INDEX),
            callbacks=callbacks,
        )
    trainer.remove_callback(PrinterCallback)  # progress goes to on_progress, not stdout
    return trainer


def train_adapter(
    request: TrainingRequest,
    *,
    on_progress: ProgressFn | None = None,
    should_cancel: CancelFn | None = None,
    on_checkpoint: CheckpointFn | None = None,
) -> TrainingResult:
    """Validate the data, train, and write ``adapter_config.json``, ``adapter_model.safetensors`` and
    ``manifest.json`` into ``request.output_dir``; with ``on_checkpoint``, also hand it a checkpoint at epoch
    ends (see ``trainer.checkpoints``). Raises ``InvalidTrainingData`` or ``TrainingCancelled``."""
    import torch
    from transformers import set_seed

    started = time.monotonic()
    hp = request.hyperparameters
    tokenizer = load_tokenizer(request.base_model_dir)
    train_data, valid_data = prepare_data(request, tokenizer)
    if should_cancel is not None and should_cancel():
        raise TrainingCancelled(0)
    base = request.base_fingerprint or fingerprint_base(request.base_model_dir, request.base_model_name)

    cuda = torch.cuda.is_available()
    if request.num_threads is not None:
        torch.set_num_threads(request.num_threads)  # process-wide: this pool process trains one job at a time
    set_seed(request.seed)  # before the LoRA matrices are initialised
    model = _lora_model(request, torch.bfloat16 if cuda else torch.float32)
    bridge = ProgressBridge(on_progress, should_cancel)
    callbacks: list[Any] = [bridge]
    if on_checkpoint is not None:

        def export(live_model, state, out: Path) -> None:  # type: ignore[no-untyped-def]
            epochs = round(state.epoch or 0)
            _write_adapter(request, live_model, base, train_data, state.log_history, state.global_step, epochs, out)

        interval = request.checkpoint_interval_s
        callbacks.append(CheckpointBridge(on_checkpoint, export, num_epochs=hp.n_epochs, min_interval_s=interval))
    trainer = None
    per_pass, passes = micro_batches(hp.batch_size)
    try:
        with tempfile.TemporaryDirectory(prefix="loraplex-train-") as scratch:
            arguments = dict(
                output_dir=scratch,
                num_train_epochs=hp.n_epochs,
                per_device_train_batch_size=per_pass,
                gradient_accumulation_steps=passes,
                per_device_eval_batch_size=per_pass,
                learning_rate=hp.learning_rate,
                lr_scheduler_type="linear",
                weight_decay=0.0,
                max_grad_norm=1.0,
                logging_strategy="steps",
                logging_steps=1,
                eval_strategy="epoch" if valid_data is not None else "no",
                save_strategy="epoch" if on_checkpoint is not None else "no",
                report_to=[],
                seed=request.seed,
                data_seed=request.seed,
                bf16=cuda,
                use_cpu=not cuda,
                dataloader_num_workers=0,
                remove_unused_columns=False,
                include_num_input_tokens_seen="non_padding",
                disable_tqdm=True,
            )
            trainer = _trainer(request, model, tokenizer, arguments, train_data, valid_data, callbacks)
            resume = str(request.resume_from) if request.resume_from is not None else None
            trainer.train(resume_from_checkpoint=resume)
            state = trainer.state
        out = Path(request.output_dir)
        manifest = _write_adapter(
            request, model, base, train_data, state.log_history, state.global_step, hp.n_epochs, out, started
        )
        return TrainingResult(
            out,
            manifest,
            manifest["trained_tokens"],
            manifest["train_loss"],
            manifest["eval_loss"],
            state.global_step,
            time.monotonic() - started,
            step_metrics_csv(state.log_history),
        )
    finally:
        # An exception's traceback keeps this frame alive; drop the weights now, not when it is handled.
        model = trainer = None
        gc.collect()
        if cuda:
            torch.cuda.empty_cache()


def _write_adapter(
    request: TrainingRequest,
    model,  # type: ignore[no-untyped-def]
    base: BaseFingerprint,
    train_data: PreparedDataset,
    log_history: list[dict[str, Any]],
    steps: int,
    epochs: int,
    out: Path,
    started: float | None = None,
) -> dict[str, Any]:
    """Write the adapter as trained so far (``steps`` steps, ``epochs`` epochs) with its manifest into ``out``.
    Losses come from the Trainer's log, which a resumed run carries over from before the interruption."""
    hp = request.hyperparameters
    out.mkdir(parents=True, exist_ok=True)
    # The adapter names its base by public name, never by this machine's path; the live model keeps its path,
    # which the Trainer's own checkpoint saves read (a name that is no local directory makes PEFT look it up on
    # a model hub).
    config = model.peft_config["default"]
    local_path = config.base_model_name_or_path
    config.base_model_name_or_path = base.name
    # PEFT keeps targets as a set, whose order varies per process; a sorted list keeps the file's bytes stable.
    targets = list(target_modules(model.config.model_type, hp))
    config.target_modules = sorted(config.target_modules)
    try:
        # We never target embeddings; saying so also stops PEFT looking the base name up on a model hub.
        # Only the trained adapter: DPO keeps a frozen reference copy beside it (trainer.preference).
        model.save_pretrained(
            str(out), safe_serialization=True, save_embedding_layers=False, selected_adapters=["default"]
        )
    finally:
        config.base_model_name_or_path = local_path
    (out / PEFT_MODEL_CARD).unlink(missing_ok=True)
    stamp_origin(out / ADAPTER_WEIGHTS, base)
    steps_per_epoch = math.ceil(len(train_data.examples) / hp.batch_size)
    last_epoch = [float(e["loss"]) for e in log_history if "loss" in e][-steps_per_epoch:]
    evals = [float(e["eval_loss"]) for e in log_history if "eval_loss" in e]
    return write_manifest(
        out,
        base=base,
        rank=hp.lora_r,
        alpha=hp.lora_alpha,
        target_modules=targets,
        hyperparameters=hp.model_dump(),
        seed=request.seed,
        data_format=train_data.format,
        num_examples=len(train_data.examples),
        trained_tokens=train_data.num_tokens * epochs,
        train_loss=sum(last_epoch) / len(last_epoch) if last_epoch else float("nan"),
        eval_loss=evals[-1] if evals else None,
        steps=steps,
        seconds=round(time.monotonic() - started, 3) if started is not None else None,
    )
