"""Shared pieces of the server tests: the tiny base model's name, one real PEFT adapter, an S3 bucket."""

from __future__ import annotations

import uuid
from pathlib import Path

import pytest

from core.storage import S3ObjectStore
from tests.integration.server.adapters import peft_adapter
from tests.services import S3Service


@pytest.fixture(scope="session")
def base_name(tiny_model_dir: Path) -> str:
    """What clients call the base model (the model directory's name)."""
    return tiny_model_dir.name


@pytest.fixture(scope="session")
def peft_dir(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A rank-8 LoRA on every projection, saved by PEFT; other test adapters are variants of it."""
    return peft_adapter(tiny_model_dir, tmp_path_factory.mktemp("peft") / "adapter")


@pytest.fixture(scope="session")
def s3_store(s3_service: S3Service) -> S3ObjectStore:
    """A bucket of the session's real S3 for adapters the servers load by descriptor."""
    return S3ObjectStore(
        s3_service.endpoint, s3_service.access_key, s3_service.secret_key, f"srv-{uuid.uuid4().hex[:16]}"
    )
