"""DPO on the tiny model: a supervised adapter that answers two ways learns, from preference pairs, which way
is preferred; a DPO run resumes exactly; and each method refuses the other's data."""

from __future__ import annotations

import csv
import io
import json
import random
from dataclasses import replace
from pathlib import Path

import pytest
import torch
import typer
from peft import PeftModel
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM
from typer.testing import CliRunner

from core.descriptor import ADAPTER_CONFIG, ADAPTER_MANIFEST, ADAPTER_WEIGHTS
from core.hyperparameters import DPO, Hyperparameters
from tests.unit.trainer.test_checkpoints import Keeper, train_until_cancelled
from trainer.checkpoints import resume_layout
from trainer.cli import register
from trainer.errors import InvalidTrainingData
from trainer.manifest import verify_adapter_dir
from trainer.train import TrainingRequest, load_tokenizer, train_adapter

LETTERS = "abcdefghijklmnopqrstuvwxyz"
PREFERRED, OTHER = "!", "?"


def made_up_words(n: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    return list(dict.fromkeys("".join(rng.choices(LETTERS, k=rng.randint(3, 4))) for _ in range(3 * n)))[:n]


def ask(word: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": word}]


def say(text: str) -> dict[str, str]:
    return {"role": "assistant", "content": text}


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def pair(word: str) -> dict:
    return {
        "input": {"messages": ask(word)},
        "preferred_output": [say(word + PREFERRED)],
        "non_preferred_output": [say(word + OTHER)],
    }


def hyperparameters(method: str = "supervised", **values: object):  # type: ignore[no-untyped-def]
    return Hyperparameters(**{"batch_size": 16, "lora_r": 16, **values}).resolve(max_lora_rank=64, method=method)


class Judge:
    """The adapter's greedy answers and log-prob margins (preferred minus other answer) on held-out words."""

    def __init__(self, model_dir: Path, adapter: Path) -> None:
        self.tokenizer = load_tokenizer(model_dir)
        base = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
        self.model = PeftModel.from_pretrained(base, str(adapter)).eval()

    def _prompt(self, word: str) -> torch.Tensor:
        rendered = self.tokenizer.apply_chat_template(ask(word), add_generation_prompt=True, return_dict=True)
        return torch.tensor([rendered["input_ids"]])

    @torch.no_grad()
    def answer(self, word: str) -> str:
        ids = self._prompt(word)
        out = self.model.generate(ids, max_new_tokens=10, do_sample=False)
        return self.tokenizer.decode(out[0, ids.shape[1] :], skip_special_tokens=True).strip()

    @torch.no_grad()
    def logprob(self, word: str, text: str) -> float:
        prompt = self._prompt(word)
        full = self.tokenizer.apply_chat_template([*ask(word), say(text)], return_dict=True)["input_ids"]
        ids = torch.tensor([full])
        logits = self.model(ids).logits[0, :-1].log_softmax(-1)
        positions = range(prompt.shape[1] - 1, len(full) - 1)
        return sum(float(logits[i, full[i + 1]]) for i in positions)

    def margin(self, word: str) -> float:
        return self.logprob(word, word + PREFERRED) - self.logprob(word, word + OTHER)


def test_dpo_teaches_a_model_that_answers_both_ways_to_answer_the_preferred_way(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    words = made_up_words(1020)
    taught, pairs, held_out = words[:800], words[800:1000], words[1000:]
    # The parent answers each word with it and one of two marks, half and half: it can say either.
    supervised = [{"messages": [*ask(w), say(w + (PREFERRED if i % 2 else OTHER))]} for i, w in enumerate(taught)]
    parent = train_adapter(
        TrainingRequest(
            base_model_dir=tiny_model_dir,
            training_file=write_jsonl(tmp_path / "sft.jsonl", supervised),
            output_dir=tmp_path / "parent",
            hyperparameters=hyperparameters(n_epochs=6, learning_rate=3e-3),
            seed=1,
        )
    ).output_dir
    tuned = train_adapter(
        TrainingRequest(
            base_model_dir=tiny_model_dir,
            training_file=write_jsonl(tmp_path / "pairs.jsonl", [pair(w) for w in pairs]),
            output_dir=tmp_path / "dpo",
            hyperparameters=hyperparameters(DPO, n_epochs=2, learning_rate=5e-5, beta=0.5),
            seed=1,
            method=DPO,
            parent_adapter_dir=parent,
        )
    )
    before, after = Judge(tiny_model_dir, parent), Judge(tiny_model_dir, tuned.output_dir)
    margins = [(before.margin(w), after.margin(w)) for w in held_out]
    answers = [(before.answer(w), after.answer(w)) for w in held_out]
    assert all(m_after > m_before for m_before, m_after in margins), margins
    picked = sum(a.endswith(PREFERRED) for _, a in answers)
    assert picked >= 0.9 * len(held_out), answers
    assert sum(b.endswith(PREFERRED) for b, _ in answers) <= 0.75 * len(held_out), answers  # the parent: either way
    # It changes the mark, not what comes before it (which a model this small copies imperfectly either way).
    assert sum(a[:-1] == b[:-1] for b, a in answers) >= 0.7 * len(held_out), answers
    assert json.loads((tuned.output_dir / "adapter_config.json").read_text())["r"] == 16


def small_dpo_request(model_dir: Path, tmp_path: Path, name: str, parent: Path) -> TrainingRequest:
    pairs = write_jsonl(tmp_path / "small-pairs.jsonl", [pair(w) for w in made_up_words(12, seed=7)])
    return TrainingRequest(
        base_model_dir=model_dir,
        training_file=pairs,
        output_dir=tmp_path / name,
        hyperparameters=hyperparameters(DPO, n_epochs=4, batch_size=4, learning_rate=1e-3, lora_dropout=0.1),
        seed=3,
        method=DPO,
        parent_adapter_dir=parent,
        base_model_name="tiny",
    )


def test_a_resumed_dpo_run_ends_where_an_uninterrupted_one_does_against_the_same_reference(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    words = made_up_words(12)
    chats = [{"messages": [*ask(w), say(w + PREFERRED)]} for w in words]
    parent = train_adapter(
        TrainingRequest(
            base_model_dir=tiny_model_dir,
            training_file=write_jsonl(tmp_path / "sft.jsonl", chats),
            output_dir=tmp_path / "parent",
            hyperparameters=hyperparameters(n_epochs=1, batch_size=4, learning_rate=1e-2),
        )
    ).output_dir
    straight = train_adapter(small_dpo_request(tiny_model_dir, tmp_path, "straight", parent))

    interrupted = small_dpo_request(tiny_model_dir, tmp_path, "resumed", parent)
    keeper = Keeper(tmp_path / "kept")
    train_until_cancelled(interrupted, keeper, steps=7)  # killed in the middle of epoch 3
    assert [c.step for c in keeper.kept] == [3, 6]
    # A checkpoint is the trained adapter alone (not TRL's frozen reference copy), with DPO's metrics.
    assert sorted(p.name for p in keeper.kept[-1].adapter_dir.iterdir()) == sorted(
        [ADAPTER_CONFIG, ADAPTER_WEIGHTS, ADAPTER_MANIFEST]
    )
    assert {"train_loss", "train_reward_margin", "train_reward_accuracy"} <= set(keeper.kept[-1].metrics)
    last = keeper.kept[-1]
    resume = resume_layout(last.adapter_dir, last.state_dir, tmp_path / "resume")
    resumed = train_adapter(replace(interrupted, resume_from=resume), on_checkpoint=keeper)

    assert resumed.steps == straight.steps == 12
    assert resumed.train_loss == pytest.approx(straight.train_loss, abs=1e-6)
    a, b = load_file(straight.output_dir / ADAPTER_WEIGHTS), load_file(resumed.output_dir / ADAPTER_WEIGHTS)
    assert a.keys() == b.keys() == load_file(parent / ADAPTER_WEIGHTS).keys()
    for name in a:
        torch.testing.assert_close(b[name], a[name], rtol=0, atol=1e-5)
    rows = list(csv.DictReader(io.StringIO(resumed.step_metrics_csv)))
    assert [int(r["step"]) for r in rows] == list(range(1, 13))
    assert all(r["train_reward_margin"] and r["train_reward_accuracy"] for r in rows)


@pytest.mark.parametrize(
    ("method", "rows", "says"),
    [
        ("supervised", [pair(w) for w in made_up_words(10)], "which train with method 'dpo'"),
        (DPO, [{"messages": [*ask(w), say(w)]} for w in made_up_words(10)], "use method 'supervised'"),
    ],
)
def test_each_method_refuses_the_other_methods_data_before_loading_the_model(
    tiny_model_dir: Path, tmp_path: Path, method: str, rows: list[dict], says: str
) -> None:
    request = TrainingRequest(
        base_model_dir=tiny_model_dir,
        training_file=write_jsonl(tmp_path / "data.jsonl", rows),
        output_dir=tmp_path / "out",
        hyperparameters=hyperparameters(method),
        method=method,
    )
    with pytest.raises(InvalidTrainingData) as caught:
        train_adapter(request)
    assert says in caught.value.message and caught.value.param == "training_file"
    assert not (tmp_path / "out").exists()


def test_the_train_command_runs_dpo_on_top_of_an_adapter_and_keeps_its_shape(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    app = typer.Typer()
    register(app)
    app.command("noop")(lambda: None)  # a second command keeps typer from collapsing the group
    words = made_up_words(12)
    chats = write_jsonl(tmp_path / "chats.jsonl", [{"messages": [*ask(w), say(w + PREFERRED)]} for w in words])
    pairs = write_jsonl(tmp_path / "pairs.jsonl", [pair(w) for w in words])
    common = ["train", "--model", str(tiny_model_dir), "--epochs", "1", "--batch-size", "4"]

    sft = CliRunner().invoke(app, [*common, "--data", str(chats), "--lora-r", "2", "--out", str(tmp_path / "sft")])
    assert sft.exit_code == 0, sft.output
    dpo_args = ["--data", str(pairs), "--method", "dpo", "--beta", "0.3", "--from-adapter", str(tmp_path / "sft")]
    dpo = CliRunner().invoke(app, [*common, *dpo_args, "--out", str(tmp_path / "dpo")])
    assert dpo.exit_code == 0, dpo.output
    manifest = verify_adapter_dir(tmp_path / "dpo")
    assert manifest["rank"] == 2 and manifest["hyperparameters"]["beta"] == 0.3

    wrong = CliRunner().invoke(app, [*common, "--data", str(pairs), "--out", str(tmp_path / "wrong")])
    assert wrong.exit_code == 2 and "which train with method 'dpo'" in " ".join(wrong.output.split())


def test_a_continued_adapter_trains_with_this_jobs_dropout(tiny_model_dir: Path, tmp_path: Path) -> None:
    from peft.tuners.lora import LoraLayer

    from trainer.train import _lora_model

    chats = write_jsonl(tmp_path / "chats.jsonl", [{"messages": [*ask(w), say(w)]} for w in made_up_words(10)])
    parent = train_adapter(
        TrainingRequest(tiny_model_dir, chats, tmp_path / "parent", hyperparameters(n_epochs=1, lora_dropout=0.0))
    ).output_dir
    request = TrainingRequest(
        tiny_model_dir, chats, tmp_path / "child", hyperparameters(lora_dropout=0.3), parent_adapter_dir=parent
    )
    model = _lora_model(request, torch.float32)
    dropouts = [m.lora_dropout["default"] for m in model.modules() if isinstance(m, LoraLayer)]
    assert dropouts and all(isinstance(d, torch.nn.Dropout) and d.p == 0.3 for d in dropouts)
    assert model.peft_config["default"].lora_dropout == 0.3
