"""Shapes of ``/v1/fine_tuning/jobs``: OpenAI's job and event objects, with our LoRA hyperparameters."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from api.naming import SUFFIX_MAX, check_suffix
from api.pagination import ListPage
from core.hyperparameters import DPO, SUPERVISED, Hyperparameters, ResolvedHyperparameters
from core.models import Adapter, FineTuneJob, FineTuningCheckpoint, JobEvent

MAX_SEED = 2**31 - 1
EVENT_ID_PREFIX = "ftevent-"
# OpenAI's limits on metadata: 16 pairs, keys up to 64 characters, values up to 512.
METADATA_PAIRS, METADATA_KEY_CHARS, METADATA_VALUE_CHARS = 16, 64, 512

JobStatusName = Literal["validating_files", "queued", "running", "succeeded", "failed", "cancelled"]


class SupervisedSettings(BaseModel):
    model_config = ConfigDict(extra="forbid")

    hyperparameters: Hyperparameters | None = None


class DpoSettings(BaseModel):
    model_config = ConfigDict(extra="forbid")

    hyperparameters: Hyperparameters | None = Field(
        default=None, description="As for supervised, plus beta (> 0, <= 2; auto: 0.1)."
    )


class MethodIn(BaseModel):
    """OpenAI's ``method``: supervised fine-tuning, or DPO on preference pairs, each with its hyperparameters."""

    model_config = ConfigDict(extra="forbid")

    type: Literal["supervised", "dpo"]
    supervised: SupervisedSettings | None = None
    dpo: DpoSettings | None = None

    @model_validator(mode="after")
    def _settings_match_type(self) -> MethodIn:
        other = "dpo" if self.type == SUPERVISED else "supervised"
        if getattr(self, other) is not None:
            raise ValueError(f"method.{other} was given but method.type is {self.type!r}; give method.{self.type}")
        return self

    def settings(self) -> SupervisedSettings | DpoSettings | None:
        return self.dpo if self.type == DPO else self.supervised


class JobCreate(BaseModel):
    """``POST /v1/fine_tuning/jobs``."""

    model_config = ConfigDict(extra="forbid")

    model: str = Field(
        min_length=1,
        max_length=512,
        description="The base model to fine-tune, or one of your fine-tuned models to continue (see /v1/models).",
    )
    training_file: str = Field(min_length=1, max_length=64, description="Id of an uploaded fine-tune file.")
    validation_file: str | None = Field(default=None, min_length=1, max_length=64)
    hyperparameters: Hyperparameters | None = None
    method: MethodIn | None = None
    suffix: str | None = Field(
        default=None, max_length=SUFFIX_MAX, description="Up to 64 letters, digits, '-' or '_'; ends up in the name."
    )
    seed: int | None = Field(default=None, ge=0, le=MAX_SEED, description="Same seed, data, settings: same adapter.")
    metadata: dict[str, str] | None = Field(
        default=None, description="Up to 16 string pairs (keys up to 64 characters, values up to 512) to find it by."
    )

    @field_validator("suffix")
    @classmethod
    def _suffix(cls, value: str | None) -> str | None:
        return check_suffix(value)

    @field_validator("metadata")
    @classmethod
    def _metadata(cls, value: dict[str, str] | None) -> dict[str, str] | None:
        return check_metadata(value)

    @property
    def method_type(self) -> str:
        """``supervised`` unless ``method`` says ``dpo``."""
        return self.method.type if self.method is not None else SUPERVISED

    def requested_hyperparameters(self) -> tuple[Hyperparameters, str]:
        """The hyperparameters as sent, from the top level or from ``method``, and the field they came from."""
        settings = self.method.settings() if self.method is not None else None
        if settings is not None and settings.hyperparameters is not None:
            return settings.hyperparameters, f"method.{self.method_type}.hyperparameters"
        return self.hyperparameters or Hyperparameters(), "hyperparameters"


def check_metadata(value: dict[str, str] | None) -> dict[str, str] | None:
    """OpenAI's metadata limits, with a message that names the pair to fix."""
    if value is None:
        return None
    if len(value) > METADATA_PAIRS:
        raise ValueError(f"metadata has {len(value)} pairs; at most {METADATA_PAIRS} are allowed")
    for key, text in value.items():
        if not key or len(key) > METADATA_KEY_CHARS:
            raise ValueError(f"metadata key {key[:80]!r} must be 1 to {METADATA_KEY_CHARS} characters")
        if any(c in key for c in '"\\') or not key.isprintable():
            # Filters become JSON paths ($."key") in SQL; these would end or escape the quoted key.
            raise ValueError(f"metadata key {key!r} may not contain quotes, backslashes or control characters")
        if len(text) > METADATA_VALUE_CHARS:
            raise ValueError(f"metadata value of {key!r} is {len(text)} characters; at most {METADATA_VALUE_CHARS}")
    return value


