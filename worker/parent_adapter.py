"""The fine-tuned model a job continues: its adapter, downloaded and verified, for training to start from.

The API checked at submission that the model is the tenant's and on this base. If the tenant deleted it
since, the job fails with a message that says so (not retried: it would fail the same way again).
"""

from __future__ import annotations

from pathlib import Path

from sqlalchemy.engine import Engine

from core.db import read_session
from core.descriptor import ADAPTER_CONFIG, ADAPTER_WEIGHTS
from core.errors import NotFound, ObjectNotFound
from core.models import Adapter, FineTuneJob
from core.storage import ObjectStore


def fetch_parent_adapter(engine: Engine, store: ObjectStore, job: FineTuneJob, dest: Path) -> Path | None:
    """Download the adapter of ``job.parent_model`` into ``dest``; None when the job starts a new adapter."""
    if job.parent_adapter_id is None:
        return None
    with read_session(engine) as session:
        parent = session.get(Adapter, job.parent_adapter_id)
    gone = NotFound(
        f"the fine-tuned model {job.parent_model!r} this job continues was deleted; create a new job",
        param="model",
        code="model_not_found",
    )
    if parent is None or parent.deleted_at is not None or parent.tenant_id != job.tenant_id:
        raise gone
    try:
        for name, sha256 in ((ADAPTER_CONFIG, parent.config_sha256), (ADAPTER_WEIGHTS, parent.sha256)):
            store.get_file(parent.storage_prefix + name, dest / name, expected_sha256=sha256)
    except ObjectNotFound:  # deleted while this attempt started
        raise gone from None
    return dest
