"""A live API (uvicorn on loopback) over real Redis, real S3 (SeaweedFS) and SQLite, and tenants to call it."""

from __future__ import annotations

import secrets
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
from openai import OpenAI

from api.app import create_app
from core import db
from core.local_services import EmbeddedRedis, free_port
from core.settings import Settings, load_settings
from tests.integration.api.live_server import LiveServer, serve
from tests.services import S3Service

# Small limits so the tests can cross them with small payloads.
TEST_MAX_UPLOAD_BYTES = 2 * 1024 * 1024
TEST_MAX_LORA_RANK = 16


def api_settings_for(data_dir: Path, redis_url: str, s3: S3Service, base_model: Path, **overrides: object) -> Settings:
    """Settings of an API (and a worker) on the test services, SQLite in ``data_dir``."""
    values: dict[str, object] = {
        "data_dir": data_dir,
        "database_url": f"sqlite:///{data_dir / 'loraplex.db'}",
        "redis_url": redis_url,
        "storage_backend": "s3",
        "s3_endpoint": s3.endpoint,
        "s3_access_key": s3.access_key,
        "s3_secret_key": s3.secret_key,
        "s3_bucket": f"api-{uuid.uuid4().hex[:16]}",
        "base_model": base_model,
        "admin_key": "adm-" + secrets.token_urlsafe(16),
        "max_upload_bytes": TEST_MAX_UPLOAD_BYTES,
        "max_lora_rank": TEST_MAX_LORA_RANK,
    }
    values.update(overrides)
    settings = load_settings(**values)
    db.upgrade(settings.db_url)
    return settings


@pytest.fixture(scope="session")
def api_settings(
    tmp_path_factory: pytest.TempPathFactory, redis_service: EmbeddedRedis, s3_service: S3Service, tiny_model_dir: Path
) -> Settings:
    return api_settings_for(tmp_path_factory.mktemp("api"), redis_service.url, s3_service, tiny_model_dir)


@pytest.fixture(scope="session")
def api_server(api_settings: Settings) -> Iterator[LiveServer]:
    server = serve(create_app(api_settings))
    yield server
    server.stop()


@pytest.fixture(scope="session")
def admin(api_server: LiveServer, api_settings: Settings) -> Iterator[httpx.Client]:
    """An HTTP client holding the admin key."""
    assert api_settings.admin_key is not None
    headers = {"Authorization": f"Bearer {api_settings.admin_key.get_secret_value()}"}
    with httpx.Client(base_url=api_server.url, headers=headers, timeout=60) as client:
        yield client


@dataclass
class TenantHandle:
    """A tenant created through the admin API, with clients that hold its key."""

    id: str
    name: str
    key: str
    base_url: str

    def openai(self, **kwargs: object) -> OpenAI:
        """The openai SDK pointed at our API (no retries unless asked: tests look at each answer)."""
        options: dict = {"max_retries": 0, "timeout": 60.0, **kwargs}
        return OpenAI(base_url=f"{self.base_url}/v1", api_key=self.key, **options)

    def http(self) -> httpx.Client:
        return httpx.Client(base_url=self.base_url, headers={"Authorization": f"Bearer {self.key}"}, timeout=60)


@pytest.fixture
def make_tenant(admin: httpx.Client, api_server: LiveServer) -> Callable[[], TenantHandle]:
    def make() -> TenantHandle:
        response = admin.post("/admin/tenants", json={"name": f"t-{uuid.uuid4().hex[:12]}"})
        assert response.status_code == 201, response.text
        body = response.json()
        return TenantHandle(id=body["id"], name=body["name"], key=body["api_key"]["key"], base_url=api_server.url)

    return make


@pytest.fixture
def tenant(make_tenant: Callable[[], TenantHandle]) -> TenantHandle:
    return make_tenant()


@pytest.fixture
def other_tenant(make_tenant: Callable[[], TenantHandle]) -> TenantHandle:
    return make_tenant()


@pytest.fixture(scope="session")
def api_server_url(api_server: LiveServer) -> str:
    return api_server.url


@dataclass(frozen=True)
class PeftAdapters:
    """PEFT-made adapters for the tiny base model, plus ones that must be refused."""

    good: Path  # r=8 on q_proj, v_proj
    wide_rank: Path  # r above TEST_MAX_LORA_RANK
    other_base: Path  # made for a base with a different hidden size
    dora: Path
    twin_base: Path  # records a base with the same shapes and other weights (core.base_fingerprint)
    made_here: Path  # records the tiny base itself


@pytest.fixture(scope="session")
def peft_adapters(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path) -> PeftAdapters:
    from core.base_fingerprint import fingerprint_base
    from core.tiny_model import TinyModelSpec, make_tiny_model
    from tests.integration.api.peft_adapters import make_peft_adapter
    from tests.integration.server.adapters import made_on

    root = tmp_path_factory.mktemp("peft-adapters")
    other_base = make_tiny_model(root / "narrow-base", TinyModelSpec(hidden=64))
    twin = make_tiny_model(root / "tiny-twin", TinyModelSpec(seed=1))
    good = make_peft_adapter(tiny_model_dir, root / "good")
    return PeftAdapters(
        good=good,
        wide_rank=make_peft_adapter(tiny_model_dir, root / "wide", r=2 * TEST_MAX_LORA_RANK),
        other_base=make_peft_adapter(other_base, root / "other-base"),
        dora=make_peft_adapter(tiny_model_dir, root / "dora", use_dora=True),
        twin_base=made_on(good, root / "twin-made", fingerprint_base(twin)),
        made_here=made_on(good, root / "made-here", fingerprint_base(tiny_model_dir, "tiny")),
    )


@pytest.fixture
def api_without_redis(api_settings: Settings) -> Iterator[str]:
    """The same API (same database and store) whose Redis is a port nothing listens on."""
    settings = api_settings.model_copy(update={"redis_url": f"redis://127.0.0.1:{free_port()}/0"})
    server = serve(create_app(settings))
    yield server.url
    server.stop()
