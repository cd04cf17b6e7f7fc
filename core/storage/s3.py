"""Object store on S3 through the `minio` SDK (MinIO in production, SeaweedFS in tests).

An S3 PUT (single or multipart) is atomic: the object appears only when the upload completes, so
readers never see half of one. Streams of unknown length are spooled to a local temp file while
hashed, then uploaded with their sha256 in the object's metadata.
"""

from __future__ import annotations

import hashlib
import io
import tempfile
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import BinaryIO

import urllib3
from minio import Minio
from minio.error import S3Error

from core.errors import ObjectNotFound, StorageError
from core.storage.base import CHUNK, HashingReader, ObjectInfo, ObjectStore, sha256_file, validate_key, validate_prefix

SHA_META = "sha256"  # stored as x-amz-meta-sha256
PART_SIZE = 16 * 1024 * 1024
_CREDENTIAL_CODES = {"InvalidAccessKeyId", "SignatureDoesNotMatch", "AccessDenied", "InvalidToken"}


class S3ObjectStore(ObjectStore):
    """Objects in one bucket; created on first use when missing."""

    def __init__(
        self,
        endpoint: str,
        access_key: str,
        secret_key: str,
        bucket: str,
        *,
        secure: bool = False,
        region: str | None = None,
        connect_timeout: float = 5.0,
        read_timeout: float = 120.0,
    ) -> None:
        self.endpoint = endpoint
        self.bucket = bucket
        # What ``__reduce__`` needs to open the same store in another process (the engine's).
        self._opening = ((endpoint, access_key, secret_key, bucket),
                         {"secure": secure, "region": region, "connect_timeout": connect_timeout,
                          "read_timeout": read_timeout})  # fmt: skip
        # Few, quick retries: when S3 is down the caller should hear so in seconds, not minutes.
        http = urllib3.PoolManager(
            timeout=urllib3.Timeout(connect=connect_timeout, read=read_timeout),
            retries=urllib3.Retry(total=2, backoff_factor=0.2, status_forcelist=(500, 502, 503, 504)),
            maxsize=16,
        )
        self._client = Minio(
            endpoint, access_key=access_key, secret_key=secret_key, secure=secure, region=region, http_client=http
        )
        self._bucket_ready = False

    def __reduce__(self) -> tuple:
        """Pickles as its settings (the client's connection pool stays behind): the engine process opens its own."""
        if type(self) is not S3ObjectStore:  # a subclass's own state (a test's gate, say) would not come along
            raise TypeError(f"{type(self).__name__} cannot be opened in another process")
        args, kwargs = self._opening
        return _reopen, (args, kwargs)

    # -- error translation -------------------------------------------------------------------

    def _fail(self, exc: Exception, key: str | None = None) -> Exception:
        if isinstance(exc, S3Error):
            if exc.code in ("NoSuchKey", "NoSuchObject") and key is not None:
                return ObjectNotFound(f"no object {key}")
            if exc.code in _CREDENTIAL_CODES:
                return StorageError(
                    f"S3 at {self.endpoint} rejected our credentials ({exc.code}): check "
                    "LORAPLEX_S3_ACCESS_KEY and LORAPLEX_S3_SECRET_KEY"
                )
            if exc.code == "NoSuchBucket":
                return StorageError(f"S3 bucket {self.bucket!r} does not exist (LORAPLEX_S3_BUCKET)")
            return StorageError(f"S3 error {exc.code} on {key or self.bucket}: {exc.message}")
        if isinstance(exc, (urllib3.exceptions.HTTPError, OSError)):
            return StorageError(f"cannot reach S3 at {self.endpoint} (LORAPLEX_S3_ENDPOINT): {exc}")
        return exc

    def _ensure_bucket(self) -> None:
        if self._bucket_ready:
            return
        try:
            if not self._client.bucket_exists(self.bucket):
                try:
                    self._client.make_bucket(self.bucket)
                except S3Error as exc:
                    # Another process may have created it between our check and our create.
                    if exc.code not in ("BucketAlreadyOwnedByYou", "BucketAlreadyExists"):
                        raise
        except Exception as exc:
            raise self._fail(exc) from exc
        self._bucket_ready = True

    # -- writes -------------------------------------------------------------------------------

    def put_bytes(self, key: str, data: bytes, content_type: str = "application/octet-stream") -> ObjectInfo:
        validate_key(key)
        self._ensure_bucket()
        sha = hashlib.sha256(data).hexdigest()
        try:
            result = self._client.put_object(
                self.bucket,
                key,
                io.BytesIO(data),
                len(data),
                content_type=content_type,
                metadata={SHA_META: sha},
                part_size=PART_SIZE,
            )
        except Exception as exc:
            raise self._fail(exc, key) from exc
        return ObjectInfo(key=key, size=len(data), sha256=sha, modified=0.0, etag=result.etag)

    def put_file(self, key: str, path: str | Path, content_type: str = "application/octet-stream") -> ObjectInfo:
        validate_key(key)
        self._ensure_bucket()
        path = Path(path)
        sha = sha256_file(path)
        size = path.stat().st_size
        try:
            # fput_object switches to multipart above the part size; parts upload in parallel.
            result = self._client.fput_object(
                self.bucket, key, str(path), content_type=content_type, metadata={SHA_META: sha}, part_size=PART_SIZE
            )
        except Exception as exc:
            raise self._fail(exc, key) from exc
        return ObjectInfo(key=key, size=size, sha256=sha, modified=0.0, etag=result.etag)

    def put_stream(
        self,
        key: str,
        stream: BinaryIO,
        *,
        max_bytes: int | None = None,
        content_type: str = "application/octet-stream",
    ) -> ObjectInfo:
        validate_key(key)
        with tempfile.TemporaryDirectory(prefix="loraplex-upload-") as tmp:
            spool = Path(tmp) / "object"
            reader = HashingReader(stream, max_bytes)
            with open(spool, "wb") as f:
                while chunk := reader.read(CHUNK):
                    f.write(chunk)
            return self.put_file(key, spool, content_type=content_type)

    # -- reads --------------------------------------------------------------------------------

    def iter_chunks(self, key: str, chunk_size: int = CHUNK) -> Iterator[bytes]:
        validate_key(key)
        self._ensure_bucket()
        try:
            response = self._client.get_object(self.bucket, key)
        except Exception as exc:
            raise self._fail(exc, key) from exc

        def chunks() -> Iterator[bytes]:
            try:
                yield from response.stream(chunk_size)
            except Exception as exc:
                raise self._fail(exc, key) from exc
            finally:
                response.close()
                response.release_conn()

        return chunks()

    def stat(self, key: str) -> ObjectInfo:
        validate_key(key)
        self._ensure_bucket()
        try:
            st = self._client.stat_object(self.bucket, key)
        except Exception as exc:
            raise self._fail(exc, key) from exc
        meta = st.metadata or {}
        sha = meta.get(f"x-amz-meta-{SHA_META}") or meta.get(f"X-Amz-Meta-{SHA_META.capitalize()}")
        modified = st.last_modified.timestamp() if st.last_modified else 0.0
        return ObjectInfo(key=key, size=st.size or 0, sha256=sha, modified=modified, etag=st.etag)

    def list(self, prefix: str = "") -> list[ObjectInfo]:
        validate_prefix(prefix)
        self._ensure_bucket()
        try:
            objects = [
                ObjectInfo(
                    key=o.object_name,
                    size=o.size or 0,
                    sha256=None,
                    modified=o.last_modified.timestamp() if o.last_modified else 0.0,
                    etag=o.etag,
                )
                for o in self._client.list_objects(self.bucket, prefix=prefix or None, recursive=True)
                if not o.is_dir
            ]
        except Exception as exc:
            raise self._fail(exc) from exc
        return sorted(objects, key=lambda o: o.key)

    def delete(self, key: str) -> None:
        validate_key(key)
        try:
            self._client.remove_object(self.bucket, key)
        except S3Error as exc:
            if exc.code not in ("NoSuchKey", "NoSuchObject"):
                raise self._fail(exc, key) from exc
        except Exception as exc:
            raise self._fail(exc, key) from exc

    def presigned_get(self, key: str, expires: timedelta = timedelta(hours=1)) -> str:
        validate_key(key)
        try:
            return self._client.presigned_get_object(self.bucket, key, expires=expires)
        except Exception as exc:
            raise self._fail(exc, key) from exc

    def ping(self) -> None:
        self._bucket_ready = False
        self._ensure_bucket()


def _reopen(args: tuple, kwargs: dict) -> S3ObjectStore:
    return S3ObjectStore(*args, **kwargs)
