"""Training on the tiny model: reproducible, reports progress, stops when asked, exports safetensors only."""

from __future__ import annotations

import csv
import io
import json
import random
from pathlib import Path

import pytest
import torch
import typer
from safetensors.torch import load_file
from typer.testing import CliRunner

from core.base_fingerprint import AdapterOrigin, fingerprint_base, read_adapter_origin
from core.descriptor import ADAPTER_CONFIG, ADAPTER_MANIFEST, ADAPTER_WEIGHTS
from core.hyperparameters import Hyperparameters
from core.tiny_model import BYTE_OFFSET, FAMILIES, TinyModelSpec, make_tiny_model
from tests.integration.training.jobs import jsonl, tool_call_rows
from trainer.cli import register
from trainer.errors import TrainingCancelled
from trainer.manifest import verify_adapter_dir
from trainer.progress import Progress
from trainer.tokenize import IGNORE_INDEX, tokenize_prompt_completion
from trainer.train import TrainingRequest, train_adapter


def write_rows(path: Path, n: int, seed: int = 0) -> Path:
    rng = random.Random(seed)
    rows = [{"prompt": f"Item {i}:", "completion": f" {rng.randrange(10**6)}"} for i in range(n)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def request(model: Path, tmp_path: Path, name: str, *, seed: int = 0, **hp: object) -> TrainingRequest:
    hyperparameters = Hyperparameters(**{"n_epochs": 2, "batch_size": 4, "learning_rate": 1e-2, **hp})
    return TrainingRequest(
        base_model_dir=model,
        training_file=write_rows(tmp_path / "train.jsonl", 12),
        output_dir=tmp_path / name,
        hyperparameters=hyperparameters.resolve(max_lora_rank=64),
        seed=seed,
        base_model_name="tiny",
    )


def test_the_same_seed_gives_the_same_adapter_bytes(tiny_model_dir: Path, tmp_path: Path) -> None:
    first = train_adapter(request(tiny_model_dir, tmp_path, "a", seed=5))
    again = train_adapter(request(tiny_model_dir, tmp_path, "b", seed=5))
    other = train_adapter(request(tiny_model_dir, tmp_path, "c", seed=6))

    for name in (ADAPTER_WEIGHTS, ADAPTER_CONFIG):
        assert (first.output_dir / name).read_bytes() == (again.output_dir / name).read_bytes()
    assert (first.output_dir / ADAPTER_WEIGHTS).read_bytes() != (other.output_dir / ADAPTER_WEIGHTS).read_bytes()
    assert first.train_loss == again.train_loss


def test_progress_is_reported_every_step_with_eval_loss_every_epoch(tiny_model_dir: Path, tmp_path: Path) -> None:
    base = request(tiny_model_dir, tmp_path, "out", n_epochs=3, target_modules=["q_proj", "v_proj"], lora_r=4)
    validation = write_rows(tmp_path / "valid.jsonl", 4, seed=1)
    seen: list[Progress] = []
    result = train_adapter(TrainingRequest(**{**base.__dict__, "validation_file": validation}), on_progress=seen.append)

    steps = [p for p in seen if p.loss is not None]
    evals = [p for p in seen if p.eval_loss is not None]
    assert [p.step for p in steps] == list(range(1, 10)) and result.steps == 9  # 12 examples / 4 x 3 epochs
    assert all(p.total_steps == 9 and p.learning_rate is not None for p in steps)
    assert [p.tokens for p in steps] == sorted(p.tokens for p in steps)
    assert steps[-1].tokens == result.trained_tokens and steps[-1].eta_seconds == 0
    assert [round(p.epoch) for p in evals] == [1, 2, 3] and result.eval_loss == evals[-1].eval_loss

    out = result.output_dir
    assert sorted(p.name for p in out.iterdir()) == sorted([ADAPTER_CONFIG, ADAPTER_WEIGHTS, ADAPTER_MANIFEST])
    manifest = verify_adapter_dir(out)
    config = json.loads((out / ADAPTER_CONFIG).read_text())
    assert config["base_model_name_or_path"] == "tiny"
    assert (config["r"], config["lora_alpha"], config["target_modules"]) == (4, 8, ["q_proj", "v_proj"])
    fingerprint = fingerprint_base(tiny_model_dir, "tiny")
    assert manifest["base_model"] == {"name": "tiny", "fingerprint": fingerprint.digest}
    assert read_adapter_origin(out / ADAPTER_WEIGHTS) == AdapterOrigin("tiny", fingerprint.digest)
    assert (manifest["rank"], manifest["alpha"], manifest["target_modules"]) == (4, 8.0, ["q_proj", "v_proj"])
    assert manifest["trained_tokens"] == result.trained_tokens
    assert manifest["eval_loss"] == result.eval_loss and manifest["train_loss"] == result.train_loss


def test_the_result_file_has_every_step_and_the_accuracy_the_adapter_really_has(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    base = request(tiny_model_dir, tmp_path, "out", n_epochs=3, lora_r=4)
    validation = write_rows(tmp_path / "valid.jsonl", 4, seed=1)
    seen: list[Progress] = []
    result = train_adapter(TrainingRequest(**{**base.__dict__, "validation_file": validation}), on_progress=seen.append)

    rows = list(csv.DictReader(io.StringIO(result.step_metrics_csv)))
    assert list(rows[0]) == [
        "step",
        "train_loss",
        "train_mean_token_accuracy",
        "valid_loss",
        "valid_mean_token_accuracy",
    ]
    assert [int(r["step"]) for r in rows] == list(range(1, 10))
    steps = [p for p in seen if p.loss is not None]
    assert [float(r["train_loss"]) for r in rows] == pytest.approx([p.loss for p in steps])
    assert [float(r["train_mean_token_accuracy"]) for r in rows] == pytest.approx([p.accuracy for p in steps])
    assert all(0.0 <= p.accuracy <= 1.0 for p in steps)  # type: ignore[operator]
    assert [r["step"] for r in rows if r["valid_loss"]] == ["3", "6", "9"]  # epoch ends

    # The last evaluation ran on the final weights: its accuracy is what the saved adapter scores.
    last = float(rows[-1]["valid_mean_token_accuracy"])
    assert last == pytest.approx(token_accuracy(tiny_model_dir, result.output_dir, validation), abs=1e-12)


def token_accuracy(model_dir: Path, adapter_dir: Path, data: Path) -> float:
    """Share of completion tokens that base + adapter (PEFT) predict exactly, teacher-forced."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from trainer.train import load_tokenizer

    tokenizer = load_tokenizer(model_dir)
    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(model_dir), adapter_dir).eval()
    correct = total = 0
    for line in data.read_text().splitlines():
        row = json.loads(line)
        example = tokenize_prompt_completion(tokenizer, row["prompt"], row["completion"])
        with torch.no_grad():
            logits = model(torch.tensor([example.input_ids])).logits[0]
        for position, label in enumerate(example.labels[1:]):
            if label != IGNORE_INDEX:
                correct += int(logits[position].argmax()) == label
                total += 1
    return correct / total


def test_a_large_batch_accumulates_passes_and_trains_what_one_pass_would(
    tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import trainer.train

    assert trainer.train.micro_batches(32) == (16, 2) and trainer.train.micro_batches(20) == (10, 2)
    assert trainer.train.micro_batches(17) == (1, 17) and trainer.train.micro_batches(4) == (4, 1)
    big = request(tiny_model_dir, tmp_path, "passes", n_epochs=2, batch_size=12)
    big = TrainingRequest(**{**big.__dict__, "training_file": write_rows(tmp_path / "more.jsonl", 36)})
    monkeypatch.setattr(trainer.train, "MAX_MICRO_BATCH", 4)  # 3 passes of 4 per step
    accumulated = train_adapter(big)
    monkeypatch.setattr(trainer.train, "MAX_MICRO_BATCH", 64)  # one pass of 12
    whole = train_adapter(TrainingRequest(**{**big.__dict__, "output_dir": tmp_path / "whole"}))

    assert accumulated.steps == whole.steps == 6  # 36 examples in batches of 12, 2 epochs
    a, b = load_file(accumulated.output_dir / ADAPTER_WEIGHTS), load_file(whole.output_dir / ADAPTER_WEIGHTS)
    for name in a:
        torch.testing.assert_close(a[name], b[name], rtol=1e-4, atol=1e-5)


def test_training_stops_between_steps_when_cancelled(tiny_model_dir: Path, tmp_path: Path) -> None:
    checks = []

    def should_cancel() -> bool:
        checks.append(True)
        return len(checks) > 3  # once before training, then after steps 1, 2 and 3

    req = request(tiny_model_dir, tmp_path, "out", n_epochs=50)
    with pytest.raises(TrainingCancelled) as caught:
        train_adapter(req, should_cancel=should_cancel)

    assert caught.value.step == 3
    assert not req.output_dir.exists()


def test_the_train_command_writes_an_adapter_and_names_bad_lines(tiny_model_dir: Path, tmp_path: Path) -> None:
    app = typer.Typer()
    register(app)
    app.command("noop")(lambda: None)  # a second command keeps typer from collapsing the group
    data = write_rows(tmp_path / "train.jsonl", 12)
    args = ["train", "--model", str(tiny_model_dir), "--data", str(data), "--epochs", "1", "--lora-r", "2"]

    done = CliRunner().invoke(app, [*args, "--out", str(tmp_path / "adapter")])
    assert done.exit_code == 0, done.output
    assert "3 steps" in " ".join(done.output.split())  # rich wraps lines
    verify_adapter_dir(tmp_path / "adapter")

    data.write_text(data.read_text().replace('"prompt": "Item 4:"', '"prompt": ""'))
    bad = CliRunner().invoke(app, [*args, "--out", str(tmp_path / "other")])
    assert bad.exit_code == 2
    assert "line 5: 'prompt' must be a non-empty string" in " ".join(bad.output.split())


def write_tool_rows(path: Path, n: int) -> Path:
    path.write_bytes(jsonl(tool_call_rows(n)))
    return path


def test_an_adapter_trains_on_tool_calls(tiny_model_dir: Path, tmp_path: Path) -> None:
    base = request(tiny_model_dir, tmp_path, "tools", n_epochs=3, lora_r=4)
    data = write_tool_rows(tmp_path / "tools.jsonl", 12)
    seen: list[Progress] = []

    result = train_adapter(TrainingRequest(**{**base.__dict__, "training_file": data}), on_progress=seen.append)

    losses = [p.loss for p in seen if p.loss is not None]
    assert result.steps == 9 and len(losses) == 9
    assert losses[-1] < losses[0]  # it learns the calls and answers
    verify_adapter_dir(result.output_dir)


@pytest.mark.parametrize("family", FAMILIES)
def test_an_adapter_of_each_family_trains_fits_and_serves_as_peft_does(tmp_path: Path, family: str) -> None:
    """A few steps on the family's tiny model; the adapter fits its base, and the engine's greedy tokens with it
    equal PEFT's."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from core.adapter_format import inspect_adapter
    from core.model_sizes import ModelSizes
    from core.projections import PROJECTIONS
    from server.engine import SamplingParams
    from server.offline import LLM

    base = make_tiny_model(tmp_path / family, TinyModelSpec(family=family, hidden=64, layers=1))
    result = train_adapter(request(base, tmp_path, "out", n_epochs=1, lora_r=4))
    assert result.steps == 3  # 12 examples / 4
    shapes = ModelSizes.from_hf_config(json.loads((base / "config.json").read_text())).base_shapes()
    spec = inspect_adapter(result.output_dir, shapes, max_rank=64)
    assert {p for m in spec.modules for p in shapes.modules.get(m.projection).projections} == set(PROJECTIONS)

    prompt = [b + BYTE_OFFSET for b in b"Item 3: and Item 4: and more"]  # longer than the 16-token windows
    llm = LLM(base, pool_bytes=4 << 20, max_lora_rank=8)
    llm.load_adapter(family, result.output_dir)
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    (ours,) = llm.generate([(prompt, family, params)])
    peft = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32), result.output_dir)
    with torch.inference_mode():
        ids = torch.tensor([prompt])
        expected = peft.eval().generate(ids, max_new_tokens=8, do_sample=False, eos_token_id=None, pad_token_id=0)
    assert ours.outputs[0].token_ids == expected[0, ids.shape[1] :].tolist()


