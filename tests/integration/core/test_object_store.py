"""The same behaviour from both object-store backends: local directory and S3 (SeaweedFS)."""

from __future__ import annotations

import hashlib
import io
import os
import pickle
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from core.errors import InvalidKey, ObjectNotFound, PayloadTooLarge, StorageError
from core.storage import LocalObjectStore, ObjectStore, S3ObjectStore
from tests.services import S3Service

# A writer process that uploads a 40 MB file and stops dead at its commit point, after every byte has
# gone out: S3's CompleteMultipartUpload (the parts are on the server), or the local store's renames.
FROZEN_WRITER = """
import os, sys, time
from pathlib import Path
import minio.api
from core.storage import LocalObjectStore, S3ObjectStore

def freeze(*args, **kwargs):
    print("committing", flush=True)
    time.sleep(3600)

backend, key, path, *s3 = sys.argv[1:]
if backend == "s3":
    minio.api.Minio._complete_multipart_upload = freeze
    store = S3ObjectStore(*s3)
else:
    LocalObjectStore._commit = freeze
    store = LocalObjectStore(s3[0])
store.put_file(key, Path(path))
"""


@pytest.fixture(params=["local", "s3"])
def store(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[ObjectStore]:
    if request.param == "local":
        yield LocalObjectStore(tmp_path / "objects")
        return
    s3: S3Service = request.getfixturevalue("s3_service")
    bucket = request.getfixturevalue("s3_bucket")
    yield S3ObjectStore(s3.endpoint, s3.access_key, s3.secret_key, bucket)


class FailingStream(io.RawIOBase):
    """Yields ``good`` bytes, then fails as a dropped client connection would."""

    def __init__(self, good: int) -> None:
        self.left = good

    def readable(self) -> bool:
        return True

    def read(self, n: int = -1) -> bytes:
        if self.left <= 0:
            raise ConnectionResetError("client went away")
        n = self.left if n < 0 else min(n, self.left)
        self.left -= n
        return b"x" * n


def test_bytes_round_trip_records_sha256(store: ObjectStore) -> None:
    data = b"hello \x00 world" * 100
    info = store.put_bytes("tenants/t1/files/file-1", data)
    assert info.sha256 == hashlib.sha256(data).hexdigest()
    assert store.get_bytes("tenants/t1/files/file-1") == data
    stat = store.stat("tenants/t1/files/file-1")
    assert (stat.size, stat.sha256) == (len(data), info.sha256)


def test_large_file_round_trip(store: ObjectStore, tmp_path: Path) -> None:
    src = tmp_path / "big.bin"
    src.write_bytes(os.urandom(20 * 1024 * 1024))
    info = store.put_file("tenants/t1/adapters/a1/adapter_model.safetensors", src)
    if isinstance(store, S3ObjectStore):
        # A multipart upload's ETag is "<md5 of part md5s>-<number of parts>".
        assert info.etag and info.etag.rsplit("-", 1)[-1].isdigit() and "-" in info.etag
    out = tmp_path / "out" / "copy.bin"
    got = store.get_file("tenants/t1/adapters/a1/adapter_model.safetensors", out, expected_sha256=info.sha256)
    assert got.sha256 == hashlib.sha256(src.read_bytes()).hexdigest() == info.sha256
    assert out.read_bytes() == src.read_bytes()


def test_stream_upload_and_size_cap(store: ObjectStore) -> None:
    data = os.urandom(3 * 1024 * 1024 + 7)
    info = store.put_stream("tenants/t1/files/streamed", io.BytesIO(data))
    assert info.size == len(data) and info.sha256 == hashlib.sha256(data).hexdigest()
    assert b"".join(store.iter_chunks("tenants/t1/files/streamed", chunk_size=65536)) == data
    with pytest.raises(PayloadTooLarge):
        store.put_stream("tenants/t1/files/too-big", io.BytesIO(data), max_bytes=1024 * 1024)
    assert not store.exists("tenants/t1/files/too-big")


def test_interrupted_write_leaves_no_object(store: ObjectStore) -> None:
    with pytest.raises(ConnectionResetError):
        store.put_stream("tenants/t1/files/partial", FailingStream(5 * 1024 * 1024))
    assert not store.exists("tenants/t1/files/partial")
    assert store.list("tenants/t1/") == []


def test_a_writer_killed_at_its_commit_point_leaves_no_object(
    store: ObjectStore, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    src = tmp_path / "big.bin"
    src.write_bytes(os.urandom(40 * 1024 * 1024))  # several parts on S3
    if isinstance(store, S3ObjectStore):
        s3: S3Service = request.getfixturevalue("s3_service")
        where = ["s3", s3.endpoint, s3.access_key, s3.secret_key, store.bucket]
    else:
        assert isinstance(store, LocalObjectStore)
        where = ["local", str(store.root)]
    argv = [sys.executable, "-c", FROZEN_WRITER, where[0], "tenants/t1/adapters/a1/w.safetensors", str(src), *where[1:]]
    writer = subprocess.Popen(argv, stdout=subprocess.PIPE, text=True)
    try:
        assert writer.stdout is not None and writer.stdout.readline() == "committing\n"
    finally:
        writer.kill()
        writer.wait(timeout=10)
    assert not store.exists("tenants/t1/adapters/a1/w.safetensors")
    assert store.list("tenants/") == []


def test_metadata_left_from_another_version_is_not_trusted(tmp_path: Path) -> None:
    store = LocalObjectStore(tmp_path / "objects")
    store.put_bytes("a/key", b"first version")
    # A writer that died between its two renames: new bytes in place, the old version's metadata beside them.
    tmp = store.root / "tmp" / "crashed"
    tmp.write_bytes(b"second version")
    os.replace(tmp, store.root / "data" / "a" / "key")

    want = hashlib.sha256(b"second version").hexdigest()
    assert store.stat("a/key").sha256 == want
    assert store.get_file("a/key", tmp_path / "out").sha256 == want
    assert want in (store.root / "meta" / "a" / "key.json").read_text()  # repaired for the next reader


def test_overwrite_is_whole(store: ObjectStore) -> None:
    store.put_bytes("a/key", b"first version")
    store.put_bytes("a/key", b"second")
    assert store.get_bytes("a/key") == b"second"
    assert store.stat("a/key").sha256 == hashlib.sha256(b"second").hexdigest()


def test_list_by_prefix_and_delete(store: ObjectStore) -> None:
    for key in ("tenants/a/files/f1", "tenants/a/files/f2", "tenants/a/adapters/x/cfg", "tenants/b/files/f1"):
        store.put_bytes(key, key.encode())
    assert [o.key for o in store.list("tenants/a/files/")] == ["tenants/a/files/f1", "tenants/a/files/f2"]
    assert [o.key for o in store.list("tenants/a/")] == [
        "tenants/a/adapters/x/cfg",
        "tenants/a/files/f1",
        "tenants/a/files/f2",
    ]
    assert [o.key for o in store.list("tenants/a/files/f")] == ["tenants/a/files/f1", "tenants/a/files/f2"]
    store.delete("tenants/a/files/f1")
    store.delete("tenants/a/files/f1")  # deleting twice is fine
    assert not store.exists("tenants/a/files/f1")
    assert store.delete_prefix("tenants/a/") == 2
    assert [o.key for o in store.list("")] == ["tenants/b/files/f1"]
    with pytest.raises(InvalidKey):
        store.delete_prefix("/")


def test_missing_object(store: ObjectStore, tmp_path: Path) -> None:
    with pytest.raises(ObjectNotFound):
        store.stat("nope/missing")
    with pytest.raises(ObjectNotFound):
        store.get_bytes("nope/missing")
    with pytest.raises(ObjectNotFound):
        store.get_file("nope/missing", tmp_path / "x")
    assert not (tmp_path / "x").exists()


@pytest.mark.parametrize(
    "key",
    ["", "/etc/passwd", "../escape", "a/../../b", "a//b", "a/./b", "a\\b", "a/b/", "sp ace", "nul\x00", "é"],
)
def test_bad_keys_rejected(store: ObjectStore, key: str) -> None:
    with pytest.raises(InvalidKey):
        store.put_bytes(key, b"x")
    with pytest.raises(InvalidKey):
        store.stat(key)


def test_checksum_mismatch_is_refused(store: ObjectStore, tmp_path: Path) -> None:
    store.put_bytes("a/blob", b"payload")
    with pytest.raises(StorageError, match="checksum"):
        store.get_file("a/blob", tmp_path / "blob", expected_sha256="0" * 64)
    assert not (tmp_path / "blob").exists()


def test_presigned_get(store: ObjectStore) -> None:
    store.put_bytes("a/shared", b"public bytes")
    if isinstance(store, LocalObjectStore):
        with pytest.raises(Exception, match="s3"):
            store.presigned_get("a/shared")
        return
    import httpx

    url = store.presigned_get("a/shared")
    assert httpx.get(url).content == b"public bytes"


def test_wrong_s3_credentials_give_clear_error(s3_service: S3Service, s3_bucket: str) -> None:
    bad = S3ObjectStore(s3_service.endpoint, s3_service.access_key, "not-the-secret", s3_bucket)
    with pytest.raises(StorageError, match="LORAPLEX_S3_SECRET_KEY"):
        bad.put_bytes("a/b", b"x")
    anonymous = S3ObjectStore(s3_service.endpoint, "", "", s3_bucket)
    with pytest.raises(StorageError, match="credentials"):
        anonymous.put_bytes("a/b", b"x")


def test_unreachable_s3_gives_clear_error(s3_bucket: str) -> None:
    from core.local_services import free_port

    store = S3ObjectStore(f"127.0.0.1:{free_port()}", "k", "s", s3_bucket, connect_timeout=0.5)
    with pytest.raises(StorageError, match="cannot reach S3"):
        store.ping()


def test_a_store_pickles_as_its_settings_and_reopens_the_same_objects(store: ObjectStore) -> None:
    """What the engine process receives: a store that reads what the original wrote."""
    store.put_bytes("shared/key", b"seen from another process")
    copy = pickle.loads(pickle.dumps(store))
    assert type(copy) is type(store) and copy is not store
    assert copy.get_bytes("shared/key") == b"seen from another process"


def test_a_store_subclass_refuses_to_pickle(tmp_path: Path) -> None:
    """A subclass's own state (a test's gate, say) would not come along: refused, not silently dropped."""

    class Gated(LocalObjectStore):
        pass

    with pytest.raises(TypeError, match="Gated cannot be opened in another process"):
        pickle.dumps(Gated(tmp_path / "objects"))
