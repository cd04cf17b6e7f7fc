"""The object-store interface: every backend stores immutable blobs under validated keys with a sha256.

Writes are atomic: a reader sees the whole new object or nothing. Keys are portable relative paths
(``tenants/t-1/files/file-1``) that can never escape their prefix on any backend.
"""

from __future__ import annotations

import hashlib
import re
from abc import ABC, abstractmethod
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import BinaryIO

from core.errors import InvalidKey, PayloadTooLarge

CHUNK = 1024 * 1024
MAX_KEY_LENGTH = 1024
_SEGMENT_RE = re.compile(r"^[A-Za-z0-9._:=+@,-]+$")


@dataclass(frozen=True)
class ObjectInfo:
    """What a backend knows about a stored object. ``sha256`` is None in listings (S3 lists no metadata)."""

    key: str
    size: int
    sha256: str | None
    modified: float
    etag: str | None = None


def validate_key(key: str) -> str:
    """Return ``key`` if it is a safe relative object key, else raise ``InvalidKey`` saying why."""
    if not isinstance(key, str) or not key:
        raise InvalidKey("object key must be a non-empty string")
    if len(key) > MAX_KEY_LENGTH:
        raise InvalidKey(f"object key is longer than {MAX_KEY_LENGTH} characters")
    if "\\" in key:
        raise InvalidKey(f"object key {key!r} contains a backslash; use '/' between segments")
    if key.startswith("/"):
        raise InvalidKey(f"object key {key!r} is absolute; keys are relative paths")
    for segment in key.split("/"):
        if segment in ("", ".", ".."):
            raise InvalidKey(f"object key {key!r} has an empty, '.' or '..' segment")
        if not _SEGMENT_RE.match(segment):
            raise InvalidKey(f"object key {key!r} has characters outside A-Z a-z 0-9 . _ : = + @ , -")
    return key


def validate_prefix(prefix: str) -> str:
    """A listing prefix: empty, or a key optionally ending in '/'."""
    if prefix == "":
        return prefix
    validate_key(prefix.rstrip("/") or "/")
    return prefix


class HashingReader:
    """Wraps a binary stream, hashing and counting what passes through; enforces an optional size cap."""

    def __init__(self, stream: BinaryIO, max_bytes: int | None = None) -> None:
        self._stream = stream
        self._max = max_bytes
        self.sha256 = hashlib.sha256()
        self.size = 0

    def read(self, n: int = -1) -> bytes:
        data = self._stream.read(n)
        self.size += len(data)
        if self._max is not None and self.size > self._max:
            raise PayloadTooLarge(f"object is larger than the {self._max}-byte limit")
        self.sha256.update(data)
        return data


def sha256_file(path: Path) -> str:
    """Hex sha256 of a file, read in chunks."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


class ObjectStore(ABC):
    """One interface, two backends: `LocalObjectStore` (embedded) and `S3ObjectStore` (MinIO, S3)."""

    @abstractmethod
    def put_bytes(self, key: str, data: bytes, content_type: str = "application/octet-stream") -> ObjectInfo:
        """Store ``data`` under ``key`` atomically, recording its sha256."""

    @abstractmethod
    def put_file(self, key: str, path: str | Path, content_type: str = "application/octet-stream") -> ObjectInfo:
        """Store a local file under ``key`` atomically (multipart when large)."""

    @abstractmethod
    def put_stream(
        self,
        key: str,
        stream: BinaryIO,
        *,
        max_bytes: int | None = None,
        content_type: str = "application/octet-stream",
    ) -> ObjectInfo:
        """Store a stream of unknown length, never holding it whole in memory.

        Past ``max_bytes`` raises ``PayloadTooLarge``; any error leaves no object at ``key``.
        """

    @abstractmethod
    def iter_chunks(self, key: str, chunk_size: int = CHUNK) -> Iterator[bytes]:
        """Stream an object's bytes (raises ``ObjectNotFound`` before the first chunk if absent)."""

    @abstractmethod
    def stat(self, key: str) -> ObjectInfo:
        """Size, sha256 and mtime of an object; ``ObjectNotFound`` if absent."""

    @abstractmethod
    def list(self, prefix: str = "") -> list[ObjectInfo]:
        """Every object whose key starts with ``prefix``, sorted by key."""

    @abstractmethod
    def delete(self, key: str) -> None:
        """Remove an object; absent objects are not an error."""

    @abstractmethod
    def presigned_get(self, key: str, expires: timedelta = timedelta(hours=1)) -> str:
        """A URL anyone can GET the object from until it expires."""

    @abstractmethod
    def ping(self) -> None:
        """Check the store is reachable and usable; raise ``StorageError`` saying what to fix."""

    # Conveniences built on the primitives above.

    def get_bytes(self, key: str) -> bytes:
        """The whole object in memory (only for small objects: configs, manifests)."""
        return b"".join(self.iter_chunks(key))

    def get_file(self, key: str, path: str | Path, expected_sha256: str | None = None) -> ObjectInfo:
        """Download to ``path`` atomically, verifying the sha256 recorded at upload (and ``expected_sha256``)."""
        from core.errors import StorageError

        info = self.stat(key)
        dest = Path(path)
        dest.parent.mkdir(parents=True, exist_ok=True)
        tmp = dest.with_name(f".{dest.name}.part")
        digest = hashlib.sha256()
        try:
            with open(tmp, "wb") as f:
                for chunk in self.iter_chunks(key):
                    digest.update(chunk)
                    f.write(chunk)
            actual = digest.hexdigest()
            for wanted in (info.sha256, expected_sha256):
                if wanted and wanted != actual:
                    raise StorageError(f"object {key} failed its checksum: sha256 {actual}, expected {wanted}")
            tmp.replace(dest)
        finally:
            tmp.unlink(missing_ok=True)
        return ObjectInfo(key=key, size=info.size, sha256=actual, modified=info.modified, etag=info.etag)

    def exists(self, key: str) -> bool:
        """Whether an object is stored under ``key``."""
        from core.errors import ObjectNotFound

        try:
            self.stat(key)
        except ObjectNotFound:
            return False
        return True

    def delete_prefix(self, prefix: str) -> int:
        """Remove every object under ``prefix``; returns how many there were."""
        if not prefix.strip("/"):
            raise InvalidKey("refusing to delete the whole store: give a non-empty prefix")
        objects = self.list(prefix)
        for obj in objects:
            self.delete(obj.key)
        return len(objects)
