"""Replicas as ``loraplex server`` processes beside the API, on this machine (what ``loraplex up
--replica-idle-ttl`` uses). Each gets a free loopback port and the API's own settings (Redis, object store,
internal token), and logs to ``<data dir>/logs/server-<base>.log``. They stop with the API."""

from __future__ import annotations

import logging
import os
import shlex
import sys
import threading

from api.base_model import BaseModelInfo
from api.scaling.launchers import LaunchFailed
from core.local_services import LOOPBACK, ManagedProcess, free_port
from core.settings import ENV_PREFIX, Settings

log = logging.getLogger(__name__)

# The API runs its own threads narrow (it does no tensor work); a replica sizes its own with --threads.
NOT_INHERITED = frozenset({"OMP_NUM_THREADS", "MKL_NUM_THREADS"})
STOP_GRACE_S = 8.0  # a replica's drain (uvicorn's is 10 s) inside `loraplex up`'s 10 s for the API


class LocalLauncher:
    """One server process per base at most, started on demand."""

    kind = "local"

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.extra_args = shlex.split(settings.replica_args)
        self._processes: dict[str, ManagedProcess] = {}
        self._serial = 0
        self._lock = threading.Lock()

    def start(self, base: BaseModelInfo) -> None:
        with self._lock:
            running = self._processes.get(base.name)
            if running is not None:
                if running.alive():
                    return
                running.stop()  # one that died: reap it and close its log before starting another
            self._serial += 1
            port = free_port()
            replica_id = f"{base.name}-local-{os.getpid()}-{self._serial}"
            argv = [sys.executable, "-m", "core", "server", "--model", str(base.path), "--host", LOOPBACK]
            argv += ["--port", str(port), "--served-model-name", base.name, "--replica-id", replica_id]
            # The API's own settings (Redis, object store, internal token), whether they came from the
            # environment or not; a replica serves one base.
            env = {k: v for k, v in os.environ.items() if k not in NOT_INHERITED and not k.startswith(ENV_PREFIX)}
            env.update(self.settings.as_env())
            env.update({"LORAPLEX_BASE_MODEL": str(base.path), "LORAPLEX_BASE_MODEL_NAME": base.name})
            env.pop("LORAPLEX_BASE_MODELS", None)
            log_path = self.settings.data_dir / "logs" / f"server-{base.name}.log"
            try:
                process = ManagedProcess(replica_id, [*argv, *self.extra_args], log_path, env=env).start()
            except OSError as exc:
                raise LaunchFailed(f"could not start `loraplex server` for {base.name!r}: {exc}") from exc
            self._processes[base.name] = process
        log.info(
            "started replica %s of %s (pid %s, port %d; log %s)", replica_id, base.name, process.pid, port, log_path
        )

    def failure(self, base: BaseModelInfo) -> str | None:
        process = self._processes.get(base.name)
        if process is None or process.alive():
            return None
        code = process.proc.returncode if process.proc is not None else None
        return f"its server exited with code {code}: {process.log_tail(3).strip() or '(no output)'}"

    def replicas(self, base: BaseModelInfo) -> int:
        process = self._processes.get(base.name)
        return int(process is not None and process.alive())

    def stop(self, base: BaseModelInfo) -> None:
        with self._lock:
            process = self._processes.pop(base.name, None)
        if process is not None:
            process.stop(grace=STOP_GRACE_S)  # SIGTERM: the server drains its streams, deregisters, exits
            log.info("stopped replica %s of %s", process.name, base.name)

    def close(self) -> None:
        """Stop every replica at once (each drains in parallel), within the API's own shutdown grace."""
        with self._lock:
            processes, self._processes = list(self._processes.values()), {}
        stoppers = [threading.Thread(target=p.stop, kwargs={"grace": STOP_GRACE_S}) for p in processes]
        for stopper in stoppers:
            stopper.start()
        for stopper in stoppers:
            stopper.join()
