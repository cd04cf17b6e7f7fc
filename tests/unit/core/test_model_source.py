"""Base models named by hub id: read from a real Hugging Face cache layout with the network off, named as typed,
refused clearly when missing or pickled; an existing directory always wins."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from core.errors import ConfigError
from core.model_source import HubModel, default_model_name, hub_model, resolve_model_dir
from core.settings import load_settings
from tests.hf_cache import cache_repo

REPO = "acme/tiny-llama"


@pytest.fixture
def hub_cache(tmp_path: Path, tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An offline HF cache holding the tiny model as ``acme/tiny-llama`` (``main``)."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    cache = tmp_path / "hf" / "hub"
    cache_repo(cache, REPO, tiny_model_dir)
    return cache


def test_a_cached_hub_id_resolves_to_its_snapshot_at_main_or_a_commit(hub_cache: Path) -> None:
    from huggingface_hub import scan_cache_dir

    [repo] = scan_cache_dir(hub_cache).repos  # huggingface_hub itself reads the layout as a cached repo
    [revision] = repo.revisions
    assert repo.repo_id == REPO and revision.refs == frozenset({"main"})

    for source in (REPO, f"{REPO}@main", f"{REPO}@{revision.commit_hash}"):
        path = resolve_model_dir(source, setting="--model", cache_dir=hub_cache)
        assert path.resolve() == revision.snapshot_path.resolve()
        assert (path / "config.json").is_file() and (path / "model.safetensors").is_file()
        assert default_model_name(source) == REPO


def test_a_model_missing_from_the_cache_is_refused_with_what_to_do(hub_cache: Path) -> None:
    for source in ("acme/absent", f"{REPO}@no-such-branch"):
        with pytest.raises(ConfigError) as caught:
            resolve_model_dir(source, setting="LORAPLEX_BASE_MODEL", cache_dir=hub_cache)
        message = caught.value.message
        assert f"LORAPLEX_BASE_MODEL {source}" in message
        assert "not (completely) in the Hugging Face cache" in message and "HF_HUB_OFFLINE" in message
        assert "pass a local model directory instead" in message


def test_a_repo_with_only_pickle_weights_is_refused(hub_cache: Path, tiny_model_dir: Path, tmp_path: Path) -> None:
    pickled = tmp_path / "pickled"
    pickled.mkdir()
    shutil.copy(tiny_model_dir / "config.json", pickled / "config.json")
    (pickled / "pytorch_model.bin").write_bytes(b"not loaded")
    cache_repo(hub_cache, "acme/pickled", pickled)

    with pytest.raises(ConfigError) as caught:
        resolve_model_dir("acme/pickled", setting="--model", cache_dir=hub_cache)
    assert "only pickle weights (pytorch_model.bin)" in caught.value.message
    assert "safetensors" in caught.value.message


def test_an_existing_directory_wins_over_a_hub_id(
    hub_cache: Path, tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    shutil.copytree(tiny_model_dir, tmp_path / REPO)
    assert hub_model(REPO) is None
    assert resolve_model_dir(REPO, setting="--model", cache_dir=hub_cache) == Path(REPO)
    assert default_model_name(REPO) == "tiny-llama"


@pytest.mark.parametrize(
    ("source", "expected"),
    [
        ("org/name", HubModel("org/name")),
        ("Org/Name-1.5B_x@v1.0", HubModel("Org/Name-1.5B_x", "v1.0")),
        ("org/name@refs/pr/1", HubModel("org/name", "refs/pr/1")),
        ("/models/name", None),
        ("./org/name", None),
        ("~/org/name", None),
        ("a/b/c", None),
        ("name", None),
        (Path("org/name"), None),  # a Path is always meant as a directory
    ],
)
def test_what_counts_as_a_hub_id(source: str | Path, expected: HubModel | None) -> None:
    assert hub_model(source) == expected


def test_the_public_name_is_the_configured_one_else_the_repo_id_else_the_directory_name(tmp_path: Path) -> None:
    assert load_settings(base_model=f"{REPO}@main").model_name == REPO
    assert load_settings(base_model=REPO, base_model_name="tiny").model_name == "tiny"
    assert load_settings(base_model=tmp_path / "my-model").model_name == "my-model"
    assert load_settings(base_model="~/models/my-model").model_name == "my-model"
    assert load_settings(base_model=" ").model_name is None
