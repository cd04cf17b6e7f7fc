"""The object store's disk is full: uploads get a retryable 503 that names no path, nothing half-written stays
behind (no row, no object, no temporary file), and once there is room again the same uploads succeed.

The store is the local-directory one on a 2 MiB tmpfs of the test's own; a machine that does not let the test
mount one skips it, saying so.
"""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from core.local_services import EmbeddedRedis
from tests.integration.api.datasets import chat_jsonl
from tests.integration.api.peft_adapters import adapter_files
from tests.integration.api_inference.deployment import Deployment, deploy
from tests.reliability.stack import assert_retryable_outage, holdings
from tests.services import S3Service

pytestmark = pytest.mark.slow
DISK_BYTES = 2 << 20
UPLOAD = {"purpose": "fine-tune"}


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    disk = tmp_path / "disk"
    disk.mkdir()
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={DISK_BYTES}", "tmpfs", str(disk)], capture_output=True, text=True
    )
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here: {mounted.stderr.strip() or mounted.returncode}")
    try:
        yield disk
    finally:
        subprocess.run(["umount", "-l", str(disk)], check=False)


@pytest.fixture
def stack(
    tmp_path: Path, small_disk: Path, redis_service: EmbeddedRedis, s3_service: S3Service, tiny_model_dir: Path
) -> Iterator[Deployment]:
    deployment = deploy(
        tmp_path / "api", redis_service.url, s3_service, tiny_model_dir, storage_backend="local", storage_dir=small_disk
    )
    yield deployment
    deployment.stop()


def test_uploads_to_a_full_store_are_retryable_and_leave_nothing(
    stack: Deployment, small_disk: Path, peft_adapter_dir: Path
) -> None:
    tenant = stack.make_tenant()
    filler = small_disk / "filler"
    with tenant.http() as http:
        before = holdings(stack, tenant)
        filler.write_bytes(b"\0" * (DISK_BYTES - (8 << 10)))  # what is left is smaller than any upload here
        refused = [
            http.post("/v1/files", files={"file": ("t.jsonl", chat_jsonl(200))}, data=UPLOAD),
            http.post("/v1/adapters", files=adapter_files(peft_adapter_dir)),
        ]
        for response in refused:
            assert_retryable_outage(response, "storage_unavailable")
            assert str(small_disk) not in response.text
        assert holdings(stack, tenant) == before  # no row, no object
        assert list((small_disk / "tmp").iterdir()) == []  # not even a temporary file

        filler.unlink()
        file = http.post("/v1/files", files={"file": ("t.jsonl", chat_jsonl(200))}, data=UPLOAD)
        adapter = http.post("/v1/adapters", files=adapter_files(peft_adapter_dir))
        assert (file.status_code, adapter.status_code) == (200, 200), (file.text, adapter.text)
