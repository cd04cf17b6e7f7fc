"""Put an adapter directory into the object store so that it is either all there and verified, or absent.

The manifest goes last: its presence means every file it lists was uploaded before it, which is how a
re-delivered job recognises an adapter that a previous attempt finished uploading.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from core.descriptor import ADAPTER_CONFIG, ADAPTER_MANIFEST, ADAPTER_WEIGHTS
from core.errors import ObjectNotFound, StorageError
from core.models import Adapter, FineTuneJob
from core.storage import ObjectStore

log = logging.getLogger(__name__)
CONTENT_TYPES = {ADAPTER_CONFIG: "application/json", ADAPTER_MANIFEST: "application/json"}


@dataclass(frozen=True)
class UploadedAdapter:
    """An adapter whose files are all in the store under ``prefix`` with the sha256s of ``manifest``."""

    prefix: str
    manifest: dict[str, Any]

    @property
    def weights_sha256(self) -> str:
        return self.manifest["files"][ADAPTER_WEIGHTS]["sha256"]

    @property
    def config_sha256(self) -> str:
        return self.manifest["files"][ADAPTER_CONFIG]["sha256"]

    @property
    def size_bytes(self) -> int:
        return sum(int(meta["bytes"]) for meta in self.manifest["files"].values())

    def adapter_row(self, adapter_id: str, job: FineTuneJob, name: str, source: str) -> Adapter:
        """The ``Adapter`` row of these stored files, trained by ``job`` and called ``name``."""
        return Adapter(
            id=adapter_id,
            tenant_id=job.tenant_id,
            name=name,
            base_model=job.base_model,
            source=source,
            job_id=job.id,
            storage_prefix=self.prefix,
            sha256=self.weights_sha256,
            config_sha256=self.config_sha256,
            rank=int(self.manifest["rank"]),
            alpha=float(self.manifest["alpha"]),
            target_modules=list(self.manifest["target_modules"]),
            size_bytes=self.size_bytes,
            base_fingerprint=self.manifest.get("base_model", {}).get("fingerprint"),
        )


def _verify(store: ObjectStore, prefix: str, manifest: dict[str, Any]) -> None:
    for name, meta in manifest["files"].items():
        info = store.stat(prefix + name)
        if info.sha256 != meta["sha256"] or info.size != int(meta["bytes"]):
            raise StorageError(f"stored {prefix + name} does not match the adapter (sha256 {info.sha256})")


def upload_adapter(store: ObjectStore, adapter_dir: Path, prefix: str) -> UploadedAdapter:
    """Upload every file, manifest last, and check each stored sha256; on any error remove them all."""
    manifest = json.loads((adapter_dir / ADAPTER_MANIFEST).read_text())
    try:
        # Leftovers of an attempt that died mid-upload would otherwise sit beside the new files.
        store.delete_prefix(prefix)
        for name in (*manifest["files"], ADAPTER_MANIFEST):
            store.put_file(prefix + name, adapter_dir / name, CONTENT_TYPES.get(name, "application/octet-stream"))
        _verify(store, prefix, manifest)
    except BaseException:
        remove_adapter_objects(store, prefix)
        raise
    return UploadedAdapter(prefix, manifest)


def find_uploaded_adapter(store: ObjectStore, prefix: str) -> UploadedAdapter | None:
    """The adapter a previous attempt fully uploaded under ``prefix``, or None if it is absent or partial."""
    try:
        manifest = json.loads(store.get_bytes(prefix + ADAPTER_MANIFEST))
        _verify(store, prefix, manifest)
    except (ObjectNotFound, StorageError, ValueError, KeyError):
        return None
    return UploadedAdapter(prefix, manifest)


def remove_adapter_objects(store: ObjectStore, prefix: str) -> None:
    """Best-effort removal of everything under ``prefix`` (logged, never raised: we are already failing)."""
    try:
        store.delete_prefix(prefix)
    except Exception:
        log.exception("could not remove adapter objects under %s; the orphan sweep will", prefix)
