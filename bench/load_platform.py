"""The platform a soak runs against, on loopback: the API and the inference servers as their own processes
(so each one's memory can be watched), over real Redis and S3, with tenants and their adapters uploaded
through the API the way clients bring them.

Redis and S3 are started here unless given (the CI test passes the session's). Adapters are variants of
one PEFT adapter (same shapes, new values): distinct adapters to the servers, made in milliseconds.
"""

from __future__ import annotations

import os
import sys
import time
import uuid
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from core.local_services import LOOPBACK, EmbeddedRedis, ManagedProcess, free_port, start_redis
from core.settings import ENV_PREFIX, Settings
from tests.integration.api.conftest import api_settings_for
from tests.integration.api.peft_adapters import adapter_files, make_peft_adapter
from tests.integration.api_inference.deployment import Replica, launch_replica
from tests.integration.conftest import REPO_ROOT, launch_worker, settings_env
from tests.integration.server.adapters import variant
from tests.services import S3Service, start_seaweed_s3

START_TIMEOUT_S = 180.0


@dataclass(frozen=True)
class PlatformShape:
    """How big a platform to stand up."""

    adapters: int = 20  # spread over the tenants
    resident: int = 4  # adapters each server's pool holds at once
    replicas: int = 2
    tenants: int = 4
    limited_rpm: int = 300  # the first tenant's requests per minute (the others are unlimited): it meets 429s
    max_waiting: int = 64  # requests a server queues before answering 429
    worker: bool = False  # a training worker, so fine-tuning jobs run beside the serving


@dataclass(frozen=True)
class Tenant:
    name: str
    key: str
    models: tuple[str, ...]  # its adapters' model names
    limited: bool


@dataclass
class SoakPlatform:
    settings: Settings
    api_url: str
    tenants: list[Tenant]
    processes: dict[str, ManagedProcess] = field(default_factory=dict)  # whose memory the soak bounds
    stores: dict[str, ManagedProcess] = field(default_factory=dict)  # Redis, S3: memory reported, not bounded
    replicas: list[Replica] = field(default_factory=list)
    restart: Callable[[int], Replica] | None = None  # kill replica n as a crash would and start it again

    @property
    def base_model(self) -> str:
        return self.settings.model_name or ""

    def crash_and_restart(self, n: int) -> float:
        """SIGKILL replica ``n``, start a new one under the same id, and return once it serves: seconds taken.
        Its memory is watched from then on (the restarted process is another one)."""
        assert self.restart is not None
        began = time.monotonic()
        old = self.replicas[n]
        old.process.kill()
        self.replicas[n] = self.restart(n)
        self.processes[old.id] = self.replicas[n].process
        return time.monotonic() - began


def start_platform(
    stack: ExitStack,
    workdir: Path,
    model_dir: Path,
    shape: PlatformShape,
    *,
    redis: EmbeddedRedis | None = None,
    s3: S3Service | None = None,
) -> SoakPlatform:
    """Start everything under ``stack`` (closing it stops all) and return the platform once it serves."""
    stores: dict[str, ManagedProcess] = {}
    if redis is None:
        redis = start_redis(workdir / "redis")
        stack.callback(redis.stop)
        stores["redis"] = redis.process
    if s3 is None:
        s3 = start_seaweed_s3(workdir / "seaweed")
        stack.callback(s3.stop)
        stores["seaweedfs"] = s3.process
    settings = api_settings_for(
        workdir / "api",
        redis.url,
        s3,
        model_dir,
        base_model_name=f"soak-{uuid.uuid4().hex[:8]}",
        internal_token="int-" + uuid.uuid4().hex,
        default_requests_per_minute=0,
        default_tokens_per_minute=0,
        rate_limit_burst_seconds=2.0,
        log_level="warning",
    )
    api_url, api = _start_api(stack, settings, workdir)
    replicas = [_start_replica(stack, settings, model_dir, workdir, shape, n) for n in range(shape.replicas)]
    _wait_until_serving(api, api_url, replicas, settings)
    watched = {"api": api, **{r.id: r.process for r in replicas}}
    if shape.worker:
        watched["worker"] = launch_worker(settings, workdir / "worker.log")
        stack.callback(watched["worker"].stop)
    tenants = _make_tenants(settings, api_url, model_dir, workdir, shape)

    def restart(n: int) -> Replica:
        replica = _start_replica(stack, settings, model_dir, workdir, shape, n)
        _wait_until_serving(api, api_url, [replica], settings)
        return replica

    return SoakPlatform(settings, api_url, tenants, watched, stores, replicas, restart)


def _start_api(stack: ExitStack, settings: Settings, workdir: Path) -> tuple[str, ManagedProcess]:
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith(ENV_PREFIX)}
    env.update({**settings_env(settings), "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"})
    argv = [sys.executable, "-m", "core", "api", "--host", LOOPBACK, "--port", str(port)]
    api = ManagedProcess("api", argv, workdir / "api.log", env=env, cwd=REPO_ROOT).start()
    stack.callback(api.stop)
    return f"http://{LOOPBACK}:{port}", api


def _start_replica(
    stack: ExitStack, settings: Settings, model_dir: Path, workdir: Path, shape: PlatformShape, n: int
) -> Replica:
    flags = ["--max-resident-adapters", str(shape.resident), "--max-waiting", str(shape.max_waiting)]
    replica = launch_replica(settings, model_dir, f"soak-replica-{n}", workdir, flags)
    stack.callback(replica.process.stop)
    return replica


def _wait_until_serving(api: ManagedProcess, api_url: str, replicas: list[Replica], settings: Settings) -> None:
    token = settings.internal_token.get_secret_value() if settings.internal_token else ""
    for replica in replicas:
        ready = f"{replica.url}/ready"
        replica.process.wait_ready(lambda u=ready: _answers(u, token), timeout=START_TIMEOUT_S)
    api.wait_ready(lambda: _answers(f"{api_url}/ready", None), timeout=START_TIMEOUT_S)


def _answers(url: str, token: str | None) -> bool:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    try:
        return httpx.get(url, headers=headers, timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def _make_tenants(
    settings: Settings, api_url: str, model_dir: Path, workdir: Path, shape: PlatformShape
) -> list[Tenant]:
    assert settings.admin_key is not None
    source = make_peft_adapter(model_dir, workdir / "peft", r=4)
    admin = httpx.Client(base_url=api_url, headers={"Authorization": f"Bearer {settings.admin_key.get_secret_value()}"})
    tenants = []
    with admin:
        for t in range(shape.tenants):
            created = admin.post("/admin/tenants", json={"name": f"soak-{t}-{uuid.uuid4().hex[:6]}"})
            created.raise_for_status()
            body = created.json()
            limited = t == 0
            if limited:
                limits = {"requests_per_minute": shape.limited_rpm, "tokens_per_minute": None}
                admin.put(f"/admin/tenants/{body['id']}/limits", json=limits).raise_for_status()
            key = body["api_key"]["key"]
            models = []
            with httpx.Client(base_url=api_url, headers={"Authorization": f"Bearer {key}"}, timeout=60) as http:
                for a in range(t, shape.adapters, shape.tenants):
                    adapter_dir = variant(source, workdir / "adapters" / f"adapter-{a:02d}", seed=a)
                    uploaded = http.post("/v1/adapters", files=adapter_files(adapter_dir), data={"suffix": f"a{a}"})
                    uploaded.raise_for_status()
                    models.append(uploaded.json()["model"])
            tenants.append(Tenant(body["name"], key, tuple(models), limited))
    return tenants