class JobError(BaseModel):
    code: str
    message: str
    param: str | None = None


class MethodSettings(BaseModel):
    hyperparameters: ResolvedHyperparameters


class JobMethod(BaseModel):
    type: Literal["supervised", "dpo"] = "supervised"
    supervised: MethodSettings | None = None
    dpo: MethodSettings | None = None

    @classmethod
    def of(cls, method: str, hyperparameters: ResolvedHyperparameters) -> JobMethod:
        settings = MethodSettings(hyperparameters=hyperparameters)
        return cls(type="dpo", dpo=settings) if method == DPO else cls(type="supervised", supervised=settings)


class FineTuningJobObject(BaseModel):
    """A fine-tuning job as the openai SDK's ``FineTuningJob`` reads it."""

    id: str
    object: Literal["fine_tuning.job"] = "fine_tuning.job"
    created_at: int
    error: JobError | None
    fine_tuned_model: str | None = Field(description="ft:{base}:{tenant}:{suffix}:{job id}, once succeeded.")
    finished_at: int | None
    hyperparameters: ResolvedHyperparameters
    model: str = Field(description="The base model, or the fine-tuned model the job continues.")
    organization_id: str = Field(description="The tenant id.")
    result_files: list[str] = Field(
        default_factory=list, description="Once succeeded: its step metrics (step_metrics.csv) in /v1/files."
    )
    seed: int
    status: JobStatusName
    trained_tokens: int | None
    training_file: str
    validation_file: str | None
    estimated_finish: int | None = None
    integrations: list[Any] = Field(default_factory=list)
    metadata: dict[str, str] | None = None
    method: JobMethod
    suffix: str | None
    adapter_id: str | None = Field(default=None, description="The adapter this job produced.")

    @classmethod
    def from_row(cls, job: FineTuneJob) -> FineTuningJobObject:
        hyperparameters = ResolvedHyperparameters.model_validate(job.hyperparameters)
        error = None
        if job.error_code or job.error_message:
            error = JobError(code=job.error_code or "error", message=job.error_message or "", param=job.error_param)
        return cls(
            id=job.id,
            created_at=job.created_at,
            error=error,
            fine_tuned_model=job.fine_tuned_model,
            finished_at=job.finished_at,
            hyperparameters=hyperparameters,
            model=job.parent_model or job.base_model,
            organization_id=job.tenant_id,
            seed=job.seed,
            status=job.status,  # type: ignore[arg-type]  # the column holds a JobStatus value
            trained_tokens=job.trained_tokens,
            training_file=job.training_file,
            validation_file=job.validation_file,
            method=JobMethod.of(job.method, hyperparameters),
            suffix=job.suffix,
            adapter_id=job.adapter_id,
            result_files=list(job.result_files),
            metadata=job.user_metadata,
        )


class JobList(ListPage[FineTuningJobObject]):
    """A page of jobs, newest first."""


class JobEventObject(BaseModel):
    id: str
    object: Literal["fine_tuning.job.event"] = "fine_tuning.job.event"
    created_at: int
    level: str = Field(description="info, warn or error.")
    message: str
    data: dict[str, Any] | None = None
    type: str = Field(description="message or metrics (step, loss, ...).")

    @classmethod
    def from_row(cls, event: JobEvent) -> JobEventObject:
        return cls(
            id=f"{EVENT_ID_PREFIX}{event.id}",
            created_at=event.created_at,
            level=event.level,
            message=event.message,
            data=event.data,
            type=event.type,
        )


class JobEventList(ListPage[JobEventObject]):
    """A page of events, newest first."""


class CheckpointObject(BaseModel):
    """An epoch checkpoint as the openai SDK's ``FineTuningJobCheckpoint`` reads it."""

    id: str
    object: Literal["fine_tuning.job.checkpoint"] = "fine_tuning.job.checkpoint"
    created_at: int
    fine_tuned_model_checkpoint: str = Field(description="The model name that serves this checkpoint.")
    fine_tuning_job_id: str
    metrics: dict[str, float] = Field(description="step, train_loss; valid_loss with a validation file.")
    step_number: int

    @classmethod
    def from_rows(cls, row: FineTuningCheckpoint, adapter: Adapter) -> CheckpointObject:
        return cls(
            id=row.id,
            created_at=row.created_at,
            fine_tuned_model_checkpoint=adapter.name,
            fine_tuning_job_id=row.job_id,
            metrics=row.metrics,
            step_number=row.step_number,
        )


class CheckpointList(ListPage[CheckpointObject]):
    """A page of a job's checkpoints, newest first."""
