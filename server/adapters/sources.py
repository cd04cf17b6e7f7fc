"""Where an adapter's files come from: the object store (by descriptor) or a directory under ``--adapter-root``.

Local paths are untrusted input (a request's ``model`` or ``lora_path``): they must be relative (an absolute
``lora_path``, as vLLM clients send, is made relative when it lies inside the root), must not climb with
``..``, and must still be inside the root once every symlink is resolved, for the directory and for each file
read from it.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path, PurePosixPath, PureWindowsPath

from core.adapter_format import ADAPTER_CONFIG_FILE, ADAPTER_WEIGHTS_FILE
from core.descriptor import AdapterDescriptor
from server.adapters.errors import AdapterPathRefused, ModelNotFound

MAX_LOCAL_NAME = 255
LOCAL_KEY_PREFIX = "local:"


@dataclass(frozen=True)
class LocalSource:
    """A PEFT directory under the adapter root: ``relative`` as given, ``path`` as resolved when registered."""

    name: str
    relative: str
    path: Path


@dataclass(frozen=True)
class StoreSource:
    """An adapter in the object store, described (and vouched for) by the control plane."""

    descriptor: AdapterDescriptor


AdapterSource = LocalSource | StoreSource


def descriptor_key(descriptor: AdapterDescriptor) -> str:
    """Cache key of a stored adapter: its id plus content hash, so a changed object is a different adapter."""
    return f"{descriptor.id}@{descriptor.sha256[:16]}"


def adapter_id_of_key(key: str) -> str | None:
    """The control plane's adapter id inside a :func:`descriptor_key`; None for local adapters."""
    if key.startswith(LOCAL_KEY_PREFIX):
        return None
    return key.rsplit("@", 1)[0]


def local_key(name: str, serial: int) -> str:
    """Cache key of one registration of a local adapter."""
    return f"{LOCAL_KEY_PREFIX}{name}#{serial}"


def check_relative(relative: str, what: str = "lora_path") -> PurePosixPath:
    """The path as parts, or ``AdapterPathRefused`` when it is absolute, climbs with ``..`` or is malformed."""
    if not isinstance(relative, str) or not relative.strip():
        raise AdapterPathRefused(f"{what} must be a non-empty relative path under the adapter root", param=what)
    if len(relative) > MAX_LOCAL_NAME or "\x00" in relative or "\\" in relative:
        raise AdapterPathRefused(f"{what} {relative!r} is too long or contains a NUL or backslash", param=what)
    posix = PurePosixPath(relative)
    if posix.is_absolute() or PureWindowsPath(relative).is_absolute() or PureWindowsPath(relative).drive:
        raise AdapterPathRefused(
            f"{what} {relative!r} is absolute; give a path relative to the server's --adapter-root", param=what
        )
    if ".." in posix.parts:
        raise AdapterPathRefused(f"{what} {relative!r} contains '..'; adapters must stay under the root", param=what)
    return posix


def relative_lora_path(root: Path | None, lora_path: str) -> str:
    """``lora_path`` relative to the root: a relative path as given, an absolute one only when it lies inside the
    root (as configured or as resolved); :func:`resolve_local` then checks ``..`` and symlinks as for any other."""
    if root is None or not isinstance(lora_path, str) or not PurePosixPath(lora_path).is_absolute():
        return lora_path
    path = PurePosixPath(lora_path)
    if ".." in path.parts:
        raise AdapterPathRefused(
            f"lora_path {lora_path!r} contains '..'; adapters must stay under the root", param="lora_path"
        )
    for base in (PurePosixPath(root), PurePosixPath(root.resolve())):
        if path.is_relative_to(base) and path != base:
            return str(path.relative_to(base))
    raise AdapterPathRefused(
        f"lora_path {lora_path!r} is outside the server's --adapter-root; give a path inside it (or relative to it)",
        param="lora_path",
    )


def resolve_local(root: Path | None, relative: str, what: str = "lora_path") -> Path:
    """The real directory of ``relative`` under ``root``, refusing anything that lands outside it."""
    if root is None:
        raise AdapterPathRefused(
            "this server has no --adapter-root, so local adapters are disabled; load adapters by descriptor",
            param=what,
        )
    parts = check_relative(relative, what)
    real_root = root.resolve(strict=True)
    candidate = real_root.joinpath(*parts.parts)
    try:
        real = candidate.resolve(strict=True)
    except (FileNotFoundError, NotADirectoryError):
        raise ModelNotFound(f"no adapter directory {relative!r} under the adapter root", param=what) from None
    except (OSError, RuntimeError) as exc:  # symlink loops, permissions
        raise AdapterPathRefused(f"{what} {relative!r} cannot be resolved: {exc}", param=what) from None
    if not real.is_relative_to(real_root):
        raise AdapterPathRefused(f"{what} {relative!r} resolves outside the adapter root (a symlink?)", param=what)
    if not real.is_dir():
        raise ModelNotFound(f"{relative!r} under the adapter root is not a directory", param=what)
    for name in (ADAPTER_CONFIG_FILE, ADAPTER_WEIGHTS_FILE):
        file = real / name
        if file.is_symlink() and not file.resolve().is_relative_to(real_root):
            raise AdapterPathRefused(f"{relative}/{name} is a symlink leading outside the adapter root", param=what)
    return real
