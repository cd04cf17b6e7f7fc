"""A follower rank: its own slices of the model and its own pool, driven step by step by rank 0.

It builds the same engine parts as rank 0 (weights, pool, adapter tables, runner) for its shard, then does only
what rank 0 tells it, in order: run a step's forward (its all-reduces and the logits gather meet rank 0's), write
an adapter's page images where rank 0 placed it, clear a slot, stop. It schedules nothing, allocates nothing and
samples nothing. When its group breaks (rank 0 died) it exits non-zero.
"""

from __future__ import annotations

import logging
import pickle
import sys

import torch

from server.engine.builder import build_engine_parts, resolve_device
from server.engine.config import EngineConfig
from server.engine.model_runner import ModelRunner
from server.memory.adapter_pages import AdapterPages
from server.parallel.group import GroupAddress, RankFailed, TensorParallel, join_store
from server.parallel.wire import Cleared, Placement, Step, Stop

log = logging.getLogger(__name__)


def follower_main(config: EngineConfig, address: GroupAddress, rank: int) -> None:
    """A follower process's work (started by :class:`server.parallel.followers.Followers`)."""
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s tp-rank{rank} %(levelname)s %(name)s: %(message)s")
    device, _ = resolve_device(config, rank)
    try:
        tp = TensorParallel(join_store(address), address, rank, device)
        parts = build_engine_parts(config, tp)
        follow(parts.runner, parts.adapters.pages, tp)
    except RankFailed as exc:
        log.error("%s; exiting", exc)
        sys.exit(1)


@torch.inference_mode()
def follow(runner: ModelRunner, pages: AdapterPages, tp: TensorParallel) -> None:
    """Carry out rank 0's messages, in order, until it says stop."""
    while True:
        message = tp.broadcast_object()
        if isinstance(message, Step):
            runner.follow(message.batch(), message.all_logits)
        elif isinstance(message, Placement):
            plan = message.plan
            pages.publish(message.slot, message.pages, plan.rank_images[tp.rank - 1], plan)
        elif isinstance(message, Cleared):
            pages.unpublish(message.slot)
        elif isinstance(message, Stop):
            return
        else:
            raise TypeError(f"unknown message from rank 0: {message!r}")


if __name__ == "__main__":  # python -m server.parallel.follower, its arguments pickled on stdin
    follower_main(*pickle.load(sys.stdin.buffer))
