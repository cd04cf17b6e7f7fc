"""A Hugging Face hub cache written by hand, laid out as huggingface_hub lays it out, for tests without network:
``models--{org}--{name}/blobs/<sha256>``, ``snapshots/<commit>/<file>`` symlinks to the blobs, ``refs/<ref>``."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path


def cache_repo(hub_cache: Path, repo_id: str, files: Path, *, ref: str = "main") -> Path:
    """Store every file in ``files`` as one commit of model repo ``repo_id`` that ``ref`` points at; its snapshot."""
    contents = {p.name: p.read_bytes() for p in sorted(files.iterdir()) if p.is_file()}
    commit = hashlib.sha1(repo_id.encode() + b"".join(contents.values())).hexdigest()  # 40 hex, like git's
    repo = hub_cache / ("models--" + repo_id.replace("/", "--"))
    snapshot = repo / "snapshots" / commit
    snapshot.mkdir(parents=True)
    (repo / "blobs").mkdir(exist_ok=True)
    for name, data in contents.items():
        blob = repo / "blobs" / hashlib.sha256(data).hexdigest()
        blob.write_bytes(data)
        (snapshot / name).symlink_to(os.path.relpath(blob, snapshot))
    (repo / "refs").mkdir(exist_ok=True)
    (repo / "refs" / ref).write_text(commit)  # no newline, as huggingface_hub writes it
    return snapshot
