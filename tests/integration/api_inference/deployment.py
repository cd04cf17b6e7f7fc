"""A whole serving path on loopback: the API (uvicorn in a thread), real ``loraplex server`` replicas
(subprocesses on the tiny model), real Redis and S3, and optionally a real training worker."""

from __future__ import annotations

import os
import sys
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

import httpx
import pytest
import redis
from sqlalchemy.engine import Engine
from sqlmodel import col, select

from api.app import create_app
from core import db
from core.local_services import LOOPBACK, ManagedProcess, free_port
from core.models import UsageRecord
from core.protocol import REPLICA_KEY_PREFIX, ReplicaStatus, replica_key
from core.settings import ENV_PREFIX, Settings
from tests.integration.api.conftest import TenantHandle, api_settings_for
from tests.integration.api.live_server import LiveServer, serve
from tests.integration.conftest import REPO_ROOT, settings_env
from tests.services import S3Service

T = TypeVar("T")
POOL_BYTES = 64 << 20  # plenty for the tiny model's KV cache and a few adapters


@dataclass
class Replica:
    """One ``loraplex server`` process."""

    id: str
    port: int
    process: ManagedProcess

    @property
    def url(self) -> str:
        return f"http://{LOOPBACK}:{self.port}"


def launch_replica(
    settings: Settings, model_dir: Path, replica_id: str, log_dir: Path, extra_args: Sequence[str] = ()
) -> Replica:
    """Start a server for ``settings``' base model name, Redis, object store and internal token; ``extra_args``
    are more ``loraplex server`` flags (e.g. ``--max-resident-adapters``)."""
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith(ENV_PREFIX)}
    env.update(settings_env(settings))
    env.update({"PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"})  # see launch_worker: threads thrash here
    argv = [sys.executable, "-m", "core", "server", "--model", str(model_dir), "--host", LOOPBACK, "--port", str(port)]
    argv += ["--replica-id", replica_id, "--pool-bytes", str(POOL_BYTES), "--threads", "1", *extra_args]
    process = ManagedProcess(replica_id, argv, log_dir / f"{replica_id}.log", env=env, cwd=REPO_ROOT).start()
    return Replica(replica_id, port, process)


def wait_until(probe: Callable[[], T | None], what: str, *, timeout: float = 120.0, logs: list[ManagedProcess]) -> T:
    """Poll ``probe`` until it returns something truthy; fail with the processes' log tails otherwise."""
    deadline = time.monotonic() + timeout
    while True:
        value = probe()
        if value:
            return value
        dead = [p for p in logs if not p.alive()]
        if dead or time.monotonic() > deadline:
            tails = "\n\n".join(f"--- {p.name} ---\n{p.log_tail(40)}" for p in logs)
            pytest.fail(f"{'a process exited' if dead else 'timed out'} waiting for {what}\n{tails}")
        time.sleep(0.1)  # polling interval; the loop waits on the probe, not on time


