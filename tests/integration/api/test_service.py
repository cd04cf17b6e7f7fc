"""Running the API: `loraplex api` serves it; /health and /ready say whether it and its dependencies answer."""

from __future__ import annotations

import sys
from pathlib import Path

import httpx

from core.local_services import LOOPBACK, ManagedProcess, free_port
from core.settings import Settings
from tests.integration.api.conftest import TenantHandle
from tests.integration.conftest import REPO_ROOT, settings_env


def test_health_and_readiness(api_server_url: str) -> None:
    assert httpx.get(f"{api_server_url}/health").json() == {"status": "ok"}
    assert httpx.get(f"{api_server_url}/ready").status_code == 200


def test_readiness_names_a_dependency_that_is_down(api_without_redis: str) -> None:
    health = httpx.get(f"{api_without_redis}/health")
    ready = httpx.get(f"{api_without_redis}/ready")

    assert health.status_code == 200
    assert ready.status_code == 503 and "Redis" in ready.json()["error"]["message"]
    assert "retry-after" in ready.headers


def test_loraplex_api_serves_the_same_data(api_settings: Settings, tenant: TenantHandle, tmp_path: Path) -> None:
    port = free_port()
    argv = [sys.executable, "-m", "core", "api", "--host", LOOPBACK, "--port", str(port)]
    env = {"PATH": "/usr/bin:/bin", **settings_env(api_settings)}
    process = ManagedProcess("api", argv, tmp_path / "api.log", env=env, cwd=REPO_ROOT).start()
    url = f"http://{LOOPBACK}:{port}"
    try:
        process.wait_ready(lambda: _answers(f"{url}/health"), timeout=120)
        other_process = TenantHandle(tenant.id, tenant.name, tenant.key, url)

        assert [m.id for m in other_process.openai().models.list()] == [api_settings.model_name]
        assert httpx.get(f"{url}/docs").status_code == 200
    finally:
        process.stop()


def _answers(url: str) -> bool:
    try:
        return httpx.get(url, timeout=1).status_code == 200
    except httpx.HTTPError:
        return False
