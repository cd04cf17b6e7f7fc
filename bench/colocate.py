"""Serving beside other work on the same cores: a training job through `loraplex up`, and busy-loop processes.

Two parts, each measured in rounds that interleave the quiet and the busy condition (the host is shared, so
only same-run ratios mean anything):

  training  ``loraplex up`` on a random-init Llama (hidden 256, 4 layers), its own split of the cores
            (``core.cpu_share``). N streaming clients call the base model through the API for ``--seconds``:
            once with the worker idle, once while a fine-tuning job trains through the worker (started
            through the API, cancelled after the round). Prints serving tok/s during training as a
            fraction of idle (target: at least 0.5).
  busy      ``loraplex server`` and the transformers + PEFT baseline (``bench/baseline_server.py``), each with
            torch's default thread count, under the same load: quiet, then beside ``--busy`` processes that
            spin forever (other tenants' jobs on a shared host). Prints each system's slowdown (quiet tok/s
            over busy tok/s; target: ours no worse than transformers').

Run: ``python bench/colocate.py`` (about 10 minutes on 2 cores), ``--part training`` or ``--part busy``.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")  # this process only drives the load

import httpx
from transformers.utils import logging as transformers_logging

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script: make `bench` importable

from bench.common import RANKS, adapter_dir_name, make_adapters
from bench.serve_load import LoadPlan, run_load
from bench.serve_stats import RunSummary, summarize
from bench.serve_systems import OursOptions, ServerUnderTest, child_env, loraplex_command, start_baseline, start_ours
from bench.serve_workload import LengthRange, WorkItem, workload
from core.cpu_share import available_cores, split_cores
from core.local_services import LOOPBACK, free_port
from core.tiny_model import TinyModelSpec, make_tiny_model

SPEC = TinyModelSpec(hidden=256, layers=4, heads=4, kv_heads=2, seed=0)
WORDS = ("alpha", "bravo", "charlie", "delta", "echo", "foxtrot", "golf", "hotel", "india", "juliet", "kilo", "lima")
UP_TIMEOUT_S = 300.0


def say(line: str = "") -> None:
    print(line, flush=True)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--part", choices=("training", "busy", "all"), default="all")
    parser.add_argument("--seconds", type=float, default=20.0, help="load per round and condition")
    parser.add_argument("--rounds", type=int, default=2, help="quiet/busy pairs per system")
    parser.add_argument("--clients", type=int, default=8, help="concurrent streaming clients")
    parser.add_argument("--busy", type=int, default=2, help="spinning processes in the busy condition")
    parser.add_argument("--prompt-len", default="16:128")
    parser.add_argument("--output-len", default="16:64")
    return parser.parse_args()


def items(args: argparse.Namespace, seed: int) -> Iterator[WorkItem]:
    return workload(1, 0.0, LengthRange.parse(args.prompt_len), LengthRange.parse(args.output_len), seed)


def load_round(base_url: str, model: str, args: argparse.Namespace, seed: int, headers: dict[str, str]) -> RunSummary:
    plan = LoadPlan(args.clients, duration_s=args.seconds)
    records, wall = asyncio.run(run_load(base_url, [model], items(args, seed), plan, headers=headers))
    summary = summarize(model, records, wall)
    if summary.errors:
        raise SystemExit(f"requests failed: {summary.errors}")
    return summary


@contextmanager
def spinning(count: int) -> Iterator[None]:
    """``count`` processes that spin on a core each until the block ends."""
    procs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(count)]
    try:
        time.sleep(0.5)  # let the scheduler see them as runnable hogs
        yield
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()


def mean(values: list[float]) -> float:
    return sum(values) / len(values)


# ----- training beside serving -------------------------------------------------------------------------------


class Platform:
    """`loraplex up` in a temp data dir, and a tenant's client for it."""

    def __init__(self, model_dir: Path, workdir: Path) -> None:
        self.data_dir = workdir / "platform"
        self.port = free_port()
        self.log = workdir / "up.log"
        env = child_env(workdir, 1)
        env.pop("OMP_NUM_THREADS")  # up gives each component its share
        env["LORAPLEX_DATA_DIR"] = str(self.data_dir)
        # The load is the point here, not the tenant's rate limits.
        env.update(LORAPLEX_DEFAULT_REQUESTS_PER_MINUTE="0", LORAPLEX_DEFAULT_TOKENS_PER_MINUTE="0")
        argv = [*loraplex_command(), "up", "--base-model", str(model_dir), "--port", str(self.port)]
        with open(self.log, "wb") as out:
            self.process = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        self.api = f"http://{LOOPBACK}:{self.port}"
        self.model = model_dir.name
        self._wait(lambda: "admin key:" in self.output(), "the admin key")
        tenant = json.loads(
            subprocess.run(
                [*loraplex_command(), "admin", "create-tenant", "bench", "--json"],
                env=env,
                capture_output=True,
                text=True,
                check=True,
            ).stdout
        )
        self.headers = {"Authorization": f"Bearer {tenant['api_key']}"}
        self.http = httpx.Client(base_url=f"{self.api}/v1", headers=self.headers, timeout=60)
        self._wait(self._serving, "the inference server through the API")

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def cpu_line(self) -> str:
        found = re.search(r"cpu:\s+(.*)", self.output())
        return found.group(1) if found else "?"

    def _serving(self) -> bool:
        try:
            body = {"model": self.model, "prompt": "ping", "max_tokens": 1}
            return self.http.post("/completions", json=body).status_code == 200
        except httpx.HTTPError:
            return False

    def _wait(self, probe, what: str, timeout: float = UP_TIMEOUT_S) -> None:  # type: ignore[no-untyped-def]
        deadline = time.monotonic() + timeout
        while not probe():
            if self.process.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"`loraplex up` never got to {what}:\n{self.output()[-4000:]}")
            time.sleep(0.5)

    def upload_training_file(self, rows: int = 64, seed: int = 0) -> str:
        rng = random.Random(seed)
        lines = [
            json.dumps(
                {"prompt": " ".join(rng.choices(WORDS, k=48)), "completion": " " + " ".join(rng.choices(WORDS, k=16))}
            )
            for _ in range(rows)
        ]
        files = {"file": ("train.jsonl", ("\n".join(lines) + "\n").encode())}
        response = self.http.post("/files", files=files, data={"purpose": "fine-tune"})
        response.raise_for_status()
        return response.json()["id"]

    def start_training(self, file_id: str) -> str:
        """A job long enough to outlast a round; returns once it has logged a training step."""
        hyperparameters = {"n_epochs": 100, "batch_size": 8, "max_seq_len": 512, "lora_r": 16}
        body = {"model": self.model, "training_file": file_id, "hyperparameters": hyperparameters}
        response = self.http.post("/fine_tuning/jobs", json=body)
        response.raise_for_status()
        job_id = response.json()["id"]
        self._wait(lambda: self._trained(job_id), "a training step")
        return job_id

    def _trained(self, job_id: str) -> bool:
        job = self.http.get(f"/fine_tuning/jobs/{job_id}").json()
        if job["status"] in ("failed", "cancelled", "succeeded"):
            raise SystemExit(f"the training job ended before the round: {job['status']} {job.get('error')}")
        return self._steps(job_id) > 0

    def _steps(self, job_id: str) -> int:
        events = self.http.get(f"/fine_tuning/jobs/{job_id}/events", params={"limit": 100}).json()["data"]
        return sum(1 for e in events if (e.get("data") or {}).get("train_loss") is not None)

    def finish_training(self, job_id: str) -> tuple[str, int]:
        """Cancel the job; its status before the cancel (``running`` if it trained through the round) and steps."""
        status, steps = self.http.get(f"/fine_tuning/jobs/{job_id}").json()["status"], self._steps(job_id)
        self.http.post(f"/fine_tuning/jobs/{job_id}/cancel")
        self._wait(lambda: self.http.get(f"/fine_tuning/jobs/{job_id}").json()["status"] == "cancelled", "the cancel")
        return status, steps

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGINT)
            try:
                self.process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait()


