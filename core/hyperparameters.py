"""Fine-tuning hyperparameters: one schema the API validates at job creation and the worker trains with.

OpenAI's fields (``n_epochs``, ``batch_size``, ``learning_rate_multiplier``, each also ``"auto"``) plus
ours (absolute ``learning_rate``, ``lora_r``, ``lora_alpha``, ``lora_dropout``, ``target_modules``,
``max_seq_len``). Bounds are generous but refuse the absurd: a job that could never finish or fit is
rejected before it is queued.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from core.projections import FAMILY_MODULES, adapter_modules
from core.projections import PROJECTIONS as ALL_TARGETS

# Every module name some family has (Phi-3's fused ones too); resolve() checks them against the base model.
KNOWN_TARGETS = tuple(dict.fromkeys([*ALL_TARGETS, *(n for family in FAMILY_MODULES.values() for n in family.names)]))

SUPERVISED, DPO = "supervised", "dpo"  # fine-tuning methods, as OpenAI's job ``method.type`` names them
DEFAULT_BETA = 0.1  # DPO's beta="auto"
BASE_LEARNING_RATE = 2e-4  # what learning_rate_multiplier=1 means for LoRA
DEFAULT_EPOCHS = 3  # "auto" when the dataset's size is not known (``loraplex train``)
DEFAULT_BATCH_SIZE = 4
# "auto" from the dataset's size, as OpenAI documents it: about 3 passes, but at least 100 and at most 25,000
# examples seen in all (1 to 25 epochs), and batches of about 0.2% of the examples (1 to 256).
TARGET_EPOCHS, MIN_TARGET_EXAMPLES, MAX_TARGET_EXAMPLES, MAX_AUTO_EPOCHS = 3, 100, 25_000, 25
AUTO_BATCH_FRACTION, MAX_AUTO_BATCH = 0.002, 256


def auto_epochs(num_examples: int) -> int:
    """Epochs for ``n_epochs="auto"``: 3, more for small files (100 examples seen), fewer for huge ones."""
    if num_examples * TARGET_EPOCHS < MIN_TARGET_EXAMPLES:
        return min(MAX_AUTO_EPOCHS, MIN_TARGET_EXAMPLES // num_examples)
    if num_examples * TARGET_EPOCHS > MAX_TARGET_EXAMPLES:
        return max(1, MAX_TARGET_EXAMPLES // num_examples)
    return TARGET_EPOCHS


def auto_batch_size(num_examples: int) -> int:
    """Batch size for ``batch_size="auto"``: about 0.2% of the examples, between 1 and 256."""
    return max(1, min(MAX_AUTO_BATCH, round(AUTO_BATCH_FRACTION * num_examples)))


class Hyperparameters(BaseModel):
    """As a client sends them; ``"auto"`` and omitted fields are resolved by :meth:`resolve`."""

    model_config = ConfigDict(extra="forbid")

    n_epochs: int | Literal["auto"] = Field(default="auto")
    batch_size: int | Literal["auto"] = Field(default="auto")
    learning_rate_multiplier: float | Literal["auto"] = Field(default="auto")
    learning_rate: float | None = Field(default=None, description="Absolute LR; overrides the multiplier.")
    lora_r: int = Field(default=8)
    lora_alpha: float | None = Field(default=None, description="Default: 2 * lora_r.")
    lora_dropout: float = Field(default=0.0)
    target_modules: list[str] | None = Field(
        default=None, description="Default: all seven projections (for Phi-3 its four modules, which fuse them)."
    )
    max_seq_len: int = Field(default=1024)
    beta: float | Literal["auto"] | None = Field(
        default=None, description="DPO only: how far the policy may move from the reference (auto: 0.1)."
    )

    @field_validator("n_epochs")
    @classmethod
    def _epochs(cls, v: int | str) -> int | str:
        if isinstance(v, int) and not 1 <= v <= 100:
            raise ValueError("n_epochs must be between 1 and 100")
        return v

    @field_validator("batch_size")
    @classmethod
    def _batch(cls, v: int | str) -> int | str:
        if isinstance(v, int) and not 1 <= v <= 256:
            raise ValueError("batch_size must be between 1 and 256")
        return v

    @field_validator("learning_rate_multiplier")
    @classmethod
    def _multiplier(cls, v: float | str) -> float | str:
        if isinstance(v, float | int) and not 0 < v <= 100:
            raise ValueError("learning_rate_multiplier must be > 0 and <= 100")
        return v

    @field_validator("learning_rate")
    @classmethod
    def _lr(cls, v: float | None) -> float | None:
        if v is not None and not 0 < v <= 1:
            raise ValueError("learning_rate must be > 0 and <= 1")
        return v

    @field_validator("lora_alpha")
    @classmethod
    def _alpha(cls, v: float | None) -> float | None:
        if v is not None and not 0 < v <= 4096:
            raise ValueError("lora_alpha must be > 0 and <= 4096")
        return v

    @field_validator("lora_dropout")
    @classmethod
    def _dropout(cls, v: float) -> float:
        if not 0 <= v < 1:
            raise ValueError("lora_dropout must be >= 0 and < 1")
        return v

    @field_validator("target_modules")
    @classmethod
    def _targets(cls, v: list[str] | None) -> list[str] | None:
        if v is None:
            return v
        if not v:
            raise ValueError("target_modules must name at least one projection")
        unknown = sorted(set(v) - set(KNOWN_TARGETS))
        if unknown:
            raise ValueError(f"unknown target_modules {unknown}; choose from {list(KNOWN_TARGETS)}")
        return [t for t in KNOWN_TARGETS if t in v]  # canonical order, no duplicates

    @field_validator("max_seq_len")
    @classmethod
    def _seq(cls, v: int) -> int:
        if not 8 <= v <= 131072:
            raise ValueError("max_seq_len must be between 8 and 131072")
        return v

    @field_validator("beta")
    @classmethod
    def _beta(cls, v: float | str | None) -> float | str | None:
        if isinstance(v, float | int) and not 0 < v <= 2:
            raise ValueError("beta must be > 0 and <= 2")
        return v

    def resolve(
        self,
        *,
        max_lora_rank: int,
        method: str = SUPERVISED,
        context_length: int | None = None,
        model_type: str | None = None,
        num_examples: int | None = None,
    ) -> ResolvedHyperparameters:
        """Concrete values for training; raises ``ValueError`` naming the field when out of bounds.

        With the base model's ``model_type``, ``target_modules`` become that family's module names. With the
        training file's ``num_examples``, ``"auto"`` epochs and batch size follow its size (:func:`auto_epochs`,
        :func:`auto_batch_size`); without it they are 3 and 4. ``"auto"`` learning-rate multiplier is 1:
        OpenAI's 0.05-0.2 scale full-parameter rates, which mean nothing for LoRA's. ``beta`` belongs to
        ``method`` DPO (``"auto"``: 0.1, as OpenAI and the DPO paper)."""
        if method != DPO and self.beta is not None:
            raise ValueError("beta is a DPO hyperparameter; give it with method 'dpo' or leave it out")
        if not 1 <= self.lora_r <= max_lora_rank:
            raise ValueError(f"lora_r must be between 1 and {max_lora_rank} (the platform's max rank)")
        if context_length is not None and self.max_seq_len > context_length:
            raise ValueError(f"max_seq_len {self.max_seq_len} exceeds the base model's context of {context_length}")
        multiplier = 1.0 if self.learning_rate_multiplier == "auto" else float(self.learning_rate_multiplier)
        targets = list(self.target_modules or ALL_TARGETS)
        if model_type is not None:
            targets = list(adapter_modules(model_type).targets(targets))
        epochs, batch = (DEFAULT_EPOCHS, DEFAULT_BATCH_SIZE)
        if num_examples:
            epochs, batch = auto_epochs(num_examples), auto_batch_size(num_examples)
        return ResolvedHyperparameters(
            n_epochs=epochs if self.n_epochs == "auto" else self.n_epochs,
            batch_size=batch if self.batch_size == "auto" else self.batch_size,
            learning_rate_multiplier=multiplier,
            learning_rate=self.learning_rate if self.learning_rate is not None else BASE_LEARNING_RATE * multiplier,
            lora_r=self.lora_r,
            lora_alpha=self.lora_alpha if self.lora_alpha is not None else 2.0 * self.lora_r,
            lora_dropout=self.lora_dropout,
            target_modules=targets,
            max_seq_len=self.max_seq_len,
            beta=self._resolved_beta(method),
        )

    def _resolved_beta(self, method: str) -> float | None:
        if method != DPO:
            return None
        return DEFAULT_BETA if self.beta is None or self.beta == "auto" else float(self.beta)


class ResolvedHyperparameters(BaseModel):
    """Every value concrete: what is stored on the job and what the trainer uses."""

    model_config = ConfigDict(extra="forbid")

    n_epochs: int
    batch_size: int
    learning_rate_multiplier: float
    learning_rate: float
    lora_r: int
    lora_alpha: float
    lora_dropout: float
    target_modules: list[str]
    max_seq_len: int
    beta: float | None = None  # DPO's: how far from the reference the policy may move (None for supervised)
