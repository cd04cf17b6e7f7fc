"""Object storage: one interface (`ObjectStore`), a local-directory and an S3 backend."""

from __future__ import annotations

from core.settings import Settings
from core.storage.base import ObjectInfo, ObjectStore, sha256_file, validate_key
from core.storage.local import LocalObjectStore
from core.storage.s3 import S3ObjectStore

__all__ = [
    "LocalObjectStore",
    "ObjectInfo",
    "ObjectStore",
    "S3ObjectStore",
    "open_store",
    "sha256_file",
    "validate_key",
]


def open_store(settings: Settings) -> ObjectStore:
    """The object store the settings describe."""
    if settings.storage_backend == "s3":
        assert settings.s3_endpoint and settings.s3_access_key and settings.s3_secret_key  # checked by Settings
        return S3ObjectStore(
            settings.s3_endpoint,
            settings.s3_access_key,
            settings.s3_secret_key.get_secret_value(),
            settings.s3_bucket,
            secure=settings.s3_secure,
            region=settings.s3_region,
        )
    return LocalObjectStore(settings.objects_dir)
