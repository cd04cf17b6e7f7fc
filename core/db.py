"""Database engines, sessions and migrations (SQLite by default, PostgreSQL unchanged)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from sqlalchemy import event
from sqlalchemy.engine import Engine, make_url
from sqlmodel import Session, create_engine

MIGRATIONS_DIR = Path(__file__).parent / "migrations"
SQLITE_BUSY_TIMEOUT_MS = 30_000
READ_ONLY_OPTION = "loraplex_read_only"


def _configure_sqlite(engine: Engine) -> None:
    @event.listens_for(engine, "connect")
    def _on_connect(dbapi_conn, _record) -> None:  # type: ignore[no-untyped-def]
        # Let SQLAlchemy, not the driver, open transactions, so "begin" below decides their kind.
        dbapi_conn.isolation_level = None
        cur = dbapi_conn.cursor()
        # WAL lets readers in other processes (API, worker, CLI) proceed while one writes; the busy
        # timeout makes a second writer wait for the lock instead of failing at once.
        cur.execute("PRAGMA journal_mode=WAL")
        cur.execute(f"PRAGMA busy_timeout={SQLITE_BUSY_TIMEOUT_MS}")
        cur.execute("PRAGMA synchronous=NORMAL")
        cur.execute("PRAGMA foreign_keys=ON")
        cur.close()

    @event.listens_for(engine, "begin")
    def _on_begin(conn) -> None:  # type: ignore[no-untyped-def]
        # A deferred transaction that reads and then writes cannot wait for the write lock (SQLite
        # returns SQLITE_BUSY at once to avoid deadlock); taking the lock up front makes it wait.
        # Read-only sessions (see read_session) stay deferred so they never queue behind writers.
        if conn.get_execution_options().get(READ_ONLY_OPTION):
            conn.exec_driver_sql("BEGIN DEFERRED")
        else:
            conn.exec_driver_sql("BEGIN IMMEDIATE")


def make_engine(url: str) -> Engine:
    """An engine for ``url``; SQLite files get WAL, a busy timeout and foreign keys."""
    parsed = make_url(url)
    if parsed.get_backend_name() == "sqlite":
        if parsed.database and parsed.database != ":memory:":
            Path(parsed.database).expanduser().parent.mkdir(parents=True, exist_ok=True)
        engine = create_engine(
            url,
            connect_args={"check_same_thread": False, "timeout": SQLITE_BUSY_TIMEOUT_MS / 1000},
            json_serializer=_json_text,
        )
        _configure_sqlite(engine)
        return engine
    if parsed.get_backend_name() == "postgresql" and parsed.get_driver_name() in ("", "psycopg2"):
        # psycopg 3 is the driver we ship; plain postgresql:// URLs should just work.
        url = parsed.set(drivername="postgresql+psycopg").render_as_string(hide_password=False)
    return create_engine(url, pool_pre_ping=True, json_serializer=_json_text)


def _json_text(value: object) -> str:
    """JSON columns as UTF-8 text, not ``\\u`` escapes: SQLite's ``json_extract`` compares a path's key with
    the stored text as written, so an escaped ``é`` in a key would never match a filter on it."""
    return json.dumps(value, ensure_ascii=False)


@contextmanager
def session_scope(engine: Engine) -> Iterator[Session]:
    """A short transaction: commits on success, rolls back on error. Keep it short: SQLite has one writer."""
    with Session(engine, expire_on_commit=False) as session:
        try:
            yield session
            session.commit()
        except BaseException:
            session.rollback()
            raise


@contextmanager
def read_session(engine: Engine) -> Iterator[Session]:
    """A transaction that only reads: on SQLite it does not take the write lock. Never write in it."""
    # Closing (not rolling back) ends the transaction without expiring what was loaded, so rows stay
    # readable after the block.
    with Session(engine.execution_options(**{READ_ONLY_OPTION: True}), expire_on_commit=False) as session:
        yield session


def _alembic_config(url: str):  # type: ignore[no-untyped-def]
    from alembic.config import Config

    cfg = Config()
    cfg.set_main_option("script_location", str(MIGRATIONS_DIR))
    cfg.set_main_option("sqlalchemy.url", url.replace("%", "%%"))
    return cfg


def upgrade(url: str, revision: str = "head") -> None:
    """Bring the schema at ``url`` up to ``revision`` (creating it from nothing if needed)."""
    from alembic import command

    command.upgrade(_alembic_config(url), revision)


def current_revision(url: str) -> str | None:
    """The migration revision the database is at, or None for an empty database."""
    from alembic.runtime.migration import MigrationContext

    engine = make_engine(url)
    try:
        with engine.connect() as conn:
            return MigrationContext.configure(conn).get_current_revision()
    finally:
        engine.dispose()


def head_revision() -> str:
    """The newest migration this code ships."""
    from alembic.script import ScriptDirectory

    return ScriptDirectory(str(MIGRATIONS_DIR)).get_current_head() or ""
