"""Bring an adapter's weights into host RAM: download (object store) or read (local directory), verify, parse.

Runs on the loader's threads, never on the engine's. Nothing is unpickled: store objects are checked
against the descriptor's sha256 and must parse as safetensors; local directories holding pickle files
are refused by ``core.adapter_format``. Config and tensor shapes are checked against the base model
before a tensor is read, and the base the adapter was made on (``core.base_fingerprint``: the one its
descriptor records and the one its weights file records) must be this server's.
"""

from __future__ import annotations

import hashlib
import tempfile
from dataclasses import dataclass
from pathlib import Path

from core.adapter_format import (
    ADAPTER_CONFIG_FILE,
    ADAPTER_WEIGHTS_FILE,
    MAX_CONFIG_BYTES,
    AdapterConfigError,
    AdapterFileError,
    AdapterWeights,
    BaseShapes,
    inspect_adapter,
    load_adapter_weights,
)
from core.base_fingerprint import BaseFingerprint, check_origin, check_recorded, read_adapter_origin
from core.projections import PROJECTIONS
from core.storage import ObjectStore
from server.adapters.errors import AdapterChecksumMismatch, AdapterTooLarge
from server.adapters.sources import AdapterSource, LocalSource, resolve_local

HEADER_SLACK_BYTES = 1 << 20
PICKLE_MAGIC = (b"\x80", b"PK\x03\x04")  # pickle protocol >= 2; torch.save's zip container


def max_adapter_bytes(shapes: BaseShapes, max_rank: int) -> int:
    """The largest weights file a servable adapter can have (every projection at ``max_rank`` in fp32)."""
    per_layer = sum(sum(shapes.in_out(p)) for p in PROJECTIONS)
    return 4 * max_rank * per_layer * shapes.num_layers + HEADER_SLACK_BYTES


@dataclass(frozen=True)
class AdapterFetcher:
    """Everything a load needs besides the source: where to read from and what the adapter must fit."""

    store: ObjectStore | None
    shapes: BaseShapes
    max_rank: int
    scratch: Path  # downloads land here before parsing
    root: Path | None  # --adapter-root
    base: BaseFingerprint | None = None  # what adapters must have been made on (None: shapes only)

    def fetch(self, source: AdapterSource) -> AdapterWeights:
        """Verified, parsed weights of ``source``; raises a 4xx error saying what is wrong with the adapter."""
        if isinstance(source, LocalSource):
            # Resolve again: the directory may have been swapped for a symlink since it was registered.
            return self._parse(resolve_local(self.root, source.relative))
        if self.store is None:
            raise AdapterFileError("this server has no object store configured (LORAPLEX_STORAGE_*)", param="adapter")
        descriptor = source.descriptor
        if self.base is not None:
            check_recorded(descriptor.base_fingerprint, self.base, descriptor.name)
        if descriptor.rank > self.max_rank:
            raise AdapterConfigError(
                f"adapter {descriptor.name} has rank {descriptor.rank}; this server serves ranks up to {self.max_rank}",
                param="r",
            )
        self.scratch.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=self.scratch, prefix="adapter-") as tmp:
            directory = Path(tmp)
            config_path, weights_path = directory / ADAPTER_CONFIG_FILE, directory / ADAPTER_WEIGHTS_FILE
            _download(self.store, descriptor.config_key, config_path, descriptor.config_sha256, MAX_CONFIG_BYTES)
            limit = max_adapter_bytes(self.shapes, self.max_rank)
            _download(self.store, descriptor.weights_key, weights_path, descriptor.sha256, limit)
            return self._parse(directory)

    def _parse(self, directory: Path) -> AdapterWeights:
        try:
            spec = inspect_adapter(directory, self.shapes, self.max_rank)
        except AdapterFileError as exc:
            if exc.param == ADAPTER_WEIGHTS_FILE:
                _refuse_pickle(directory / ADAPTER_WEIGHTS_FILE)
            raise
        if self.base is not None:
            check_origin(read_adapter_origin(directory / ADAPTER_WEIGHTS_FILE), self.base)
        return load_adapter_weights(spec)


def _download(store: ObjectStore, key: str, dest: Path, expected_sha256: str, max_bytes: int) -> None:
    """Stream ``key`` to ``dest``, hashing as it comes; refuse oversize objects, pickles and wrong hashes."""
    name = dest.name
    size = store.stat(key).size
    if size > max_bytes:
        raise AdapterTooLarge(
            f"{name} is {size} bytes; no adapter this server can serve is larger than {max_bytes}", param=name
        )
    digest = hashlib.sha256()
    written = 0
    with dest.open("wb") as f:
        for chunk in store.iter_chunks(key):
            written += len(chunk)
            if written > max_bytes:
                raise AdapterTooLarge(f"{name} grew past {max_bytes} bytes while downloading", param=name)
            digest.update(chunk)
            f.write(chunk)
    actual = digest.hexdigest()
    if actual != expected_sha256:
        raise AdapterChecksumMismatch(
            f"{name} has sha256 {actual} but the adapter descriptor says {expected_sha256}; "
            "the stored object changed or the descriptor is stale",
            param=name,
        )


def _refuse_pickle(path: Path) -> None:
    """Name the likely cause when a weights file that failed to parse as safetensors looks like a pickle."""
    try:
        with path.open("rb") as f:
            head = f.read(4)
    except OSError:
        return
    if head.startswith(PICKLE_MAGIC):
        raise AdapterFileError(
            f"{path.name} is a pickle/torch.save file, which is never loaded; save the adapter with "
            "safetensors (PEFT save_pretrained(safe_serialization=True))",
            param=path.name,
        )
