"""Alembic environment: runs migrations against the URL `core.db.upgrade` passes in."""

from __future__ import annotations

from alembic import context
from sqlmodel import SQLModel

import core.models  # noqa: F401  (registers the tables on SQLModel.metadata)
from core.db import make_engine

target_metadata = SQLModel.metadata


def run_migrations_online() -> None:
    url = context.config.get_main_option("sqlalchemy.url")
    engine = make_engine(url)
    try:
        with engine.connect() as connection:
            context.configure(
                connection=connection,
                target_metadata=target_metadata,
                # SQLite cannot ALTER most things in place; batch mode rebuilds tables instead.
                render_as_batch=connection.dialect.name == "sqlite",
                compare_type=True,
            )
            with context.begin_transaction():
                context.run_migrations()
            connection.commit()
    finally:
        engine.dispose()


if context.is_offline_mode():
    raise SystemExit("offline (SQL script) migrations are not supported; run `loraplex db upgrade`")
run_migrations_online()
