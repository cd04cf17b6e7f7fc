"""Rank 0's side of tensor parallelism: it starts the follower ranks, then tells them each step and each change of
the adapter pages, in the order it makes them. Rank 0 alone schedules, keeps the pool's accounting and samples.

Followers are fresh interpreters (``python -m server.parallel.follower``: a forked torch is not safe, and the
engine process that starts them is a daemon, which multiprocessing forbids children), one per device, started
before rank 0 builds its own model so that every rank loads its slices at once. None outlives its server: rank 0
stops them when its engine closes (or is collected), and a follower exits by itself when its group breaks, as it
does the moment rank 0's process dies and its connections close.
"""

from __future__ import annotations

import contextlib
import logging
import pickle
import subprocess
import sys
import weakref
from dataclasses import replace
from typing import Any

import torch

from server.engine.config import EngineConfig
from server.engine.scheduler import SchedulerOutput
from server.memory.adapter_pages import AdapterPlan
from server.parallel.group import RankFailed, TensorParallel, open_store
from server.parallel.wire import Cleared, Placement, Step, Stop

log = logging.getLogger(__name__)

JOIN_TIMEOUT_S = 10.0


class Followers:
    """Ranks 1..N-1 of one engine, driven by rank 0 (the engine's own process)."""

    def __init__(self, tp: TensorParallel, processes: list[subprocess.Popen]) -> None:
        self.tp = tp
        self.processes = processes
        self._stop = weakref.finalize(self, _stop_processes, tp, processes)  # runs once: on stop() or collection

    @classmethod
    def start(cls, config: EngineConfig, device: torch.device) -> Followers:
        """Start ``config.tensor_parallel_size - 1`` followers and form the group with them (rank 0 is us)."""
        world = config.tensor_parallel_size
        store, address = open_store(world)
        processes = []
        for rank in range(1, world):
            process = subprocess.Popen([sys.executable, "-m", "server.parallel.follower"], stdin=subprocess.PIPE)
            process.stdin.write(pickle.dumps((config, address, rank)))
            process.stdin.close()
            processes.append(process)
        try:
            tp = TensorParallel(store, address, 0, device)
        except Exception:
            _stop_processes(None, processes)
            raise
        return cls(tp, processes)

    def step(self, batch: SchedulerOutput, all_logits: bool = False) -> None:
        """Before rank 0's forward: the followers run the same step's forward with it, and the logits gather of
        the sampled rows (``all_logits``: of every row, when rank 0 asks for those)."""
        self._send(Step.of(batch, all_logits))

    def placed(self, plan: AdapterPlan, slot: int, pages: list[int]) -> None:
        """After rank 0 wrote ``plan`` at ``slot`` and ``pages``: the followers write their slices there."""
        self._send(Placement(slot, pages, replace(plan, image=plan.image[:0])))

    def cleared(self, slot: int) -> None:
        self._send(Cleared(slot))

    def stop(self) -> None:
        """Tell the followers to exit and wait for them (a bounded time: they are killed after it)."""
        self._stop()

    @property
    def stopped(self) -> bool:
        return not self._stop.alive

    def _send(self, message: Any) -> None:
        dead = [
            f"rank {rank} (exit code {p.returncode})"
            for rank, p in enumerate(self.processes, 1)
            if p.poll() is not None
        ]
        if dead:
            raise RankFailed(f"tensor-parallel {', '.join(dead)} exited; the engine cannot run a step without it")
        self.tp.broadcast_object(message)


def _stop_processes(tp: TensorParallel | None, processes: list[subprocess.Popen]) -> None:
    if tp is not None and all(p.poll() is None for p in processes):
        with contextlib.suppress(RankFailed):  # a follower that died meanwhile: the waits below still end
            tp.broadcast_object(Stop())
    for rank, process in enumerate(processes, 1):
        try:
            process.wait(JOIN_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            log.warning("tensor-parallel rank %d did not stop; killing it", rank)
            process.kill()
            process.wait()
