"""``manifest.json``: what an adapter was trained on and from, and the sha256 of each file beside it.

The base model is identified by a hash of its config and weights, so a server (or a human) can tell
whether an adapter was trained on exactly the base it is about to be applied to.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from core.descriptor import ADAPTER_CONFIG, ADAPTER_MANIFEST, ADAPTER_WEIGHTS
from core.ids import now
from core.storage.base import sha256_file

MANIFEST_FORMAT = "loraplex.adapter.v1"
ADAPTER_FILES = (ADAPTER_CONFIG, ADAPTER_WEIGHTS)


@dataclass(frozen=True)
class BaseModelFingerprint:
    name: str
    config_sha256: str
    weights_sha256: str  # sha256 over "file sha256  file name" lines of every weight file, sorted by name


def fingerprint_base_model(model_dir: str | Path, name: str | None = None) -> BaseModelFingerprint:
    """Hash a base model directory's ``config.json`` and weight files (safetensors, else .bin)."""
    root = Path(model_dir)
    weights = sorted(root.glob("*.safetensors")) or sorted(root.glob("*.bin"))
    if not weights:
        raise FileNotFoundError(f"no weight files (*.safetensors) in {root}")
    listing = "".join(f"{sha256_file(p)}  {p.name}\n" for p in weights)
    return BaseModelFingerprint(
        name=name or root.name,
        config_sha256=sha256_file(root / "config.json"),
        weights_sha256=hashlib.sha256(listing.encode()).hexdigest(),
    )


def write_manifest(adapter_dir: str | Path, *, base: BaseModelFingerprint, **facts: Any) -> dict[str, Any]:
    """Write ``manifest.json`` next to the PEFT files with their sizes and sha256; returns it."""
    root = Path(adapter_dir)
    files = {n: {"sha256": sha256_file(root / n), "bytes": (root / n).stat().st_size} for n in ADAPTER_FILES}
    manifest = {"format": MANIFEST_FORMAT, "base_model": asdict(base), **facts, "files": files, "created_at": now()}
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
