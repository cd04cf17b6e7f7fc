"""What starts and stops a base model's replicas, behind one small interface; ``make_launcher`` picks the one
``LORAPLEX_REPLICA_LAUNCHER`` names."""

from __future__ import annotations

from typing import Protocol

from api.base_model import BaseModelInfo, BaseModels
from core.errors import ConfigError
from core.settings import Settings


class LaunchFailed(Exception):
    """A replica could not be asked for, or died before it registered; the message says why."""


class Launcher(Protocol):
    """Starts and stops the replicas of base models. Calls may block briefly (they run in a thread)."""

    kind: str

    def start(self, base: BaseModelInfo) -> None:
        """Ask for one replica of ``base`` if none runs or is starting; ``LaunchFailed`` if that is refused."""

    def failure(self, base: BaseModelInfo) -> str | None:
        """Why the replica asked for ``base`` died before registering, if it did (None: none known)."""

    def replicas(self, base: BaseModelInfo) -> int:
        """Replicas of ``base`` asked for and not stopped (running or starting)."""

    def stop(self, base: BaseModelInfo) -> None:
        """Stop every replica of ``base``: the base scales to zero."""

    def close(self) -> None:
        """The API is stopping: release what the launcher holds (local replicas stop with it)."""


def make_launcher(settings: Settings, bases: BaseModels) -> Launcher | None:
    """The launcher the settings name, or None when replicas run on their own (``none``)."""
    if settings.replica_launcher == "local":
        from api.scaling.local import LocalLauncher

        return LocalLauncher(settings)
    if settings.replica_launcher == "kubernetes":
        from api.scaling.kubernetes import KubernetesLauncher

        return KubernetesLauncher.from_settings(settings, bases)
    if settings.replica_idle_ttl is not None:
        raise ConfigError(
            "LORAPLEX_REPLICA_IDLE_TTL needs a launcher to start replicas again: set LORAPLEX_REPLICA_LAUNCHER to "
            "local or kubernetes"
        )
    return None
