"""Migrations create the schema from nothing (SQLite and PostgreSQL); processes share SQLite safely."""

from __future__ import annotations

import multiprocessing
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
from sqlalchemy import inspect, text
from sqlmodel import SQLModel, func, select

from core import db
from core.accounts import authenticate, create_tenant, revoke_api_key
from core.errors import AuthenticationFailed, Conflict
from core.ids import new_id
from core.jobs import with_metadata
from core.models import ApiKey, FineTuneJob, Tenant, UsageRecord

TABLES = {"tenant", "api_key", "file", "fine_tune_job", "job_event", "adapter", "usage_record"}


def _check_schema(url: str) -> None:
    db.upgrade(url)
    assert db.current_revision(url) == db.head_revision()
    engine = db.make_engine(url)
    try:
        inspector = inspect(engine)
        assert set(inspector.get_table_names()) >= TABLES
        for table in SQLModel.metadata.sorted_tables:  # every model column has its migration
            assert {c["name"] for c in inspector.get_columns(table.name)} == set(table.columns.keys()), table.name
        indexed = {tuple(ix["column_names"]) for ix in inspector.get_indexes("fine_tune_job")}
        assert ("tenant_id", "created_at") in indexed
        with db.session_scope(engine) as session:
            tenant, key = create_tenant(session, "acme")
        with db.session_scope(engine) as session:
            assert authenticate(session, key).id == tenant.id
            stored = session.exec(select(ApiKey)).one()
            assert key not in (stored.key_hash, stored.prefix) and stored.prefix == key[:12]
    finally:
        engine.dispose()
    db.upgrade(url)  # idempotent


def test_migrations_on_empty_sqlite(tmp_path: Path) -> None:
    _check_schema(f"sqlite:///{tmp_path / 'sub' / 'loraplex.db'}")


@pytest.mark.postgres
def test_migrations_on_empty_postgres(postgres_url: str) -> None:
    _check_schema(postgres_url)


def _check_metadata_filter(url: str) -> None:
    db.upgrade(url)
    engine = db.make_engine(url)
    try:
        with db.session_scope(engine) as session:
            tenant, _ = create_tenant(session, f"meta-{uuid.uuid4().hex[:8]}")
            tagged = {
                "a": {"team": "search", "run": "1"},
                "b": {"team": "ads"},
                "c": None,
                "d": {"équipe": "référencement"},
            }
            ids = {new_id("ftjob"): name for name in tagged}
            for job_id, name in ids.items():
                session.add(FineTuneJob(id=job_id, tenant_id=tenant.id, base_model="m", training_file="f",
                                        user_metadata=tagged[name]))  # fmt: skip

        def found(pairs: dict[str, str] | None) -> set[str]:
            stmt = with_metadata(select(FineTuneJob).where(FineTuneJob.tenant_id == tenant.id), pairs)
            with db.read_session(engine) as session:
                return {ids[job.id] for job in session.exec(stmt).all()}

        assert found({"team": "search"}) == {"a"}
        assert found({"team": "search", "run": "1"}) == {"a"}
        assert found({"team": "search", "run": "2"}) == set()
        assert found({"run": "1"}) == {"a"}
        assert found(None) == {"c"}  # no metadata is SQL NULL, not a JSON null
        assert found({"équipe": "référencement"}) == {"d"}  # stored as UTF-8 text, not \u escapes
    finally:
        engine.dispose()


def test_jobs_filter_by_metadata_on_sqlite(tmp_path: Path) -> None:
    _check_metadata_filter(f"sqlite:///{tmp_path / 'loraplex.db'}")


@pytest.mark.postgres
def test_jobs_filter_by_metadata_on_postgres(postgres_url: str) -> None:
    _check_metadata_filter(postgres_url)


def test_usage_rows_written_before_cached_tokens_count_none(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'loraplex.db'}"
    db.upgrade(url, "0002")
    engine = db.make_engine(url)
    try:
        with engine.begin() as conn:
            conn.execute(text(
                "INSERT INTO usage_record (tenant_id, kind, prompt_tokens, completion_tokens, training_tokens, "
                "compute_seconds, gpu_seconds, page_seconds, cold_start, created_at) "
                "VALUES ('t', 'inference', 7, 3, 0, 0, 0, 0, 0, 1)"
            ))  # fmt: skip
        db.upgrade(url)
        with db.session_scope(engine) as session:
            row = session.exec(select(UsageRecord)).one()
            assert (row.prompt_tokens, row.cached_tokens, row.completion_tokens) == (7, 0, 3)
    finally:
        engine.dispose()


def test_cli_db_upgrade(tmp_path: Path) -> None:
    env = {"LORAPLEX_DATA_DIR": str(tmp_path), "PATH": str(Path(sys.executable).parent)}
    out = subprocess.run(["loraplex", "db", "upgrade"], env=env, capture_output=True, text=True, check=True)
    assert f"revision {db.head_revision()}" in out.stderr
    assert db.current_revision(f"sqlite:///{tmp_path / 'loraplex.db'}") == db.head_revision()


def test_keys_revoke_and_duplicate_names(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'x.db'}"
    db.upgrade(url)
    engine = db.make_engine(url)
    with db.session_scope(engine) as session:
        _, key = create_tenant(session, "acme")
    with pytest.raises(Conflict), db.session_scope(engine) as session:
        create_tenant(session, "acme")
    with db.session_scope(engine) as session:
        key_row = session.exec(select(ApiKey)).one()
        revoke_api_key(session, key_row.id)
    with pytest.raises(AuthenticationFailed, match="revoked"), db.session_scope(engine) as session:
        authenticate(session, key)
    with pytest.raises(AuthenticationFailed), db.session_scope(engine) as session:
        authenticate(session, "lpx-not-a-key")


def _writer(url: str, worker: int, count: int) -> None:
    engine = db.make_engine(url)
    for i in range(count):
        # Read-then-write in one transaction: the pattern that fails with "database is locked" when
        # transactions start deferred and another process commits in between.
        with db.session_scope(engine) as session:
            n = session.exec(select(func.count()).select_from(Tenant)).one()
            session.add(Tenant(id=f"tenant-{worker}-{i}", name=f"w{worker}-{i}-{n}"))
    engine.dispose()


def test_two_processes_write_sqlite_concurrently(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'shared.db'}"
    db.upgrade(url)
    ctx = multiprocessing.get_context("spawn")
    procs = [ctx.Process(target=_writer, args=(url, w, 150)) for w in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=300)
    assert [p.exitcode for p in procs] == [0, 0]
    engine = db.make_engine(url)
    with db.session_scope(engine) as session:
        assert session.exec(select(func.count()).select_from(Tenant)).one() == 300


def test_read_session_does_not_wait_for_a_writer(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'r.db'}"
    db.upgrade(url)
    engine = db.make_engine(url)
    with db.session_scope(engine) as session:
        create_tenant(session, "reader")
    with db.session_scope(engine) as writer:
        writer.add(Tenant(id="tenant-w", name="writer"))
        writer.flush()  # the write lock is held until this block ends
        with db.read_session(engine) as reader:
            # A second immediate transaction would block here for the busy timeout; a read does not.
            names = {t.name for t in reader.exec(select(Tenant)).all()}
        assert names == {"reader"}
