"""Adapters entering and leaving: storing an uploaded PEFT adapter with its row, and retiring one.

The object-store files always exist before the row that points at them, and are removed before the row
is marked deleted, so a live row never points at missing files.
"""

from __future__ import annotations

import logging
from pathlib import Path

from api.base_model import BaseModelInfo
from api.context import ApiContext
from api.multipart import FilePart
from core.adapter_format import (
    ADAPTER_CONFIG_FILE,
    ADAPTER_WEIGHTS_FILE,
    PICKLE_SUFFIXES,
    AdapterFileError,
    AdapterSpec,
)
from core.audit import record_deletion
from core.descriptor import adapter_prefix
from core.errors import InvalidRequest
from core.ids import now
from core.jobs import fine_tuned_model_name
from core.models import Adapter, Tenant
from core.storage import ObjectInfo, ObjectStore

log = logging.getLogger(__name__)

ADAPTER_FILES = (ADAPTER_CONFIG_FILE, ADAPTER_WEIGHTS_FILE)


def adapter_file_of(part: FilePart) -> str:
    """Which PEFT file an upload part carries (by field name, else file name); pickles are refused unread."""
    for name in (part.field, part.filename):
        if Path(name).suffix.lower() in PICKLE_SUFFIXES:
            raise AdapterFileError(
                f"{name} is a pickle file, which is never loaded: upload {ADAPTER_WEIGHTS_FILE} instead "
                "(PEFT save_pretrained(safe_serialization=True))",
                param=part.field,
            )
    for name in (part.field, part.filename):
        if name in ADAPTER_FILES:
            return name
    raise InvalidRequest(
        f"unexpected file {part.filename!r} in field {part.field!r}; send {ADAPTER_CONFIG_FILE} and "
        f"{ADAPTER_WEIGHTS_FILE}",
        param=part.field,
    )


def store_adapter_files(store: ObjectStore, prefix: str, adapter_dir: Path) -> dict[str, ObjectInfo]:
    """Upload the validated PEFT files under ``prefix``; on failure nothing is left there."""
    stored: dict[str, ObjectInfo] = {}
    try:
        for name in ADAPTER_FILES:
            stored[name] = store.put_file(prefix + name, adapter_dir / name)
    except BaseException:
        for name in stored:
            _delete_quietly(store, prefix + name)
        raise
    return stored


def _delete_quietly(store: ObjectStore, key: str) -> None:
    try:
        store.delete(key)
    except Exception:
        log.exception("could not remove %s after a failed adapter upload; the orphan sweep will", key)


def uploaded_adapter_row(
    base: BaseModelInfo,
    tenant: Tenant,
    adapter_id: str,
    spec: AdapterSpec,
    stored: dict[str, ObjectInfo],
    suffix: str | None,
) -> Adapter:
    """The row describing an uploaded adapter for ``base`` whose files are stored."""
    widest = max(spec.modules, key=lambda m: m.rank)
    adapted = {m.projection for m in spec.modules}
    return Adapter(
        id=adapter_id,
        tenant_id=tenant.id,
        name=fine_tuned_model_name(base.name, tenant.name, suffix, adapter_id),
        base_model=base.name,
        source="upload",
        storage_prefix=adapter_prefix(tenant.id, adapter_id),
        sha256=stored[ADAPTER_WEIGHTS_FILE].sha256 or "",
        config_sha256=stored[ADAPTER_CONFIG_FILE].sha256 or "",
        rank=spec.max_rank,
        alpha=widest.alpha,
        target_modules=[name for name in base.shapes.modules.names if name in adapted],
        size_bytes=sum(info.size for info in stored.values()),
        base_fingerprint=base.fingerprint.digest if base.fingerprint else None,
    )


def retire_adapter(ctx: ApiContext, adapter: Adapter) -> None:
    """Delete an adapter's files, then mark its row deleted (a store failure leaves it intact to retry),
    then ask every replica to unload it (best effort; idle adapters are evicted anyway)."""
    ctx.store.delete_prefix(adapter.storage_prefix)
    with ctx.session() as session:
        row = session.get(Adapter, adapter.id)
        if row is not None and row.deleted_at is None:
            row.deleted_at = now()
            session.add(row)
            record_deletion(session, row, cause=f"tenant:{row.tenant_id}", reason="deleted")
    ctx.announce_adapter_event("unload", adapter.descriptor(), cause=f"tenant:{adapter.tenant_id}")
