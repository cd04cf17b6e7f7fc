"""Object store in a local directory: the embedded default.

Layout under the root: ``data/<key>`` holds the bytes, ``meta/<key>.json`` the sha256 and size,
``tmp/`` the files being written. A write goes to ``tmp/`` first and is renamed into place, so a
reader never sees half an object.

Two renames cannot be one atomic step, so the metadata names the data file it describes (inode, size,
mtime): data is renamed in first, then its metadata. A reader that finds metadata naming another file (an
overwrite in progress, or a writer that died between the renames) hashes the data itself and repairs the
metadata, so a checksum never disagrees with the bytes it is read beside.
"""

from __future__ import annotations

import contextlib
import json
import os
import uuid
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import BinaryIO

from core.errors import InvalidRequest, ObjectNotFound, StorageError
from core.storage.base import CHUNK, HashingReader, ObjectInfo, ObjectStore, validate_key, validate_prefix


class LocalObjectStore(ObjectStore):
    """Objects as files under ``root``; safe to share between processes on one machine."""

    def __init__(self, root: str | Path) -> None:
        self.root = Path(root).expanduser().resolve()
        self._data = self.root / "data"
        self._meta = self.root / "meta"
        self._tmp = self.root / "tmp"
        try:
            for d in (self._data, self._meta, self._tmp):
                d.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise StorageError(f"cannot create the object store at {self.root} (LORAPLEX_STORAGE_DIR): {exc}") from exc

    def __reduce__(self) -> tuple:
        """Pickles as its root: the engine process opens the same directory."""
        if type(self) is not LocalObjectStore:
            raise TypeError(f"{type(self).__name__} cannot be opened in another process")
        return LocalObjectStore, (self.root,)

    def _paths(self, key: str) -> tuple[Path, Path]:
        validate_key(key)
        return self._data / key, self._meta / f"{key}.json"

    def _commit(self, key: str, tmp_data: Path, sha256: str, size: int) -> ObjectInfo:
        data_path, meta_path = self._paths(key)
        data_path.parent.mkdir(parents=True, exist_ok=True)
        st = tmp_data.stat()  # a rename keeps inode and mtime, so this identifies the committed file
        os.replace(tmp_data, data_path)
        self._write_meta(meta_path, sha256, st)
        return ObjectInfo(key=key, size=size, sha256=sha256, modified=st.st_mtime)

    def _write_meta(self, meta_path: Path, sha256: str, st: os.stat_result) -> None:
        tmp_meta = self._tmp / f"{uuid.uuid4().hex}.json"
        tmp_meta.write_text(json.dumps({"sha256": sha256, **_file_identity(st)}))
        meta_path.parent.mkdir(parents=True, exist_ok=True)
        os.replace(tmp_meta, meta_path)

    def _sha256_of(self, data_path: Path, meta_path: Path, st: os.stat_result) -> str | None:
        """The data file's sha256: from its metadata when that describes this very file, else hashed now
        (and the metadata repaired)."""
        try:
            meta = json.loads(meta_path.read_text())
        except (FileNotFoundError, ValueError):
            meta = {}
        if (
            isinstance(meta, dict)
            and meta.get("sha256")
            and all(meta.get(name) == value for name, value in _file_identity(st).items())
        ):
            return str(meta["sha256"])
        try:
            with open(data_path, "rb") as f:
                reader = HashingReader(f)
                while reader.read(CHUNK):
                    pass
                hashed = os.fstat(f.fileno())  # the file we read, even if another was renamed in since
        except FileNotFoundError:
            return None
        sha256 = reader.sha256.hexdigest()
        with contextlib.suppress(OSError):  # a read-only store still answers; the next reader hashes again
            self._write_meta(meta_path, sha256, hashed)
        return sha256 if _file_identity(hashed) == _file_identity(st) else None

    def _write(self, key: str, reader: HashingReader) -> ObjectInfo:
        validate_key(key)
        tmp = self._tmp / uuid.uuid4().hex
        try:
            with self._disk(key):
                f = open(tmp, "wb")  # noqa: SIM115 (closed below, whichever side fails)
            with f:
                # The source's own errors (a client that went away) pass through as they are.
                while chunk := reader.read(CHUNK):
                    with self._disk(key):
                        f.write(chunk)
                with self._disk(key):
                    f.flush()
                    os.fsync(f.fileno())
            with self._disk(key):
                return self._commit(key, tmp, reader.sha256.hexdigest(), reader.size)
        finally:
            tmp.unlink(missing_ok=True)

    @contextlib.contextmanager
    def _disk(self, key: str) -> Iterator[None]:
        """A full or read-only disk is retryable, like an S3 outage (and the caller leaves nothing behind)."""
        try:
            yield
        except OSError as exc:
            raise StorageError(f"the object store at {self.root} could not store {key}: {exc.strerror or exc}") from exc

    def put_bytes(self, key: str, data: bytes, content_type: str = "application/octet-stream") -> ObjectInfo:
        import io

        return self._write(key, HashingReader(io.BytesIO(data)))

    def put_file(self, key: str, path: str | Path, content_type: str = "application/octet-stream") -> ObjectInfo:
        with open(path, "rb") as f:
            return self._write(key, HashingReader(f))

    def put_stream(
        self,
        key: str,
        stream: BinaryIO,
        *,
        max_bytes: int | None = None,
        content_type: str = "application/octet-stream",
    ) -> ObjectInfo:
        return self._write(key, HashingReader(stream, max_bytes))

    def iter_chunks(self, key: str, chunk_size: int = CHUNK) -> Iterator[bytes]:
        data_path, _ = self._paths(key)
        try:
            f = open(data_path, "rb")  # noqa: SIM115 (closed by the generator below)
        except (FileNotFoundError, IsADirectoryError):
            raise ObjectNotFound(f"no object {key}") from None

        def chunks() -> Iterator[bytes]:
            with f:
                while chunk := f.read(chunk_size):
                    yield chunk

        return chunks()

    def stat(self, key: str) -> ObjectInfo:
        data_path, meta_path = self._paths(key)
        try:
            st = data_path.stat()
        except FileNotFoundError:
            raise ObjectNotFound(f"no object {key}") from None
        if not data_path.is_file():
            raise ObjectNotFound(f"no object {key}")
        sha256 = self._sha256_of(data_path, meta_path, st)
        return ObjectInfo(key=key, size=st.st_size, sha256=sha256, modified=st.st_mtime)

    def list(self, prefix: str = "") -> list[ObjectInfo]:
        validate_prefix(prefix)
        # Walk only the deepest directory the prefix names, then filter by the full prefix.
        base = self._data / prefix.rsplit("/", 1)[0] if "/" in prefix else self._data
        if not base.is_dir():
            return []
        found = []
        for dirpath, _dirs, files in os.walk(base):
            for name in files:
                key = Path(dirpath, name).relative_to(self._data).as_posix()
                if key.startswith(prefix):
                    found.append(self.stat(key))
        return sorted(found, key=lambda o: o.key)

    def delete(self, key: str) -> None:
        data_path, meta_path = self._paths(key)
        data_path.unlink(missing_ok=True)
        meta_path.unlink(missing_ok=True)
        # Drop directories the delete emptied so listings and disk usage stay tidy.
        for top, path in ((self._data, data_path), (self._meta, meta_path)):
            parent = path.parent
            while parent != top:
                try:
                    parent.rmdir()
                except OSError:
                    break
                parent = parent.parent

    def presigned_get(self, key: str, expires: timedelta = timedelta(hours=1)) -> str:
        raise InvalidRequest("presigned URLs need the s3 storage backend (LORAPLEX_STORAGE_BACKEND=s3)")

    def ping(self) -> None:
        probe = self._tmp / f"ping-{uuid.uuid4().hex}"
        try:
            probe.write_bytes(b"ok")
            probe.unlink()
        except OSError as exc:
            raise StorageError(f"object store at {self.root} is not writable: {exc}") from exc


def _file_identity(st: os.stat_result) -> dict[str, int]:
    """What tells one version of a data file from another: a new write is a new inode and mtime."""
    return {"inode": st.st_ino, "size": st.st_size, "mtime_ns": st.st_mtime_ns}
