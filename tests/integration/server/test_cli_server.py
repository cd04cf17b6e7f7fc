"""``loraplex server`` as the platform runs it: a separate process configured by ``LORAPLEX_*`` (S3, Redis,
internal token), registering itself in Redis, metering adapter residency, taking the control plane's
prefetch and unload calls, and deregistering when stopped; and exiting with the reason when its engine cannot
start, so that a supervisor learns why."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import httpx
import psutil
import pytest
import redis
from openai import APIError, OpenAI

from core.local_services import LOOPBACK, EmbeddedRedis, ManagedProcess, free_port
from core.protocol import ADAPTER_FIELD, RESIDENCY_STREAM, STATS_FIELD, ReplicaStatus, replica_key
from core.storage import S3ObjectStore
from tests.integration.server.adapters import upload, variant
from tests.integration.server.harness import wait_until
from tests.services import S3Service

REPO_ROOT = Path(__file__).resolve().parents[3]
TOKEN = "cli-internal-token"


def test_the_server_command_registers_meters_and_deregisters(
    tiny_model_dir: Path, peft_dir: Path, tmp_path: Path, redis_service: EmbeddedRedis, s3_service: S3Service,
    s3_store: S3ObjectStore,
) -> None:  # fmt: skip
    port = free_port()
    replica = "replica-cli-test"
    advertised = f"http://{LOOPBACK}:{port}"
    env = {k: v for k, v in os.environ.items() if not k.startswith("LORAPLEX_")}
    env.update({
        "LORAPLEX_STORAGE_BACKEND": "s3", "LORAPLEX_S3_ENDPOINT": s3_service.endpoint,
        "LORAPLEX_S3_ACCESS_KEY": s3_service.access_key, "LORAPLEX_S3_SECRET_KEY": s3_service.secret_key,
        "LORAPLEX_S3_BUCKET": s3_store.bucket, "LORAPLEX_REDIS_URL": redis_service.url,
        "LORAPLEX_INTERNAL_TOKEN": TOKEN, "LORAPLEX_DATA_DIR": str(tmp_path / "data"),
        "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1",
    })  # fmt: skip
    argv = [
        sys.executable, "-m", "core", "server", "--model", str(tiny_model_dir), "--host", LOOPBACK,
        "--port", str(port), "--pool-bytes", str(4 << 20), "--max-model-len", "512", "--replica-id", replica,
        "--advertise-url", advertised, "--heartbeat-s", "0.2", "--threads", "1",
    ]  # fmt: skip
    process = ManagedProcess("server", argv, tmp_path / "server.log", env=env, cwd=REPO_ROOT).start()
    client = redis.Redis.from_url(redis_service.url)
    try:
        process.wait_ready(lambda: _ready(advertised), timeout=120)
        assert httpx.get(f"{advertised}/health").status_code == 200
        assert httpx.get(f"{advertised}/v1/models").status_code == 401

        status = ReplicaStatus.model_validate_json(client.get(replica_key(replica)))
        assert status.url == advertised and status.base_model == tiny_model_dir.name
        assert 0 < client.ttl(replica_key(replica)) <= 10
        assert status.pool.free == status.pool.total > 0

        adapter = upload(s3_store, variant(peft_dir, tmp_path / "a", seed=21), tiny_model_dir.name)
        openai = OpenAI(base_url=f"{advertised}/v1", api_key=TOKEN, max_retries=0)
        answer = openai.completions.create(
            model=adapter.name, prompt="hello", max_tokens=3, extra_body={ADAPTER_FIELD: adapter.model_dump()}
        )
        assert getattr(answer, STATS_FIELD)["replica"] == replica

        def resident() -> ReplicaStatus | None:
            current = ReplicaStatus.model_validate_json(client.get(replica_key(replica)))
            return current if adapter.id in current.resident_adapters else None

        assert wait_until(resident, "the heartbeat to list the adapter").pool.adapter > 0

        def metered() -> float:
            entries = client.xrange(RESIDENCY_STREAM)
            return sum(float(f[b"page_seconds"]) for _, f in entries if f[b"adapter_id"].decode() == adapter.id)

        wait_until(lambda: metered() > 0, "residency page-seconds for the adapter")

        # What the control plane does when a job finishes (prefetch) and when an adapter is deleted (unload).
        fresh = upload(s3_store, variant(peft_dir, tmp_path / "b", seed=22), tiny_model_dir.name)
        with httpx.Client(base_url=advertised, headers={"Authorization": f"Bearer {TOKEN}"}) as http:
            prefetch = {"lora_name": fresh.name, "adapter": fresh.model_dump(mode="json")}
            assert http.post("/v1/load_lora_adapter", json=prefetch).status_code == 200
            assert http.post("/v1/unload_lora_adapter", json={"lora_name": adapter.name}).status_code == 200

        def moved() -> bool:
            current = ReplicaStatus.model_validate_json(client.get(replica_key(replica)))
            held = current.resident_adapters + current.host_adapters
            return fresh.id in current.resident_adapters and adapter.id not in held

        wait_until(moved, "the heartbeat to show the prefetched adapter and not the deleted one")
    finally:
        process.stop()
    assert client.get(replica_key(replica)) is None, process.log_tail()


def test_a_server_whose_engine_cannot_start_exits_naming_the_problem(tiny_model_dir: Path, tmp_path: Path) -> None:
    model = Path(shutil.copytree(tiny_model_dir, tmp_path / "odd-model"))
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, "model_type": "gpt_neox"}))
    env = {k: v for k, v in os.environ.items() if not k.startswith("LORAPLEX_")}
    env.update({"LORAPLEX_DATA_DIR": str(tmp_path / "data"), "OMP_NUM_THREADS": "1", "COLUMNS": "250"})
    argv = [
        sys.executable, "-m", "core", "server", "--model", str(model), "--host", LOOPBACK,
        "--port", str(free_port()), "--pool-bytes", str(4 << 20), "--threads", "1",
    ]  # fmt: skip
    done = subprocess.run(argv, env=env, cwd=REPO_ROOT, capture_output=True, text=True, timeout=120)
    output = " ".join((done.stdout + done.stderr).split())
    assert done.returncode == 2, output  # a configuration error: restarting it would not help
    assert "error: the engine failed to start: model_type 'gpt_neox'" in output


def _ready(url: str) -> bool:
    try:
        return httpx.get(f"{url}/ready", headers={"Authorization": f"Bearer {TOKEN}"}, timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def test_a_tensor_parallel_server_whose_rank_dies_ends_its_streams_and_exits(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    """``--tensor-parallel-size 2`` serves through two ranks (gloo). When rank 1 is killed, the open stream ends
    with an error at once instead of hanging, readiness goes, and the server exits non-zero within seconds, for its
    supervisor to start it again."""
    port = free_port()
    url = f"http://{LOOPBACK}:{port}"
    env = {k: v for k, v in os.environ.items() if not k.startswith("LORAPLEX_")}
    env.update({"LORAPLEX_DATA_DIR": str(tmp_path / "data"), "LORAPLEX_INTERNAL_TOKEN": TOKEN,
                "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "COLUMNS": "250"})  # fmt: skip
    argv = [
        sys.executable, "-m", "core", "server", "--model", str(tiny_model_dir), "--host", LOOPBACK,
        "--port", str(port), "--pool-bytes", str(4 << 20), "--max-model-len", "512", "--threads", "1",
        "--tensor-parallel-size", "2",
    ]  # fmt: skip
    process = ManagedProcess("tp-server", argv, tmp_path / "server.log", env=env, cwd=REPO_ROOT).start()
    try:
        process.wait_ready(lambda: _ready(url), timeout=120)
        client = OpenAI(base_url=f"{url}/v1", api_key=TOKEN, max_retries=0, timeout=60)
        model = tiny_model_dir.name
        one = client.completions.create(model=model, prompt="hello", max_tokens=4, temperature=0)
        assert one.choices[0].text

        def children(proc: psutil.Process, running: str) -> list[psutil.Process]:
            return [c for c in proc.children() if running in " ".join(c.cmdline())]

        (engine,) = children(psutil.Process(process.pid), "spawn_main")
        (rank1,) = children(engine, "server.parallel.follower")
        stream = client.completions.create(
            model=model, prompt="hello", max_tokens=400, stream=True, extra_body={"ignore_eos": True}
        )
        chunks = iter(stream)
        next(chunks)
        rank1.kill()
        with pytest.raises(APIError):
            for _ in chunks:
                pass
        exit_code = process.proc.wait(timeout=60)
    finally:
        process.stop()
    log = process.log_tail()
    assert exit_code == 1, log
    assert "error: the engine stopped" in " ".join(log.split()) and "tensor-parallel" in log, log