def training_part(args: argparse.Namespace, model_dir: Path, workdir: Path) -> float:
    platform = Platform(model_dir, workdir)
    try:
        say(f"[training] `loraplex up` ready; {platform.cpu_line()}")
        file_id = platform.upload_training_file()
        load_round(platform.api, platform.model, args, -1, platform.headers)  # warm-up
        quiet, training = [], []
        for round_ in range(args.rounds):
            summary = load_round(platform.api, platform.model, args, round_, platform.headers)
            quiet.append(summary.tokens_per_s)
            say(f"[training] round {round_ + 1}: idle worker      {summary.tokens_per_s:7.1f} tok/s, "
                f"ITL p50/p99 {summary.itl_p50 * 1e3:.1f}/{summary.itl_p99 * 1e3:.1f} ms")  # fmt: skip
            job_id = platform.start_training(file_id)
            summary = load_round(platform.api, platform.model, args, round_, platform.headers)
            status, steps = platform.finish_training(job_id)
            if status != "running":
                raise SystemExit(f"the job was {status} before the round ended: make it longer")
            training.append(summary.tokens_per_s)
            say(f"[training] round {round_ + 1}: while training  {summary.tokens_per_s:7.1f} tok/s, "
                f"ITL p50/p99 {summary.itl_p50 * 1e3:.1f}/{summary.itl_p99 * 1e3:.1f} ms; "
                f"job trained {steps} steps")  # fmt: skip
    finally:
        platform.stop()
    fraction = mean(training) / mean(quiet)
    say(f"[training] serving keeps {fraction:.2f} of its idle tok/s while a job trains (target >= 0.50)")
    return fraction