@dataclass
class Deployment:
    settings: Settings
    api: LiveServer
    engine: Engine
    redis: redis.Redis
    replicas: dict[str, Replica] = field(default_factory=dict)
    processes: list[ManagedProcess] = field(default_factory=list)

    @property
    def base_model(self) -> str:
        return self.settings.model_name or ""

    def admin(self) -> httpx.Client:
        assert self.settings.admin_key is not None
        headers = {"Authorization": f"Bearer {self.settings.admin_key.get_secret_value()}"}
        return httpx.Client(base_url=self.api.url, headers=headers, timeout=60)

    def make_tenant(self, **limits: float | None) -> TenantHandle:
        """A new tenant; ``limits`` (requests_per_minute, tokens_per_minute, scheduling_weight) set its own."""
        with self.admin() as admin:
            created = admin.post("/admin/tenants", json={"name": f"t-{uuid.uuid4().hex[:12]}"})
            assert created.status_code == 201, created.text
            body = created.json()
            if limits:
                update = {"requests_per_minute": None, "tokens_per_minute": None, "scheduling_weight": None, **limits}
                assert admin.put(f"/admin/tenants/{body['id']}/limits", json=update).status_code == 200
        return TenantHandle(body["id"], body["name"], body["api_key"]["key"], self.api.url)

    def start_replicas(self, model_dir: Path, ids: list[str], log_dir: Path) -> None:
        """Start replicas in parallel and wait until each heartbeats."""
        for replica_id in ids:
            replica = launch_replica(self.settings, model_dir, replica_id, log_dir)
            self.replicas[replica_id] = replica
            self.processes.append(replica.process)
        self.wait_until(lambda: all(self.redis.exists(replica_key(r)) for r in ids), f"replicas {ids} to register")

    def replica_metric(self, replica_id: str, name: str) -> float:
        """A replica's unlabelled Prometheus sample ``name`` (``loraplex_requests_running``, ...)."""
        token = self.settings.internal_token.get_secret_value() if self.settings.internal_token else ""
        url = f"{self.replicas[replica_id].url}/metrics"
        metrics = httpx.get(url, headers={"Authorization": f"Bearer {token}"}, timeout=10).text
        [line] = [line for line in metrics.splitlines() if line.startswith(f"{name} ")]
        return float(line.split()[1])

    def heartbeats(self) -> dict[str, ReplicaStatus]:
        """Live replicas of this deployment's base model, by id."""
        statuses = {}
        for key in self.redis.scan_iter(match=REPLICA_KEY_PREFIX + "*"):
            value = self.redis.get(key)
            if value is not None:
                status = ReplicaStatus.model_validate_json(value)
                if status.base_model == self.base_model:
                    statuses[status.id] = status
        return statuses

    def usage_records(self, tenant_id: str, kind: str = "inference") -> list[UsageRecord]:
        with db.read_session(self.engine) as session:
            stmt = select(UsageRecord).where(UsageRecord.tenant_id == tenant_id, UsageRecord.kind == kind)
            return list(session.exec(stmt.order_by(col(UsageRecord.id))).all())

    def wait_until(self, probe: Callable[[], T | None], what: str, *, timeout: float = 120.0) -> T:
        return wait_until(probe, what, timeout=timeout, logs=self.processes)

    def audit(self, **filters: str) -> list[dict]:
        """Every ``/admin/audit`` event matching ``filters``, oldest first (following the pages)."""
        events: list[dict] = []
        params: dict[str, str | int] = {**filters, "limit": 100}
        with self.admin() as admin:
            while True:
                page = admin.get("/admin/audit", params=params)
                assert page.status_code == 200, page.text
                body = page.json()
                events += body["data"]
                if not body["has_more"]:
                    return events[::-1]
                params["after"] = body["last_id"]

    def wait_for_audit(self, what: str, wanted: Callable[[list[dict]], bool], **filters: str) -> list[dict]:
        """The audit events matching ``filters`` once ``wanted`` holds for them (replicas send them each beat)."""
        return self.wait_until(lambda: (events := self.audit(**filters)) and wanted(events) and events, what)

    def kill_replica(self, replica_id: str) -> None:
        """SIGKILL one replica, as a crash would. Its process leaves ``processes``: later waits must not take
        this intended death for a crash (they fail at once when a watched process has exited)."""
        process = self.replicas[replica_id].process
        process.kill()
        self.processes.remove(process)

    def stop(self) -> None:
        for process in self.processes:
            process.stop()
        self.api.stop()
        self.redis.close()
        self.engine.dispose()


def deploy(workdir: Path, redis_url: str, s3: S3Service, model_dir: Path, **overrides: object) -> Deployment:
    """An API with its own database, bucket and base model name (so its own replicas and queue)."""
    values: dict[str, object] = {
        "base_model_name": f"tiny-{uuid.uuid4().hex[:8]}",
        "internal_token": "int-" + uuid.uuid4().hex,
        # Limits are off unless a test sets a tenant's own; bursts are short so refills take seconds.
        "default_requests_per_minute": 0,
        "default_tokens_per_minute": 0,
        "rate_limit_burst_seconds": 2.0,
    }
    values.update(overrides)
    settings = api_settings_for(workdir, redis_url, s3, model_dir, **values)
    return Deployment(
        settings=settings,
        api=serve(create_app(settings)),
        engine=db.make_engine(settings.db_url),
        redis=redis.Redis.from_url(redis_url),
    )
