"""Database tables. Every tenant-owned row carries ``tenant_id`` and is indexed by (tenant_id, created_at),
the order every list endpoint and usage report reads in. Timestamps are Unix seconds (OpenAI's unit)."""

from __future__ import annotations

from typing import Any

from sqlalchemy import JSON, BigInteger, Column, Index
from sqlmodel import Field, SQLModel

from core.descriptor import AdapterDescriptor
from core.ids import now
from core.job_states import JobStatus  # the states and their moves live there; re-exported here


class Tenant(SQLModel, table=True):
    id: str = Field(primary_key=True, max_length=40)
    name: str = Field(unique=True, index=True, max_length=64)
    disabled: bool = False
    requests_per_minute: int | None = None  # None: the platform default
    tokens_per_minute: int | None = None
    scheduling_weight: float | None = None  # share of a busy inference server relative to others; None: 1
    created_at: int = Field(default_factory=now, index=True)


class ApiKey(SQLModel, table=True):
    __tablename__ = "api_key"

    id: str = Field(primary_key=True, max_length=40)
    tenant_id: str = Field(foreign_key="tenant.id", index=True, max_length=40)
    key_hash: str = Field(unique=True, index=True, max_length=64)  # sha256 hex; the key itself is never stored
    prefix: str = Field(max_length=16)  # shown in listings so people can tell keys apart
    name: str | None = Field(default=None, max_length=128)
    created_at: int = Field(default_factory=now)
    revoked_at: int | None = None
    last_used_at: int | None = None


class File(SQLModel, table=True):
    __table_args__ = (Index("ix_file_tenant_created", "tenant_id", "created_at"),)

    id: str = Field(primary_key=True, max_length=40)
    tenant_id: str = Field(foreign_key="tenant.id", max_length=40)
    filename: str = Field(max_length=255)
    purpose: str = Field(max_length=32)
    bytes: int = Field(sa_column=Column(BigInteger, nullable=False))
    sha256: str = Field(max_length=64)
    storage_key: str = Field(max_length=512)
    status: str = Field(default="processed", max_length=16)  # uploaded | processed | error
    status_details: str | None = None
    format: str | None = Field(default=None, max_length=32)  # chat | prompt_completion
    num_examples: int | None = None
    created_at: int = Field(default_factory=now)
    deleted_at: int | None = None


class FineTuneJob(SQLModel, table=True):
    __tablename__ = "fine_tune_job"
    __table_args__ = (
        Index("ix_job_tenant_created", "tenant_id", "created_at"),
        Index("ix_job_status_heartbeat", "status", "heartbeat_at"),
    )

    id: str = Field(primary_key=True, max_length=40)
    tenant_id: str = Field(foreign_key="tenant.id", max_length=40)
    base_model: str = Field(max_length=255)  # the base its adapter applies to, also when it continues a parent
    method: str = Field(default="supervised", max_length=16)  # supervised | dpo
    parent_model: str | None = Field(default=None, max_length=512)  # the fine-tuned model it continues, as named
    parent_adapter_id: str | None = Field(default=None, max_length=40)  # that model's adapter
    training_file: str = Field(max_length=40)
    validation_file: str | None = Field(default=None, max_length=40)
    status: str = Field(default=JobStatus.VALIDATING_FILES, max_length=24)
    hyperparameters: dict[str, Any] = Field(default_factory=dict, sa_column=Column(JSON, nullable=False))
    suffix: str | None = Field(default=None, max_length=64)
    seed: int = 0
    fine_tuned_model: str | None = Field(default=None, max_length=512)
    adapter_id: str | None = Field(default=None, max_length=40)
    result_files: list[str] = Field(default_factory=list, sa_column=Column(JSON, nullable=False))  # file ids
    # The client's key-value pairs (OpenAI's ``metadata``); the attribute is renamed because SQLAlchemy
    # reserves ``metadata`` on mapped classes.
    user_metadata: dict[str, str] | None = Field(
        default=None, sa_column=Column("metadata", JSON(none_as_null=True), nullable=True)
    )
    trained_tokens: int | None = None
    error_code: str | None = Field(default=None, max_length=64)
    error_message: str | None = None
    error_param: str | None = Field(default=None, max_length=64)
    attempts: int = 0  # deliveries that started running; bounded so a job that kills workers ends failed
    max_attempts: int = 3
    # Attempts that ended on a platform outage (object store, Redis, database down): retried with a growing
    # delay, bounded separately, and not charged to ``attempts``.
    transient_failures: int = 0
    queued_at: float | None = None  # when its queue message was last sent (or becomes due, when delayed)
    cancel_requested: bool = False
    worker_id: str | None = Field(default=None, max_length=255)
    heartbeat_at: float | None = None  # last sign of life from the worker running it
    compute_seconds: float = 0.0
    created_at: int = Field(default_factory=now)
    started_at: int | None = None
    finished_at: int | None = None


class JobEvent(SQLModel, table=True):
    __tablename__ = "job_event"
    __table_args__ = (Index("ix_event_job_id", "job_id", "id"),)

    id: int | None = Field(default=None, primary_key=True)  # autoincrement: the event order
    job_id: str = Field(foreign_key="fine_tune_job.id", max_length=40)
    tenant_id: str = Field(max_length=40)
    level: str = Field(default="info", max_length=8)  # info | warn | error
    type: str = Field(default="message", max_length=16)  # message | metrics
    message: str
    data: dict[str, Any] | None = Field(default=None, sa_column=Column(JSON, nullable=True))
    created_at: int = Field(default_factory=now)