# ----- busy neighbours ------------------------------------------------------------------------------------------


def busy_part(args: argparse.Namespace, model_dir: Path, workdir: Path) -> tuple[float, float]:
    cores = available_cores()
    adapter_root = workdir / "adapters"
    adapter_root.mkdir()
    make_adapters(model_dir, adapter_root, 1)
    adapter = adapter_dir_name(0)
    options = OursOptions(256 << 20, 1, 300.0, max(RANKS), threads=cores)
    servers: list[ServerUnderTest] = [
        start_ours(model_dir, adapter_root, workdir, options),
        start_baseline(model_dir, adapter_root, workdir, threads=cores, max_batch=args.clients),
    ]
    results: dict[str, dict[str, list[float]]] = {s.label: {"quiet": [], "busy": []} for s in servers}
    try:
        for server in servers:
            server.wait_ready()
            load_round(server.base_url, adapter, args, -1, {})  # warm-up
        for round_, server in itertools.product(range(args.rounds), servers):
            for condition in ("quiet", "busy"):
                with spinning(args.busy if condition == "busy" else 0):
                    summary = load_round(server.base_url, adapter, args, round_, {})
                results[server.label][condition].append(summary.tokens_per_s)
                say(f"[busy] round {round_ + 1}: {server.label:4s} {condition:5s} {summary.tokens_per_s:7.1f} tok/s, "
                    f"ITL p50/p99 {summary.itl_p50 * 1e3:.1f}/{summary.itl_p99 * 1e3:.1f} ms")  # fmt: skip
    finally:
        for server in servers:
            server.stop()
    slowdown = {label: mean(r["quiet"]) / mean(r["busy"]) for label, r in results.items()}
    ours, peer = slowdown["ours"], slowdown["PEFT"]
    say(f"[busy] {cores} cores, {args.busy} spinning processes: slowdown ours {ours:.2f}x, transformers+PEFT "
        f"{peer:.2f}x (target: ours no worse)")  # fmt: skip
    return ours, peer


def main() -> None:
    args = parse_args()
    transformers_logging.disable_progress_bar()
    warnings.filterwarnings("ignore", category=FutureWarning)
    split = split_cores(available_cores())
    say(f"model: random-init Llama, hidden {SPEC.hidden}, {SPEC.layers} layers, fp32 on CPU; {args.clients} "
        f"streaming clients, prompts {args.prompt_len}, outputs {args.output_len} tokens, {args.seconds:g} s a round, "
        f"{args.rounds} rounds; `loraplex up` splits: {split.describe()}")  # fmt: skip
    workdir = Path(tempfile.mkdtemp(prefix="loraplex-bench-colocate-"))
    try:
        model_dir = make_tiny_model(workdir / "colocate-llama", SPEC)
        parts = []
        if args.part in ("training", "all"):
            fraction = training_part(args, model_dir, workdir)
            parts.append(f"training_fraction={fraction:.2f}")
        if args.part in ("busy", "all"):
            ours, peer = busy_part(args, model_dir, workdir)
            parts.append(f"busy_slowdown_ours={ours:.2f} busy_slowdown_transformers={peer:.2f}")
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    say("RESULT " + " ".join(parts))


if __name__ == "__main__":
    main()