def test_a_phi3_adapter_targets_its_fused_modules(tmp_path: Path) -> None:
    """By default a Phi-3 adapter adapts its four fused modules, named so in its config and manifest."""
    base = make_tiny_model(tmp_path / "phi3", TinyModelSpec(family="phi3", hidden=64, layers=1))
    result = train_adapter(request(base, tmp_path, "out", n_epochs=1, lora_r=4))
    fused = ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"]
    config = json.loads((result.output_dir / ADAPTER_CONFIG).read_text())
    assert config["target_modules"] == sorted(fused) and result.manifest["target_modules"] == fused


def test_the_train_command_refuses_part_of_a_fused_module(tmp_path: Path) -> None:
    """Phi-3 holds q/k/v in one matrix: adapting only q and v cannot be trained or served, and says so."""
    base = make_tiny_model(tmp_path / "phi3", TinyModelSpec(family="phi3", hidden=64, layers=1))
    app = typer.Typer()
    register(app)
    app.command("noop")(lambda: None)
    data = write_rows(tmp_path / "train.jsonl", 12)
    args = ["train", "--model", str(base), "--data", str(data), "--out", str(tmp_path / "adapter")]
    done = CliRunner().invoke(app, [*args, "--target-modules", "q_proj,v_proj"])
    assert done.exit_code == 2, done.output
    assert "holds q_proj, k_proj, v_proj in one matrix, qkv_proj" in " ".join(done.output.split())
    assert not (tmp_path / "adapter").exists()
