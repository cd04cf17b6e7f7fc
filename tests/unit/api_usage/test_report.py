"""Usage reports over a real (SQLite) database: grouping, storage held at the end of a period, exports."""

from __future__ import annotations

import csv
import io
from collections.abc import Iterator
from pathlib import Path

import pytest
from sqlalchemy.engine import Engine

from api.usage.export import report_csv, report_json
from api.usage.period import DAY, Period, parse_period
from api.usage.report import build_report
from core import db
from core.errors import InvalidRequest
from core.models import Adapter, File, FineTuneJob, Tenant, UsageRecord

D0 = 1_700_006_400  # a UTC midnight
BASE = "tiny"


def record(tenant: str, kind: str, at: int, **fields: object) -> UsageRecord:
    return UsageRecord(tenant_id=tenant, kind=kind, created_at=at, **fields)


def adapter(adapter_id: str, tenant: str, size: int, deleted_at: int | None) -> Adapter:
    return Adapter(
        id=adapter_id,
        tenant_id=tenant,
        name=f"ft:{BASE}:{tenant}:x:{adapter_id}",
        base_model=BASE,
        storage_prefix="p/",
        sha256="s",
        config_sha256="c",
        rank=4,
        alpha=8.0,
        size_bytes=size,
        created_at=D0,
        deleted_at=deleted_at,
    )


@pytest.fixture
def engine(tmp_path: Path) -> Iterator[Engine]:
    url = f"sqlite:///{tmp_path / 'usage.db'}"
    db.upgrade(url)
    engine = db.make_engine(url)
    with db.session_scope(engine) as s:
        s.add_all([Tenant(id="tenant-a", name="acme"), Tenant(id="tenant-b", name="bolt")])
        s.flush()  # rows below point at the tenants
        s.add(FineTuneJob(id="ftjob-1", tenant_id="tenant-a", base_model=BASE, training_file="file-1"))
        s.add(File(id="file-1", tenant_id="tenant-a", filename="t.jsonl", purpose="fine-tune", bytes=1000,
                   sha256="x", storage_key="k", created_at=D0 - 10))  # fmt: skip
        s.add_all([adapter("adapter-1", "tenant-a", 300, None), adapter("adapter-2", "tenant-b", 50, D0 + DAY + 5)])
        s.add_all(
            [
                record("tenant-a", "inference", D0 + 1, adapter_id="adapter-1", prompt_tokens=10,
                       completion_tokens=5, gpu_seconds=0.5, cold_start=True, status="completed"),
                record("tenant-a", "inference", D0 + DAY + 1, prompt_tokens=3, completion_tokens=1,
                       status="client_disconnected"),
                record("tenant-b", "inference", D0 + 2, adapter_id="adapter-2", prompt_tokens=7,
                       completion_tokens=7, status="completed"),
                record("tenant-a", "training", D0, adapter_id="adapter-1", job_id="ftjob-1", training_tokens=400,
                       compute_seconds=12.5),
                record("tenant-b", "residency", D0 + 3, adapter_id="adapter-2", page_seconds=99.5),
                record("tenant-a", "inference", D0 + 3 * DAY, prompt_tokens=1000),  # after the period
            ]
        )  # fmt: skip
    yield engine
    engine.dispose()


PERIOD = Period(D0, D0 + 2 * DAY)  # the last record (day 3) is outside


def report(engine: Engine, group_by: str, **kw: object):  # type: ignore[no-untyped-def]
    with db.read_session(engine) as session:
        return build_report(session, PERIOD, group_by, base_model=BASE, **kw)  # type: ignore[arg-type]


def test_per_tenant_rows_sum_their_records_and_hold_storage_at_the_end(engine: Engine) -> None:
    rows = {r.labels["tenant"]: r.metrics for r in report(engine, "tenant").rows}
    acme, bolt = rows["acme"], rows["bolt"]
    assert (acme.requests, acme.failed_requests, acme.prompt_tokens, acme.completion_tokens) == (2, 1, 13, 6)
    assert (acme.training_tokens, acme.job_compute_seconds, acme.cold_starts, acme.gpu_seconds) == (400, 12.5, 1, 0.5)
    assert acme.storage_bytes == 1300  # its file and its adapter
    assert (bolt.requests, bolt.residency_page_seconds) == (1, 99.5)
    assert bolt.storage_bytes == 0  # its adapter was deleted before the period ended


def test_totals_are_the_sum_of_the_rows(engine: Engine) -> None:
    rep = report(engine, "adapter")
    assert rep.totals.prompt_tokens == sum(r.metrics.prompt_tokens for r in rep.rows) == 20
    assert rep.totals.requests == 3
    assert rep.totals.storage_bytes == 1300


def test_per_adapter_rows_name_models_and_show_the_base_model(engine: Engine) -> None:
    rows = {r.labels["model"]: (r.labels, r.metrics) for r in report(engine, "adapter").rows}
    assert set(rows) == {BASE, f"ft:{BASE}:tenant-a:x:adapter-1", f"ft:{BASE}:tenant-b:x:adapter-2"}
    labels, metrics = rows[f"ft:{BASE}:tenant-a:x:adapter-1"]
    assert labels["tenant"] == "acme" and metrics.storage_bytes == 300 and metrics.training_tokens == 400
    assert rows[BASE][1].prompt_tokens == 3


def test_per_day_rows_cover_every_day_and_storage_follows_deletions(engine: Engine) -> None:
    rows = report(engine, "day").rows
    assert [r.labels["day"] for r in rows] == ["2023-11-15", "2023-11-16"]
    assert [r.metrics.prompt_tokens for r in rows] == [17, 3]
    assert [r.metrics.storage_bytes for r in rows] == [1350, 1300]  # adapter-2 deleted during day two


def test_a_tenant_sees_only_its_own_usage(engine: Engine) -> None:
    rep = report(engine, "adapter", tenant_id="tenant-b")
    assert [r.labels["tenant"] for r in rep.rows] == ["bolt"]
    assert rep.totals.prompt_tokens == 7


@pytest.mark.parametrize("group_by", ["tenant", "adapter", "day"])
def test_csv_and_json_carry_the_same_rows(engine: Engine, group_by: str) -> None:
    rep = report(engine, group_by)
    data = report_json(rep)["data"]
    rows = list(csv.DictReader(io.StringIO(report_csv(rep))))
    assert len(rows) == len(data)
    for line, obj in zip(rows, data, strict=True):
        assert set(line) == set(obj)
        for key, value in obj.items():
            assert line[key] == ("" if value is None else str(value))


def test_periods_accept_unix_seconds_and_iso_dates() -> None:
    assert parse_period("2023-11-15", "2023-11-17") == Period(D0, D0 + 2 * DAY)
    assert parse_period(str(D0), "2023-11-15T12:00:00Z") == Period(D0, D0 + DAY // 2)
    for start, end in (("2023-11-17", "2023-11-15"), ("yesterday", None)):
        with pytest.raises(InvalidRequest):
            parse_period(start, end)