class Adapter(SQLModel, table=True):
    __table_args__ = (Index("ix_adapter_tenant_created", "tenant_id", "created_at"),)

    id: str = Field(primary_key=True, max_length=40)
    tenant_id: str = Field(foreign_key="tenant.id", max_length=40)
    name: str = Field(unique=True, index=True, max_length=512)  # the `model` clients pass: ft:{base}:...
    base_model: str = Field(max_length=255)
    source: str = Field(default="fine_tune", max_length=16)  # fine_tune | upload | checkpoint
    job_id: str | None = Field(default=None, max_length=40)
    storage_prefix: str = Field(max_length=512)  # tenants/{tenant}/adapters/{id}/
    sha256: str = Field(max_length=64)  # of adapter_model.safetensors
    config_sha256: str = Field(max_length=64)  # of adapter_config.json
    rank: int
    alpha: float
    target_modules: list[str] = Field(default_factory=list, sa_column=Column(JSON, nullable=False))
    size_bytes: int = Field(default=0, sa_column=Column(BigInteger, nullable=False))
    # The base it was made on (core.base_fingerprint); None for adapters registered before it was kept.
    base_fingerprint: str | None = Field(default=None, max_length=80)
    created_at: int = Field(default_factory=now)
    deleted_at: int | None = None

    def descriptor(self) -> AdapterDescriptor:
        """What an inference server needs to fetch, verify and place this adapter."""
        return AdapterDescriptor(
            id=self.id,
            name=self.name,
            base_model=self.base_model,
            storage_prefix=self.storage_prefix,
            sha256=self.sha256,
            config_sha256=self.config_sha256,
            rank=self.rank,
            base_fingerprint=self.base_fingerprint,
        )


class FineTuningCheckpoint(SQLModel, table=True):
    """A job's end-of-epoch checkpoint: a servable adapter (its own ``Adapter`` row, source ``checkpoint``)
    whose objects also hold the state that resumes training from it, under ``{prefix}state/``. A job keeps
    its last three (``worker.checkpoints``)."""

    __tablename__ = "fine_tuning_checkpoint"
    __table_args__ = (Index("ix_checkpoint_job_step", "job_id", "step_number"),)

    id: str = Field(primary_key=True, max_length=40)
    job_id: str = Field(foreign_key="fine_tune_job.id", max_length=40)
    tenant_id: str = Field(max_length=40)
    adapter_id: str = Field(max_length=40)
    step_number: int
    epoch: int
    metrics: dict[str, float] = Field(default_factory=dict, sa_column=Column(JSON, nullable=False))
    created_at: int = Field(default_factory=now)


class UsageRecord(SQLModel, table=True):
    __tablename__ = "usage_record"
    __table_args__ = (
        Index("ix_usage_tenant_created", "tenant_id", "created_at"),
        Index("ix_usage_created", "created_at"),
    )

    id: int | None = Field(default=None, primary_key=True)
    tenant_id: str = Field(max_length=40)
    kind: str = Field(max_length=16)  # inference | training | residency
    model: str | None = Field(default=None, max_length=512)
    adapter_id: str | None = Field(default=None, max_length=40, index=True)
    request_id: str | None = Field(default=None, max_length=64)
    job_id: str | None = Field(default=None, max_length=40)
    replica: str | None = Field(default=None, max_length=255)
    prompt_tokens: int = 0
    cached_tokens: int = 0  # of prompt_tokens, read from the server's prefix cache instead of computed
    completion_tokens: int = 0
    training_tokens: int = 0
    compute_seconds: float = 0.0  # training job wall time on its device
    gpu_seconds: float = 0.0  # share of inference-server step time spent on this request
    page_seconds: float = 0.0  # adapter residency reported by servers
    latency_ms: float | None = None
    ttft_ms: float | None = None
    cold_start: bool = False
    status: str | None = Field(default=None, max_length=32)
    created_at: int = Field(default_factory=now)


class AuditEvent(SQLModel, table=True):
    """One thing done to an adapter's bytes: a replica verified, refused, loaded or evicted it, or the control
    plane deleted it (``core.audit``). Rows are written once and never changed; ids sort by when they were
    stored, ``at`` says when it happened (the replica's clock for replica events)."""

    __tablename__ = "audit_event"
    __table_args__ = (
        Index("ix_audit_tenant_id", "tenant_id", "id"),
        Index("ix_audit_adapter_id", "adapter_id", "id"),
        Index("ix_audit_at", "at"),
    )

    id: str = Field(primary_key=True, max_length=40)
    at: float
    action: str = Field(max_length=16)  # core.audit.AuditAction
    tenant_id: str | None = Field(default=None, max_length=40)  # None: an adapter no tenant owns (a local one)
    adapter_id: str | None = Field(default=None, max_length=40)
    adapter_name: str | None = Field(default=None, max_length=512)
    replica: str | None = Field(default=None, max_length=255)  # None: the control plane
    sha256: str | None = Field(default=None, max_length=64)  # of adapter_model.safetensors
    tier: str | None = Field(default=None, max_length=16)  # where the bytes came from or left
    reason: str | None = Field(default=None, max_length=64)
    cause: str | None = Field(default=None, max_length=128)  # request:<id>, job:<id>, tenant:<id>
    detail: str | None = Field(default=None, max_length=1000)
    created_at: int = Field(default_factory=now)
