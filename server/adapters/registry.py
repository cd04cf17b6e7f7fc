"""Adapter names a server answers to, and where each one's files are. Thread-safe; no weights here.

Names come from three places: ``/v1/load_lora_adapter`` (a local directory, or a descriptor as a
prefetch), descriptors carried by completion requests, and -- for standalone use -- a request's
``model`` naming a directory under ``--adapter-root``. Each registration gets a key of its own (the
name the engine and the tiers know it by), so re-binding a name never mixes two adapters' weights.
"""

from __future__ import annotations

import itertools
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from core.descriptor import AdapterDescriptor
from core.errors import InvalidRequest
from server.adapters.errors import AdapterBaseMismatch, AdapterNameConflict, ModelNotFound
from server.adapters.sources import (
    AdapterSource,
    LocalSource,
    StoreSource,
    descriptor_key,
    local_key,
    relative_lora_path,
    resolve_local,
)


@dataclass(frozen=True)
class KnownAdapter:
    """A name bound to a source; ``key`` identifies these exact weights across the tiers."""

    key: str
    name: str
    source: AdapterSource
    created: int = field(default_factory=lambda: int(time.time()))

    @property
    def adapter_id(self) -> str | None:
        """The control plane's adapter id, for stored adapters."""
        return self.source.descriptor.id if isinstance(self.source, StoreSource) else None


class AdapterRegistry:
    """Names -> adapters, for one base model."""

    def __init__(self, base_name: str, adapter_root: Path | None) -> None:
        self.base_name = base_name
        self.adapter_root = adapter_root
        self._by_name: dict[str, KnownAdapter] = {}
        self._lock = threading.Lock()
        self._counter = itertools.count(1)

    def resolve(self, model: str) -> KnownAdapter | None:
        """The adapter ``model`` names, None for the base model; unknown names may be directories under the root."""
        if model == self.base_name:
            return None
        with self._lock:
            known = self._by_name.get(model)
        if known is not None:
            return known
        if self.adapter_root is None:
            raise ModelNotFound(self._unknown(model), param="model")
        try:
            resolve_local(self.adapter_root, model, what="model")
        except ModelNotFound:
            raise ModelNotFound(self._unknown(model), param="model") from None
        return self.register_local(model, model)

    def register_local(self, name: str, relative: str) -> KnownAdapter:
        """Bind ``name`` to a directory under the root, given relative to it or absolute inside it (idempotent for
        the same path)."""
        self._check_name(name)
        relative = relative_lora_path(self.adapter_root, relative)
        path = resolve_local(self.adapter_root, relative)
        with self._lock:
            known = self._by_name.get(name)
            if known is not None:
                if isinstance(known.source, LocalSource) and known.source.path == path:
                    return known
                raise AdapterNameConflict(
                    f"adapter name {name!r} is already bound to another adapter; unload it first", param="lora_name"
                )
            known = KnownAdapter(local_key(name, next(self._counter)), name, LocalSource(name, relative, path))
            self._by_name[name] = known
            return known

    def register_descriptor(self, descriptor: AdapterDescriptor) -> KnownAdapter:
        """Bind the descriptor's name to it; a newer descriptor for the same name replaces the older one."""
        self._check_name(descriptor.name)
        if descriptor.base_model != self.base_name:
            raise AdapterBaseMismatch(
                f"adapter {descriptor.name} was made for base model {descriptor.base_model!r}; "
                f"this server runs {self.base_name!r}",
                param="adapter.base_model",
            )
        key = descriptor_key(descriptor)
        with self._lock:
            known = self._by_name.get(descriptor.name)
            if known is not None and known.key == key:
                return known
            if known is not None and isinstance(known.source, LocalSource):
                raise AdapterNameConflict(
                    f"adapter name {descriptor.name!r} is bound to a local adapter on this server", param="model"
                )
            known = KnownAdapter(key, descriptor.name, StoreSource(descriptor))
            self._by_name[descriptor.name] = known
            return known

    def unregister(self, name: str) -> KnownAdapter:
        """Forget a name (by name, or by adapter id for stored adapters)."""
        with self._lock:
            known = self._by_name.pop(name, None)
            if known is None:
                known = next((k for k in self._by_name.values() if k.adapter_id == name), None)
                if known is not None:
                    del self._by_name[known.name]
        if known is None:
            raise ModelNotFound(f"no adapter named {name!r} is loaded", param="lora_name")
        return known

    def discard(self, known: KnownAdapter) -> None:
        """Unbind ``known``'s name if it is still bound to exactly that adapter (e.g. after it failed to load)."""
        with self._lock:
            if self._by_name.get(known.name) == known:
                del self._by_name[known.name]

    def adapters(self) -> list[KnownAdapter]:
        """Every bound adapter, oldest first."""
        with self._lock:
            return sorted(self._by_name.values(), key=lambda k: (k.created, k.name))

    def _check_name(self, name: str) -> None:
        if not isinstance(name, str) or not name.strip() or len(name) > 512:
            raise InvalidRequest("adapter names must be 1-512 characters", param="lora_name")
        if name == self.base_name:
            raise AdapterNameConflict(f"{name!r} is the base model's name; pick another adapter name")

    def _unknown(self, model: str) -> str:
        return (
            f"model {model!r} is neither the base model ({self.base_name!r}) nor a loaded adapter; "
            "load it with POST /v1/load_lora_adapter (see GET /v1/models)"
        )
