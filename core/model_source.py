"""Where the base model comes from: a local directory, or a Hugging Face hub id ``org/name[@revision]``.

Every entry point (``loraplex up``, ``server`` and ``train``, the API and the worker) asks
``resolve_model_dir`` for a local directory and ``default_model_name`` for the name clients use. A
directory that exists always wins over a hub id spelled the same way.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from functools import partial
from pathlib import Path

from core.errors import ConfigError

# Configs (with the safetensors index), tokenizer and chat-template files. Weights come in a second step,
# so only the shards the index names are fetched: some repos ship the same weights twice (Mistral's
# `consolidated.safetensors` beside the HF shards).
METADATA_PATTERNS = ("*.json", "*.model", "*.tiktoken", "*.txt", "*.jinja")
SAFETENSORS_INDEX = "model.safetensors.index.json"
PICKLE_SUFFIXES = frozenset({".bin", ".pt", ".pth", ".ckpt", ".pkl"})
_HUB_ID = re.compile(r"(?P<repo>[A-Za-z0-9][\w.-]*/[\w.-]+)(?:@(?P<revision>[^@\s]+))?")


@dataclass(frozen=True)
class HubModel:
    """A model repo on the Hugging Face hub, at a branch, tag or commit (None: ``main``)."""

    repo_id: str
    revision: str | None = None

    def __str__(self) -> str:
        return f"{self.repo_id}@{self.revision}" if self.revision else self.repo_id


def hub_model(source: str | Path) -> HubModel | None:
    """The hub repo ``source`` names, or None when it is a local path (a ``Path``, an existing directory,
    or text starting with ``/``, ``.`` or ``~``)."""
    if isinstance(source, Path):
        return None
    text = source.strip()
    if text.startswith(("/", ".", "~")) or Path(text).is_dir():
        return None
    match = _HUB_ID.fullmatch(text)
    return HubModel(match["repo"], match["revision"]) if match else None


def default_model_name(source: str | Path) -> str:
    """The name clients use when none is configured: a hub id without its revision, else the directory's name."""
    hub = hub_model(source)
    return hub.repo_id if hub else Path(source).expanduser().name


def resolve_model_dir(source: str | Path, *, setting: str, cache_dir: Path | None = None) -> Path:
    """A local directory with ``source``'s config, tokenizer and weights; ``setting`` names the flag or variable.

    A hub id is fetched into the Hugging Face cache (``cache_dir``, default ``HF_HOME/hub``), or read from it
    when offline (``HF_HUB_OFFLINE=1`` or no network). A directory is returned as it is.
    """
    hub = hub_model(source)
    if hub is None:
        return Path(source).expanduser()
    path = _snapshot(hub, setting, cache_dir)
    _check_snapshot(path, hub, setting)
    return path


def _snapshot(hub: HubModel, setting: str, cache_dir: Path | None) -> Path:
    import httpx
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.utils import LocalEntryNotFoundError, RepositoryNotFoundError, RevisionNotFoundError

    # Read at call time: huggingface_hub reads HF_HUB_OFFLINE once, when it is first imported.
    offline = os.environ.get("HF_HUB_OFFLINE", "").strip().upper() in {"1", "ON", "YES", "TRUE"}
    fetch = partial(snapshot_download, hub.repo_id, cache_dir=cache_dir, local_files_only=offline)
    where = f"{setting} {hub}"
    try:
        folder = Path(fetch(revision=hub.revision, allow_patterns=list(METADATA_PATTERNS)))
        # The first call pinned a commit (the folder's name); fetch the weights of that same commit.
        return Path(fetch(revision=folder.name, allow_patterns=_weight_patterns(folder, where)))
    except LocalEntryNotFoundError:
        cache = cache_dir or constants.HF_HUB_CACHE
        reason = "HF_HUB_OFFLINE is set" if offline else "the hub cannot be reached"
        raise ConfigError(
            f"{where}: no such directory, and the model is not (completely) in the Hugging Face cache at {cache} "
            f"while {reason}. Download it where there is network (`hf download {hub.repo_id}`) into that cache, "
            "or pass a local model directory instead",
            code="model_not_found",
        ) from None
    except (RepositoryNotFoundError, RevisionNotFoundError) as exc:
        raise ConfigError(
            f"{where}: the Hugging Face hub has no such repo or revision, or it is private or gated "
            f"(log in with `hf auth login` or set HF_TOKEN); {type(exc).__name__}",
            code="model_not_found",
        ) from None
    except (OSError, ValueError, httpx.HTTPError) as exc:
        raise ConfigError(f"{where}: cannot fetch it from the Hugging Face hub: {exc}") from None


def _weight_patterns(folder: Path, where: str) -> list[str]:
    index = folder / SAFETENSORS_INDEX
    if not index.is_file():
        return ["*.safetensors"]
    try:
        return sorted(set(json.loads(index.read_text())["weight_map"].values()))
    except (OSError, ValueError, KeyError, AttributeError, TypeError) as exc:
        raise ConfigError(f"{where}: unreadable {SAFETENSORS_INDEX}: {exc!r}") from None


def _check_snapshot(path: Path, hub: HubModel, setting: str) -> None:
    where = f"{setting} {hub}"
    if not (path / "config.json").is_file():
        raise ConfigError(f"{where}: the repo has no config.json; give a transformers model repo")
    if any(path.glob("*.safetensors")):
        return
    pickles = sorted(p.name for p in path.iterdir() if p.suffix in PICKLE_SUFFIXES)
    found = f"only pickle weights ({', '.join(pickles)})" if pickles else "no *.safetensors weights"
    raise ConfigError(
        f"{where}: the repo has {found}. loraplex loads safetensors only (pickle files such as pytorch_model.bin "
        "can run code when loaded): pick a repo or revision that ships *.safetensors, or convert the weights "
        "and pass the local directory",
        code="unsupported_weights",
    )
