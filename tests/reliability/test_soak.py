"""The short soak CI runs: ``bench/load.py``'s platform and clients at a small size. Many adapters on pools
that hold few, streamed and not, one tenant rate limited: every request succeeds or gets a 429 with
``retry-after``, every adapter is served, and no process grows past the bound after its warm-up.

The long soak is the same code run by hand (``python bench/load.py --minutes 5``)."""

from __future__ import annotations

from contextlib import ExitStack
from pathlib import Path

import pytest

from bench.load import soak
from bench.load_clients import OK, RATE_LIMITED
from bench.load_platform import PlatformShape, start_platform
from bench.load_report import RssBound
from core.local_services import EmbeddedRedis
from tests.services import S3Service

pytestmark = pytest.mark.slow

# Six adapters on two replicas whose pools take two each: adapters keep being evicted and reloaded.
SHAPE = PlatformShape(adapters=6, resident=2, replicas=2, tenants=3, limited_rpm=60)
CLIENTS = 8


def test_a_short_soak_serves_every_request_or_asks_it_to_retry(
    tmp_path: Path, redis_service: EmbeddedRedis, s3_service: S3Service, tiny_model_dir: Path
) -> None:
    with ExitStack() as stack:
        platform = start_platform(stack, tmp_path, tiny_model_dir, SHAPE, redis=redis_service, s3=s3_service)
        report = soak(platform, duration_s=20, clients=CLIENTS, warmup_s=10, seed=7, bound=RssBound())
    print(report.render())

    assert not report.errors, report.render()
    kinds = report.kinds
    assert kinds[OK] > 0 and kinds[RATE_LIMITED] > 0, kinds  # the limited tenant met its limit, others did not
    served = {o.model for o in [*report.warmup, *report.outcomes] if o.kind == OK and o.on_adapter}
    assert served == {m for t in platform.tenants for m in t.models}  # every adapter, though pools hold two
    assert report.ok, report.render()  # memory within the bound too
