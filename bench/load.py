"""A bounded soak of the serving path on loopback: concurrent clients through the API onto real inference
servers, many adapters on pools that hold few of them, some tenants rate limited.

The API, the servers, Redis and SeaweedFS run as their own processes. Tenants upload adapters through the
API; clients then send a random mix (base model or adapter, completions or chat, streamed or not) in closed
loops for the duration. Reported: requests completed, errors by kind, p50/p99 latency (adapters against
the base model in the same run), and each process's RSS at the start (after a warm-up) and the end against
a stated bound. It passes when every request succeeded or got a 429 with ``retry-after`` and no process
grew past the bound; the exit status says which.

Run: ``python bench/load.py [--minutes 5] [--clients 32] [--adapters 20] [--resident 4] [--replicas 2]``.
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
from bench.load_platform import PlatformShape, SoakPlatform, start_platform
from bench.load_report import RssBound, SoakReport, rss_snapshot

DEFAULT_WARMUP_S = 20.0


def soak(
    platform: SoakPlatform, *, duration_s: float, clients: int, warmup_s: float, seed: int, bound: RssBound
) -> SoakReport:
    """Warm up under the same load (one-time growth happens there), then measure for ``duration_s``."""
    warmup = asyncio.run(run_clients(platform, clients, warmup_s, seed))
    start = rss_snapshot(platform.processes)
    began = time.monotonic()
    outcomes = asyncio.run(run_clients(platform, clients, duration_s, seed + 1))
    measured = time.monotonic() - began
    return SoakReport(measured, clients, warmup, outcomes, start, rss_snapshot(platform.processes), bound)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--minutes", type=float, default=5.0, help="Measured soak duration.")
    parser.add_argument("--warmup", type=float, default=DEFAULT_WARMUP_S, help="Seconds of load before measuring.")
    parser.add_argument("--clients", type=int, default=32)
    parser.add_argument("--adapters", type=int, default=20)
    parser.add_argument("--resident", type=int, default=4, help="Adapters each server's pool holds at once.")
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)

    from core.tiny_model import make_tiny_model

    shape = PlatformShape(adapters=args.adapters, resident=args.resident, replicas=args.replicas)
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
        )
        print(report.render(), flush=True)
    return 0 if report.ok else 1


if __name__ == "__main__":
    sys.exit(main())
