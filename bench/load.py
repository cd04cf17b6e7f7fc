"""A bounded soak of the serving path on loopback: concurrent clients through the API onto real inference
servers, many adapters on pools that hold few of them, some tenants rate limited.

The API, the servers, Redis and SeaweedFS run as their own processes. Tenants upload adapters through the
API; clients then send a random mix (base model or adapter, completions or chat, streamed or not) in closed
loops for the duration. Reported: requests completed, errors by kind, p50/p99 latency (adapters against
the base model in the same run), and each process's RSS at the start (after a warm-up) and the end against
a stated bound. It passes when every request succeeded or got a 429 with ``retry-after`` and no process
grew past the bound; the exit status says which.

Optionally a fine-tuning job keeps training beside the serving (``--train``) and one replica is killed and
started again mid-soak (``--crash-at 0.5``): streams it was answering break with an error event (reported
apart, as expected); every other request must still succeed or get a 429.

Run: ``python bench/load.py [--minutes 5] [--clients 32] [--adapters 20] [--resident 4] [--replicas 2]
[--tenants 4] [--train] [--crash-at 0.5]``; ``--everything`` is issue 25's soak (10 minutes, 32 clients,
3 tenants, 200 adapters over pools of 8, training, a crash halfway).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")  # this process only generates load; torch threads would spin
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script: make `bench` and `tests` importable

from bench.load_clients import run_clients
from bench.load_crash import Crash
from bench.load_platform import PlatformShape, SoakPlatform, start_platform
from bench.load_report import RssBound, SoakReport, rss_snapshot
from bench.load_training import TrainingLoad

DEFAULT_WARMUP_S = 20.0


def soak(
    platform: SoakPlatform,
    *,
    duration_s: float,
    clients: int,
    warmup_s: float,
    seed: int,
    bound: RssBound,
    crash_at: float | None = None,
    training: bool = False,
) -> SoakReport:
    """Warm up under the same load (one-time growth happens there), then measure for ``duration_s``.

    ``crash_at``: the fraction of the measured period at which replica 0 is killed (SIGKILL) and started
    again. ``training``: the second tenant keeps a fine-tuning job training from warm-up to the end."""
    with ExitStack() as stack:
        trainer = stack.enter_context(TrainingLoad(platform, platform.tenants[1])) if training else None
        warmup = asyncio.run(run_clients(platform, clients, warmup_s, seed))
        start, stores_start = rss_snapshot(platform.processes), rss_snapshot(platform.stores)
        crash = Crash(platform, replica=0, after_s=duration_s * crash_at) if crash_at is not None else None
        if crash is not None:
            stack.enter_context(crash)
        began = time.monotonic()
        outcomes = asyncio.run(run_clients(platform, clients, duration_s, seed + 1))
        measured = time.monotonic() - began
        end, stores_end = rss_snapshot(platform.processes), rss_snapshot(platform.stores)
    stores = {name: (stores_start[name], stores_end[name]) for name in stores_start}
    return SoakReport(measured, clients, warmup, outcomes, start, end, bound, crash, trainer, stores)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--minutes", type=float, default=5.0, help="Measured soak duration.")
    parser.add_argument("--warmup", type=float, default=DEFAULT_WARMUP_S, help="Seconds of load before measuring.")
    parser.add_argument("--clients", type=int, default=32)
    parser.add_argument("--adapters", type=int, default=20)
    parser.add_argument("--resident", type=int, default=4, help="Adapters each server's pool holds at once.")
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--tenants", type=int, default=4)
    parser.add_argument("--crash-at", type=float, default=None, help="Kill replica 0 at this fraction of the soak.")
    parser.add_argument("--train", action="store_true", help="Keep a fine-tuning job training throughout.")
    parser.add_argument(
        "--everything",
        action="store_true",
        help="Issue 25's soak: 10 min, 32 clients, 3 tenants, 200 adapters over pools of 8, training, a crash "
        "halfway (structured requests and shared prompts are always in the mix).",
    )
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if args.everything:
        args.minutes, args.clients, args.tenants, args.adapters, args.resident = 10, 32, 3, 200, 8
        args.crash_at, args.train = 0.5, True

    from core.tiny_model import make_tiny_model

    shape = PlatformShape(
        adapters=args.adapters, resident=args.resident, replicas=args.replicas, tenants=args.tenants, worker=args.train
    )
    with tempfile.TemporaryDirectory(prefix="loraplex-soak-") as tmp, ExitStack() as stack:
        workdir = Path(tmp)
        model_dir = make_tiny_model(workdir / "model")
        print(f"starting the platform: {shape}", flush=True)
        platform = start_platform(stack, workdir, model_dir, shape)
        print(f"soaking: {args.warmup:.0f} s warm-up, then {args.minutes:g} min measured", flush=True)
        report = soak(
            platform,
            duration_s=args.minutes * 60,
            clients=args.clients,
            warmup_s=args.warmup,
            seed=args.seed,
            bound=RssBound(),
            crash_at=args.crash_at,
            training=args.train,
        )
        print(report.render(), flush=True)
    return 0 if report.ok else 1


if __name__ == "__main__":
    sys.exit(main())
