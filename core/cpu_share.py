"""How one machine's cores are split between the inference server and training (``loraplex up``).

Both are torch processes, and by default each starts one thread per core: beside each other they run twice
as many threads as cores, and OpenMP teams that spin while waiting for a preempted member turn every step
into a wait (measured: one 32-token request from 0.93 s to 24-32 s on a busy 2-core machine). So ``up``
gives each its share of the cores, training the smaller one (serving is what users wait on), and where
the shares must overlap (one core) tells OpenMP to sleep rather than spin while it waits.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from core.errors import ConfigError


@dataclass(frozen=True)
class CpuShares:
    """Torch threads for the inference server and for a training job, out of ``cores``."""

    cores: int
    server: int
    training: int

    @property
    def oversubscribed(self) -> bool:
        """More threads than cores: OpenMP must wait passively, or spinning threads starve working ones."""
        return self.server + self.training > self.cores

    def env(self, threads: int) -> dict[str, str]:
        """Environment for a process running ``threads`` torch threads under this split (OpenMP reads it
        when torch loads, before any setting in code could apply)."""
        env = {"OMP_NUM_THREADS": str(threads)}
        if self.oversubscribed:
            env["OMP_WAIT_POLICY"] = "PASSIVE"
        return env

    def describe(self) -> str:
        shared = "; shared, OpenMP waits passively" if self.oversubscribed else ""
        return f"server {self.server} threads, training {self.training}, of {self.cores} cores{shared}"


def available_cores() -> int:
    """Cores this process may run on (its affinity mask, which containers and ``taskset`` narrow)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def training_share(cores: int) -> int:
    """Training's default: one core up to four, then a quarter (a LoRA step on CPU is no latency target)."""
    return 1 if cores <= 4 else cores // 4


def split_cores(cores: int, server: int | None = None, training: int | None = None) -> CpuShares:
    """The split for ``cores``; ``server`` / ``training`` override either side (the other gets the rest)."""
    for name, value in (("server threads", server), ("training threads", training)):
        if value is not None and value < 1:
            raise ConfigError(f"{name} must be at least 1, got {value}")
    if cores < 1:
        raise ConfigError(f"need at least one core, got {cores}")
    if training is None:
        training = training_share(cores) if server is None else max(1, cores - server)
    if server is None:
        server = max(1, cores - training)
    return CpuShares(cores, server, training)
