"""``loraplex train``: train a LoRA adapter from a JSONL file on a base model (directory or hub id), with a
progress bar."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer

from core.cli import console, settings_or_exit
from core.descriptor import ADAPTER_CONFIG
from core.thread_options import TrainThreads


def register(app: typer.Typer) -> None:
    """Add the ``train`` command to the ``loraplex`` CLI."""

    @app.command("train")
    def train_cmd(
        model: Annotated[
            str, typer.Option(help="Base model: a directory or a Hugging Face hub id org/name[@revision].")
        ],
        data: Annotated[Path, typer.Option(exists=True, dir_okay=False, help="Training JSONL.")],
        out: Annotated[Path, typer.Option(help="Directory to write the adapter into.")],
        validation: Annotated[Path | None, typer.Option(exists=True, dir_okay=False, help="Validation JSONL.")] = None,
        n_epochs: Annotated[int | None, typer.Option("--epochs", help="Passes over the data (default 3).")] = None,
        batch_size: Annotated[int | None, typer.Option(help="Examples per step (default 4).")] = None,
        learning_rate: Annotated[float | None, typer.Option(help="Absolute learning rate (default 2e-4).")] = None,
        lora_r: Annotated[int, typer.Option(help="LoRA rank.")] = 8,
        lora_alpha: Annotated[float | None, typer.Option(help="LoRA alpha (default 2 x rank).")] = None,
        lora_dropout: Annotated[float, typer.Option(help="Dropout on the LoRA input.")] = 0.0,
        target_modules: Annotated[
            str | None, typer.Option(help="Comma-separated projections (default all seven).")
        ] = None,
        max_seq_len: Annotated[int, typer.Option(help="Longest example in tokens.")] = 1024,
        seed: Annotated[int, typer.Option(help="Seed: same seed, data and settings give the same adapter.")] = 0,
        method: Annotated[
            str, typer.Option(help="supervised (chat or prompt/completion data) or dpo (preference pairs).")
        ] = "supervised",
        beta: Annotated[float | None, typer.Option(help="DPO only: distance from the reference (default 0.1).")] = None,
        from_adapter: Annotated[
            Path | None,
            typer.Option(
                exists=True, file_okay=False, help="An adapter directory to continue (its rank, alpha and targets)."
            ),
        ] = None,
        threads: TrainThreads = None,
    ) -> None:
        """Validate the data, train, and write adapter_config.json, adapter_model.safetensors and manifest.json."""
        from pydantic import ValidationError
        from transformers.utils import logging as transformers_logging

        from core.errors import ConfigError
        from core.hyperparameters import DPO, SUPERVISED, Hyperparameters
        from core.model_source import default_model_name, resolve_model_dir
        from trainer.errors import InvalidTrainingData, TrainingCancelled
        from trainer.train import TrainingRequest, train_adapter

        settings = settings_or_exit()
        transformers_logging.disable_progress_bar()  # ours is the only bar on screen
        try:
            model_dir = resolve_model_dir(model, setting="--model")
        except ConfigError as exc:
            console.print(f"[red]error:[/red] {exc.message}")
            raise typer.Exit(2) from None
        if not model_dir.is_dir():
            console.print(f"[red]error:[/red] --model {model} is not a directory")
            raise typer.Exit(2)
        # The family decides the module names (Phi-3 fuses q/k/v and gate/up), so targets are checked against it.
        model_type = _model_type(model_dir)
        if method not in (SUPERVISED, DPO):
            console.print(f"[red]error:[/red] --method must be {SUPERVISED} or {DPO}, not {method!r}")
            raise typer.Exit(2)
        if from_adapter is not None:  # training extends that adapter, so it keeps its shape
            shape = json.loads((from_adapter / ADAPTER_CONFIG).read_text(encoding="utf-8"))
            lora_r, lora_alpha, target_modules = shape["r"], shape["lora_alpha"], ",".join(shape["target_modules"])
        try:
            hyperparameters = Hyperparameters(
                n_epochs=n_epochs if n_epochs is not None else "auto",
                batch_size=batch_size if batch_size is not None else "auto",
                learning_rate=learning_rate,
                lora_r=lora_r,
                lora_alpha=lora_alpha,
                lora_dropout=lora_dropout,
                target_modules=[t.strip() for t in target_modules.split(",")] if target_modules else None,
                max_seq_len=max_seq_len,
                beta=beta,
            ).resolve(max_lora_rank=settings.max_lora_rank, model_type=model_type, method=method)
        except (ValidationError, ValueError) as exc:
            console.print(f"[red]error:[/red] {exc}")
            raise typer.Exit(2) from None
        if out.exists() and any(out.iterdir()):
            console.print(f"[red]error:[/red] {out} is not empty; give a new directory")
            raise typer.Exit(2)
        request = TrainingRequest(
            base_model_dir=model_dir,
            base_model_name=default_model_name(model),
            training_file=data,
            output_dir=out,
            hyperparameters=hyperparameters,
            seed=seed,
            validation_file=validation,
            num_threads=threads,
            method=method,
            parent_adapter_dir=from_adapter,
        )
        try:
            with _ProgressBar() as bar:
                result = train_adapter(request, on_progress=bar.update)
        except InvalidTrainingData as exc:
            console.print(f"[red]error:[/red] {exc.message}")
            raise typer.Exit(2) from None
        except (TrainingCancelled, KeyboardInterrupt):
            console.print("[yellow]cancelled[/yellow]; nothing was written")
            raise typer.Exit(130) from None
        eval_part = f", eval loss {result.eval_loss:.4f}" if result.eval_loss is not None else ""
        console.print(
            f"wrote {result.output_dir}: {result.steps} steps, {result.trained_tokens} trained tokens, "
            f"train loss {result.train_loss:.4f}{eval_part}, {result.seconds:.1f}s"
        )


def _model_type(model_dir: Path) -> str | None:
    """The checkpoint's ``model_type``; None when config.json is missing or unreadable (training then says why)."""
    try:
        return json.loads((model_dir / "config.json").read_text(encoding="utf-8")).get("model_type")
    except (OSError, ValueError, AttributeError):
        return None


class _ProgressBar:
    """A rich progress bar fed by the trainer's progress callback."""

    def __enter__(self) -> _ProgressBar:
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

        self._progress = Progress(
            TextColumn("[bold]training"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("epoch {task.fields[epoch]:.2f}  loss {task.fields[loss]}  {task.fields[tokens]} tokens"),
            TimeRemainingColumn(),
            console=console,
        )
        self._progress.start()
        self._task = self._progress.add_task("train", total=None, epoch=0.0, loss="-", tokens=0)
        return self

    def update(self, progress) -> None:  # type: ignore[no-untyped-def]
        fields = {"epoch": progress.epoch, "tokens": progress.tokens}
        if progress.loss is not None:
            fields["loss"] = f"{progress.loss:.4f}"
        if progress.eval_loss is not None:
            self._progress.console.print(f"epoch {progress.epoch:.0f}: eval loss {progress.eval_loss:.4f}")
        self._progress.update(self._task, completed=progress.step, total=progress.total_steps, **fields)

    def __exit__(self, *exc: object) -> None:
        self._progress.stop()
