"""``manifest.json``: what an adapter was trained on and from, and the sha256 of each file beside it.

The base model is named and identified by its fingerprint (``core.base_fingerprint``), so a server (or a
human) can tell whether an adapter was trained on exactly the base it is about to be applied to.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from core.base_fingerprint import BaseFingerprint, origin_metadata
from core.descriptor import ADAPTER_CONFIG, ADAPTER_MANIFEST, ADAPTER_WEIGHTS
from core.ids import now
from core.storage.base import sha256_file

MANIFEST_FORMAT = "loraplex.adapter.v1"
ADAPTER_FILES = (ADAPTER_CONFIG, ADAPTER_WEIGHTS)


def stamp_origin(weights_path: Path, base: BaseFingerprint) -> None:
    """Record ``base`` in the weights file's safetensors metadata, where it travels with the file (a user who
    downloads an adapter and uploads it elsewhere brings it along).

    Only the header is rewritten, with its keys in a fixed order: the tensor bytes stay as PEFT wrote them,
    and the same adapter stamped twice is the same file (safetensors' own writer orders metadata by hash,
    so its files differ from one process to the next).
    """
    raw = weights_path.read_bytes()
    length = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8 : 8 + length])
    metadata = {**header.pop("__metadata__", {}), **origin_metadata(base)}
    text = json.dumps({"__metadata__": dict(sorted(metadata.items())), **header}, separators=(",", ":"))
    encoded = text.encode() + b" " * (-len(text.encode()) % 8)  # safetensors aligns the data to 8 bytes
    weights_path.write_bytes(len(encoded).to_bytes(8, "little") + encoded + raw[8 + length :])


def write_manifest(adapter_dir: str | Path, *, base: BaseFingerprint, **facts: Any) -> dict[str, Any]:
    """Write ``manifest.json`` next to the PEFT files with their sizes and sha256; returns it."""
    root = Path(adapter_dir)
    files = {n: {"sha256": sha256_file(root / n), "bytes": (root / n).stat().st_size} for n in ADAPTER_FILES}
    origin = {"name": base.name, "fingerprint": base.digest}
    manifest = {"format": MANIFEST_FORMAT, "base_model": origin, **facts, "files": files, "created_at": now()}
    (root / ADAPTER_MANIFEST).write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")
    return manifest


def verify_adapter_dir(adapter_dir: str | Path) -> dict[str, Any]:
    """Read a manifest and check every file it lists; raises ``ValueError`` naming a mismatch."""
    root = Path(adapter_dir)
    manifest = json.loads((root / ADAPTER_MANIFEST).read_text())
    for name, meta in manifest["files"].items():
        actual = sha256_file(root / name)
        if actual != meta["sha256"]:
            raise ValueError(f"{name} has sha256 {actual}, the manifest says {meta['sha256']}")
    return manifest
