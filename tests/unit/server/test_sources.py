"""Local adapter paths stay under the adapter root: no absolute paths outside it, no '..', no escaping symlinks."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from core.adapter_format import ADAPTER_CONFIG_FILE, ADAPTER_WEIGHTS_FILE
from core.descriptor import AdapterDescriptor
from server.adapters.errors import AdapterPathRefused, ModelNotFound
from server.adapters.sources import adapter_id_of_key, descriptor_key, local_key, relative_lora_path, resolve_local


@pytest.fixture
def root(tmp_path: Path) -> Path:
    root = tmp_path / "root"
    (root / "team" / "adapter").mkdir(parents=True)
    (root / "plain").mkdir()
    (root / "a-file").write_text("x")
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / ADAPTER_WEIGHTS_FILE).write_bytes(b"secret")
    os.symlink(outside, root / "escape")
    os.symlink(root / "plain", root / "inside-link")
    linked = root / "file-link"
    linked.mkdir()
    (linked / ADAPTER_CONFIG_FILE).write_text("{}")
    os.symlink(outside / ADAPTER_WEIGHTS_FILE, linked / ADAPTER_WEIGHTS_FILE)
    return root


def test_relative_directories_under_the_root_resolve(root: Path):
    assert resolve_local(root, "plain") == (root / "plain").resolve()
    assert resolve_local(root, "team/adapter") == (root / "team" / "adapter").resolve()
    assert resolve_local(root, "inside-link") == (root / "plain").resolve()  # a symlink that stays inside is fine


@pytest.mark.parametrize(
    ("path", "words"),
    [
        ("../outside", "'..'"),
        ("team/../../outside", "'..'"),
        ("/etc", "absolute"),
        ("C:\\\\adapters", "backslash"),
        ("C:adapters", "absolute"),
        ("", "non-empty"),
        ("a\x00b", "NUL"),
        ("escape", "outside the adapter root"),
        ("file-link", "outside the adapter root"),
    ],
)
def test_escapes_are_refused(root: Path, path: str, words: str):
    with pytest.raises(AdapterPathRefused) as refused:
        resolve_local(root, path)
    assert words in refused.value.message and refused.value.status_code == 400


def test_absolute_lora_paths_inside_the_root_resolve_like_relative_ones(root: Path):
    """vLLM clients send absolute paths; inside the root (as configured or resolved) they are fine."""
    assert relative_lora_path(root, str(root / "team" / "adapter")) == "team/adapter"
    assert relative_lora_path(root, str(root.resolve() / "plain")) == "plain"
    assert relative_lora_path(root, "plain") == "plain"
    assert resolve_local(root, relative_lora_path(root, str(root / "inside-link"))) == (root / "plain").resolve()


@pytest.mark.parametrize(
    ("where", "words"),
    [
        (lambda root: root.parent / "outside", "outside the server's --adapter-root"),
        (lambda root: Path("/etc"), "outside the server's --adapter-root"),
        (lambda root: root, "outside the server's --adapter-root"),
        (lambda root: Path(f"{root}-sibling"), "outside the server's --adapter-root"),
        (lambda root: Path(f"{root}/team/../../outside"), "'..'"),
        (lambda root: root / "escape", "outside the adapter root"),  # inside by name, outside once resolved
        (lambda root: root / "file-link", "outside the adapter root"),
    ],
)
def test_absolute_lora_paths_outside_the_root_are_refused(root: Path, where, words: str):
    with pytest.raises(AdapterPathRefused) as refused:
        resolve_local(root, relative_lora_path(root, str(where(root))))
    assert words in refused.value.message and refused.value.param == "lora_path"


def test_missing_paths_and_files_are_not_found(root: Path):
    with pytest.raises(ModelNotFound):
        resolve_local(root, "nope")
    with pytest.raises(ModelNotFound):
        resolve_local(root, "a-file")


def test_without_a_root_local_adapters_are_disabled():
    with pytest.raises(AdapterPathRefused, match="adapter-root"):
        resolve_local(None, "plain")


def test_keys_tell_stored_adapters_from_local_ones():
    descriptor = AdapterDescriptor(
        id="adapter-1", name="ft:x", base_model="b", storage_prefix="p/", sha256="ab" * 32, config_sha256="cd" * 32,
        rank=8,
    )  # fmt: skip
    assert adapter_id_of_key(descriptor_key(descriptor)) == "adapter-1"
    assert adapter_id_of_key(local_key("adapter-1", 3)) is None
    changed = descriptor.model_copy(update={"sha256": "ef" * 32})
    assert descriptor_key(changed) != descriptor_key(descriptor)  # new content, new key
