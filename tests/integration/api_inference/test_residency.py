"""Adapter residency that servers report on the Redis stream becomes page-seconds in the usage report, for
the adapter's tenant, counted once even with two API processes reading the stream."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from api.app import create_app
from api.background.streams import GROUP_PREFIX
from core.local_services import EmbeddedRedis
from core.protocol import RESIDENCY_STREAM
from tests.integration.api.live_server import serve
from tests.integration.api_inference.deployment import Deployment, deploy
from tests.integration.api_inference.serving import upload_adapter
from tests.services import S3Service

pytestmark = pytest.mark.slow


@pytest.fixture
def two_apis(
    tmp_path: Path, redis_service: EmbeddedRedis, s3_service: S3Service, tiny_model_dir: Path
) -> Iterator[Deployment]:
    """An API deployment (no replicas needed) plus a second API process on the same database and Redis."""
    deployment = deploy(tmp_path, redis_service.url, s3_service, tiny_model_dir)
    second = serve(create_app(deployment.settings))
    yield deployment
    second.stop()
    deployment.stop()


def test_residency_is_metered_once_for_the_adapters_tenant(two_apis: Deployment, peft_adapter_dir: Path) -> None:
    tenant = two_apis.make_tenant()
    adapter = upload_adapter(tenant, peft_adapter_dir)
    entry_ids = []
    for i in range(40):  # what two servers would report over a few heartbeats
        fields = {
            "adapter_id": adapter["id"],
            "page_seconds": "1.25",
            "replica": f"replica-{i % 2}",
            "at": "1700000000",
        }
        entry_ids.append(two_apis.redis.xadd(RESIDENCY_STREAM, fields))
    two_apis.redis.xadd(RESIDENCY_STREAM, {"adapter_id": "adapter-of-nobody", "page_seconds": "5", "at": "1700000000"})
    last = two_apis.redis.xadd(RESIDENCY_STREAM, {"adapter_id": adapter["id"], "page_seconds": "not a number"})
    group = GROUP_PREFIX + two_apis.base_model

    def all_acknowledged() -> bool:
        [info] = [g for g in two_apis.redis.xinfo_groups(RESIDENCY_STREAM) if g["name"].decode() == group]
        return info["pending"] == 0 and _id(info["last-delivered-id"]) >= _id(last)

    two_apis.wait_until(all_acknowledged, "both API processes to store and acknowledge every entry")
    with two_apis.admin() as admin:
        report = admin.get("/admin/usage", params={"group_by": "adapter", "from": "2023-11-14"}).json()
    [row] = [r for r in report["data"] if r["adapter_id"] == adapter["id"]]
    assert row["residency_page_seconds"] == 40 * 1.25
    assert row["tenant_id"] == tenant.id
    assert report["totals"]["residency_page_seconds"] == 40 * 1.25  # the unknown adapter's entry is not counted
    records = two_apis.usage_records(tenant.id, kind="residency")
    assert {r.replica for r in records} == {"replica-0", "replica-1"}
    assert {r.created_at for r in records} == {1700000000}


def _id(entry_id: bytes) -> tuple[int, int]:
    millis, seq = entry_id.decode().split("-")
    return int(millis), int(seq)
