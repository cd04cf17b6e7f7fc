"""Adapter names: the base model, local directories under the root, descriptors; conflicts and mismatches."""

from __future__ import annotations

from pathlib import Path

import pytest

from core.descriptor import AdapterDescriptor
from server.adapters.errors import AdapterBaseMismatch, AdapterNameConflict, AdapterPathRefused, ModelNotFound
from server.adapters.registry import AdapterRegistry
from server.adapters.sources import LocalSource, StoreSource

BASE = "tiny"


def descriptor(adapter_id: str = "adapter-1", name: str = "ft:tiny:t:x:1", sha: str = "ab") -> AdapterDescriptor:
    return AdapterDescriptor(
        id=adapter_id, name=name, base_model=BASE, storage_prefix=f"tenants/t/adapters/{adapter_id}/",
        sha256=sha * 32, config_sha256="cd" * 32, rank=8,
    )  # fmt: skip


@pytest.fixture
def registry(tmp_path: Path) -> AdapterRegistry:
    for name in ("one", "two", "train"):
        (tmp_path / name).mkdir()
    return AdapterRegistry(BASE, tmp_path)


def test_the_base_name_means_no_adapter(registry):
    assert registry.resolve(BASE) is None


def test_directories_under_the_root_are_found_by_name(registry):
    known = registry.resolve("train")  # a name that is also a common attribute name
    assert known is not None and isinstance(known.source, LocalSource) and known.name == "train"
    assert registry.resolve("train") == known
    assert [k.name for k in registry.adapters()] == ["train"]


def test_unknown_names_and_escapes(registry):
    with pytest.raises(ModelNotFound, match="neither the base model"):
        registry.resolve("three")
    with pytest.raises(AdapterPathRefused):
        registry.resolve("../one")
    with pytest.raises(ModelNotFound):
        AdapterRegistry(BASE, None).resolve("one")


def test_a_name_binds_one_directory(registry):
    first = registry.register_local("mine", "one")
    assert registry.register_local("mine", "one") == first
    with pytest.raises(AdapterNameConflict):
        registry.register_local("mine", "two")
    with pytest.raises(AdapterNameConflict):
        registry.register_local(BASE, "two")
    registry.unregister("mine")
    second = registry.register_local("mine", "two")
    assert second.key != first.key  # never confused with the old weights in any tier


def test_descriptors_bind_their_name_and_newer_ones_replace_older(registry):
    old = registry.register_descriptor(descriptor())
    assert isinstance(old.source, StoreSource) and registry.resolve(old.name) == old
    new = registry.register_descriptor(descriptor(sha="ef"))
    assert new.key != old.key and registry.resolve(old.name) == new
    registry.discard(old)  # no longer bound to old: nothing happens
    assert registry.resolve(new.name) == new
    assert registry.unregister("adapter-1") == new  # by id works too
    with pytest.raises(ModelNotFound):
        registry.unregister(new.name)


def test_descriptors_for_another_base_or_clashing_with_local_names_are_refused(registry):
    with pytest.raises(AdapterBaseMismatch):
        registry.register_descriptor(descriptor().model_copy(update={"base_model": "other"}))
    registry.register_local("taken", "one")
    with pytest.raises(AdapterNameConflict):
        registry.register_descriptor(descriptor(name="taken"))
