"""The collectives tensor-parallel ranks share: torch.distributed process groups, gloo on CPU and NCCL on CUDA.

Each engine makes its own group over its own ``TCPStore`` (rank 0 binds it on 127.0.0.1), not the process-wide
default group, so one process may build and drop several engines (tests do). Rank 0 also uses the group to send
the followers what to do next (:meth:`TensorParallel.broadcast_object`): a step, an adapter to place, stop.
A rank that dies breaks the group: gloo raises at once ("connection closed by peer"), and every collective but a
follower's wait for rank 0's next message has a timeout, so no rank waits for a hung one for longer than that.
"""

from __future__ import annotations

import pickle
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from server.parallel.shards import Shard

HOST = "127.0.0.1"
DEFAULT_TIMEOUT_S = 60.0
IDLE_TIMEOUT = timedelta(days=3650)  # a follower waiting for rank 0's next message: as long as rank 0 lives


class RankFailed(RuntimeError):
    """A tensor-parallel rank stopped answering: the engine cannot compute another step."""


@dataclass(frozen=True)
class GroupAddress:
    """Where followers find rank 0's store, and how long any collective may wait."""

    port: int
    world: int
    timeout_s: float = DEFAULT_TIMEOUT_S


def open_store(world: int, timeout_s: float = DEFAULT_TIMEOUT_S) -> tuple[dist.TCPStore, GroupAddress]:
    """Rank 0's store, on a free loopback port; followers join it at the address returned."""
    timeout = timedelta(seconds=timeout_s)
    store = dist.TCPStore(HOST, 0, world, is_master=True, timeout=timeout, wait_for_workers=False)
    return store, GroupAddress(store.port, world, timeout_s)


def join_store(address: GroupAddress) -> dist.TCPStore:
    """A follower's connection to rank 0's store."""
    return dist.TCPStore(
        HOST, address.port, address.world, is_master=False, timeout=timedelta(seconds=address.timeout_s)
    )


class TensorParallel:
    """One rank's handle on its engine's group; constructing it waits until every rank has joined."""

    def __init__(self, store: dist.Store, address: GroupAddress, rank: int, device: torch.device) -> None:
        self.shard = Shard(rank, address.world)
        self.device = device
        self._store = store  # kept alive: rank 0's store serves the others for as long as the group lives
        self._timeout = timeout = timedelta(seconds=address.timeout_s)
        if device.type == "cuda":
            self._group = dist.ProcessGroupNCCL(store, rank, address.world, dist.ProcessGroupNCCL.Options())
            # Objects travel through the host even on CUDA (gloo, under its own prefix): they are small.
            self._objects = dist.ProcessGroupGloo(dist.PrefixStore("objects/", store), rank, address.world, timeout)
        else:
            self._group = dist.ProcessGroupGloo(store, rank, address.world, timeout)
            self._objects = self._group
        self.all_reduces = 0  # collectives this rank has run, and their payload bytes (bench/tp_cpu.py reports them)
        self.all_reduce_bytes = 0
        self.gathers = 0
        self.gather_bytes = 0

    @property
    def rank(self) -> int:
        return self.shard.rank

    @property
    def world(self) -> int:
        return self.shard.world

    def all_reduce_(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum ``tensor`` over the ranks, in place."""
        self.all_reduces += 1
        self.all_reduce_bytes += tensor.numel() * tensor.element_size()
        self._wait(self._group.allreduce([tensor]))
        return tensor

    def gather_columns(self, tensor: torch.Tensor) -> torch.Tensor:
        """Every rank's ``[rows, cols]`` side by side: ``[rows, world * cols]``."""
        self.gathers += 1
        self.gather_bytes += tensor.numel() * tensor.element_size()
        parts = [torch.empty_like(tensor) for _ in range(self.world)]
        self._wait(self._group.allgather([parts], [tensor.contiguous()]))
        return torch.cat(parts, dim=1)

    def broadcast_object(self, obj: Any = None) -> Any:
        """Rank 0 sends ``obj``; every rank returns it (followers pass nothing)."""
        if self.rank == 0:
            payload = torch.frombuffer(
                bytearray(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)), dtype=torch.uint8
            )
            size = torch.tensor([payload.numel()], dtype=torch.int64)
        else:
            size = torch.zeros(1, dtype=torch.int64)
        # A follower waits for rank 0's next message as long as rank 0 is idle; a dead rank 0 still ends the wait
        # at once (its connections close). Everything else keeps the group's timeout.
        opts = dist.BroadcastOptions()
        opts.rootRank, opts.timeout = 0, IDLE_TIMEOUT if self.rank else self._timeout
        self._wait(self._objects.broadcast([size], opts))
        if self.rank != 0:
            payload = torch.empty(int(size.item()), dtype=torch.uint8)
        self._wait(self._objects.broadcast(payload, 0))
        return obj if self.rank == 0 else pickle.loads(payload.numpy().tobytes())

    def barrier(self) -> None:
        """Wait until every rank reaches this point (a rank that exited instead raises :class:`RankFailed`)."""
        self._wait(self._objects.allreduce([torch.zeros(1)]))

    def _wait(self, work: dist.Work) -> None:
        try:
            work.wait()
        except RuntimeError as exc:  # gloo: a peer closed its connection or the timeout passed
            raise RankFailed(f"tensor-parallel rank {self.rank} of {self.world} lost its group: {exc}") from exc
