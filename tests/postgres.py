"""Throwaway PostgreSQL databases on the server ``LORAPLEX_TEST_POSTGRES_URL`` names (tests that need one skip
when it is not set): created fresh, dropped afterwards however the test ended."""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import pytest
from sqlalchemy import Engine, create_engine, make_url, text


@dataclass(frozen=True)
class ThrowawayDatabase:
    url: str  # for the platform (psycopg driver)
    name: str
    admin: Engine  # connected to the server's maintenance database, autocommit: for ALTER/DROP DATABASE


@contextmanager
def throwaway_database(prefix: str) -> Iterator[ThrowawayDatabase]:
    base = os.environ.get("LORAPLEX_TEST_POSTGRES_URL")
    if not base:
        pytest.skip("LORAPLEX_TEST_POSTGRES_URL is not set")
    admin_url = make_url(base).set(drivername="postgresql+psycopg")
    name = f"{prefix}_{uuid.uuid4().hex[:12]}"
    admin = create_engine(admin_url, isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.execute(text(f'CREATE DATABASE "{name}"'))
    try:
        yield ThrowawayDatabase(admin_url.set(database=name).render_as_string(hide_password=False), name, admin)
    finally:
        with admin.connect() as conn:
            conn.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
        admin.dispose()
