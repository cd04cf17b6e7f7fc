"""Everything a request handler reaches: settings, database, object store, job queue, base model.

Built once per app by :func:`build_context` (nothing at module level) and reached through the
dependencies in ``api/deps.py``. Part 2 adds its clients (Redis, replica router) here.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from sqlalchemy.engine import Engine
from sqlmodel import Session, SQLModel

from api.base_model import BaseModelInfo, load_base_model
from api.job_queue import JobQueue
from core.db import make_engine, read_session, session_scope
from core.queue import make_celery
from core.settings import Settings
from core.storage import ObjectStore, open_store

log = logging.getLogger(__name__)


@dataclass
class ApiContext:
    """The long-lived resources of one API process."""

    settings: Settings
    engine: Engine
    store: ObjectStore
    jobs: JobQueue
    base_model: BaseModelInfo

    @contextmanager
    def session(self) -> Iterator[Session]:
        """A short transaction. Never hold one across network I/O: SQLite lets one writer in at a time."""
        with session_scope(self.engine) as session:
            yield session

    @contextmanager
    def reading(self) -> Iterator[Session]:
        """A read-only transaction: on SQLite it does not queue behind writers. Never write in it."""
        with read_session(self.engine) as session:
            yield session

    def insert_or_undo(self, row: SQLModel, undo: Callable[[], None]) -> None:
        """Insert ``row`` for objects already stored; if that fails, ``undo`` removes them before re-raising,
        so the store never keeps bytes no row points at."""
        try:
            with self.session() as session:
                session.add(row)
        except BaseException:
            try:
                undo()
            except Exception:  # keep the original error; the leftover objects are only logged
                log.exception("could not remove the objects of a row that was not inserted")
            raise

    def close(self) -> None:
        """Release connections (at shutdown)."""
        self.jobs.close()
        self.engine.dispose()


def build_context(settings: Settings) -> ApiContext:
    """Create the clients from settings; raises ``ConfigError`` naming a missing or bad setting.

    Nothing here connects yet, so the API starts even while Redis or S3 are down and answers 503 until
    they return.
    """
    base_model = load_base_model(settings)
    return ApiContext(
        settings=settings,
        engine=make_engine(settings.db_url),
        store=open_store(settings),
        jobs=JobQueue(make_celery(settings)),
        base_model=base_model,
    )
