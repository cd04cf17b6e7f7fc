from __future__ import annotations

import pytest
from pydantic import ValidationError

from core.hyperparameters import ALL_TARGETS, BASE_LEARNING_RATE, Hyperparameters


def test_auto_values_resolve_to_defaults() -> None:
    resolved = Hyperparameters().resolve(max_lora_rank=64)
    assert resolved.n_epochs == 3 and resolved.batch_size == 4
    assert resolved.learning_rate == pytest.approx(BASE_LEARNING_RATE)
    assert resolved.lora_alpha == 16 and resolved.target_modules == list(ALL_TARGETS)
    explicit = Hyperparameters(learning_rate_multiplier=2, target_modules=["v_proj", "q_proj", "q_proj"])
    resolved = explicit.resolve(max_lora_rank=64)
    assert resolved.learning_rate == pytest.approx(2 * BASE_LEARNING_RATE)
    assert resolved.target_modules == ["q_proj", "v_proj"]


@pytest.mark.parametrize(
    ("examples", "epochs", "batch"),
    [
        (1, 25, 1),  # 100 examples seen would take 100 epochs: capped at 25
        (12, 8, 1),  # 3 passes would see 36 < 100 examples
        (34, 3, 1),  # 3 x 34 = 102: the target
        (1_000, 3, 2),
        (10_000, 2, 20),  # 3 passes would see 30,000 > 25,000
        (200_000, 1, 256),
    ],
)
def test_auto_epochs_and_batch_size_follow_the_dataset_as_openai_documents(
    examples: int, epochs: int, batch: int
) -> None:
    resolved = Hyperparameters().resolve(max_lora_rank=64, num_examples=examples)
    assert (resolved.n_epochs, resolved.batch_size) == (epochs, batch)
    chosen = Hyperparameters(n_epochs=5, batch_size=8).resolve(max_lora_rank=64, num_examples=examples)
    assert (chosen.n_epochs, chosen.batch_size) == (5, 8)  # what a client sets is never overridden


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("n_epochs", 1_000_000),
        ("n_epochs", 0),
        ("batch_size", 0),
        ("learning_rate", -1e-4),
        ("learning_rate_multiplier", 0),
        ("lora_alpha", 0),
        ("lora_dropout", 1.0),
        ("target_modules", ["embed_tokens"]),
        ("target_modules", []),
        ("max_seq_len", 2),
        ("unknown_field", 1),
    ],
)
def test_absurd_values_are_refused_naming_the_field(field: str, value: object) -> None:
    with pytest.raises(ValidationError) as exc:
        Hyperparameters(**{field: value})
    assert field in str(exc.value)


@pytest.mark.parametrize("rank", [0, 65, 100_000])
def test_rank_bounded_by_platform_limit(rank: int) -> None:
    with pytest.raises(ValueError, match="lora_r"):
        Hyperparameters(lora_r=rank).resolve(max_lora_rank=64)


def test_seq_len_bounded_by_context() -> None:
    with pytest.raises(ValueError, match="max_seq_len"):
        Hyperparameters(max_seq_len=4096).resolve(max_lora_rank=64, context_length=2048)


def test_targets_become_the_base_model_family_modules() -> None:
    assert Hyperparameters().resolve(max_lora_rank=64, model_type="phi3").target_modules == [
        "qkv_proj", "o_proj", "gate_up_proj", "down_proj"
    ]  # fmt: skip
    fused = Hyperparameters(target_modules=["qkv_proj", "down_proj"])
    assert fused.resolve(max_lora_rank=64, model_type="phi3").target_modules == ["qkv_proj", "down_proj"]
    with pytest.raises(ValueError, match=r"^target_modules: this model holds q_proj, k_proj, v_proj in one matrix"):
        Hyperparameters(target_modules=["q_proj", "v_proj"]).resolve(max_lora_rank=64, model_type="phi3")
    with pytest.raises(ValueError, match=r"^target_modules: this model has no qkv_proj"):
        fused.resolve(max_lora_rank=64, model_type="llama")
