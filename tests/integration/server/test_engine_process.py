"""The engine in a process of its own (``loraplex server``'s default): what crosses the pipe besides the OpenAI
surface (``test_openai_surface`` runs every route this way): a start failure with its reason, an HTTP process
that exits without stopping it, a client leaving mid-stream, and an engine process that dies under a running
stream."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import httpx
import openai
import pytest

from core.errors import ConfigError
from server.config import ServerConfig
from server.engine_loop import LoadCounts
from server.engine_process import EngineProcess
from server.metrics import ServerMetrics
from tests.integration.server.harness import NO_EOS, ServerUnderTest, running, server_config, wait_until

REPO_ROOT = Path(__file__).resolve().parents[3]
LONG = 2000  # tokens: a request that is still running whenever the test looks
PROMPT = "Once upon a time"


def process_server(model: Path) -> ServerConfig:
    return server_config(model, max_model_len=2048, engine_process=True)


def test_an_engine_that_cannot_start_says_why_across_the_pipe(tiny_model_dir: Path, tmp_path: Path) -> None:
    model = tmp_path / "unsupported"
    model.mkdir()
    config = (tiny_model_dir / "config.json").read_text().replace('"llama"', '"gpt2"')
    (model / "config.json").write_text(config)
    with pytest.raises(ConfigError, match="model_type 'gpt2' is not served"):
        EngineProcess(server_config(model, engine_process=True), ServerMetrics(), None)


def test_an_http_process_that_exits_without_stopping_its_engine_exits_and_takes_it_along(
    tiny_model_dir: Path,
) -> None:
    """multiprocessing's exit hook sends daemonic children SIGTERM and then joins them without a timeout; the
    engine process ignores SIGTERM (its HTTP process drains first), so our own hook must end it first."""
    script = (
        "from server.engine_process import EngineProcess\n"
        "from server.metrics import ServerMetrics\n"
        "from tests.integration.server.harness import server_config\n"
        f"engine = EngineProcess(server_config({str(tiny_model_dir)!r}, engine_process=True), ServerMetrics(), None)\n"
        "engine.start()\n"
        "print(engine.pid, flush=True)\n"
    )
    run = subprocess.run([sys.executable, "-c", script], cwd=REPO_ROOT, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    with pytest.raises(ProcessLookupError):
        os.kill(int(run.stdout.split()[-1]), 0)


def test_a_client_gone_mid_stream_frees_its_pages_and_counts(tiny_model_dir: Path) -> None:
    with running(process_server(tiny_model_dir)) as server:
        loop = server.runtime.loop
        assert isinstance(loop, EngineProcess) and loop.pid != os.getpid()
        stream = long_stream(server)
        chunks = iter(stream)
        for _ in range(3):
            next(chunks)
        assert loop.counts() == LoadCounts(running=1, waiting=0) and loop.view.pool.kv_pages > 0
        stream.close()
        wait_until(
            lambda: loop.counts() == LoadCounts(0, 0) and loop.view.pool.kv_pages == 0,
            "the cancelled request's pages and count to be released",
        )
        generated = server.metrics().value("loraplex_generation_tokens_total")
        assert 3 <= generated < LONG  # relayed from the engine process, and the request stopped early


def test_a_killed_engine_process_ends_the_stream_and_readiness(tiny_model_dir: Path) -> None:
    with running(process_server(tiny_model_dir)) as server:
        loop = server.runtime.loop
        assert isinstance(loop, EngineProcess) and loop.pid is not None
        chunks = iter(long_stream(server))
        next(chunks)
        os.kill(loop.pid, signal.SIGKILL)
        with pytest.raises(openai.APIError, match="the engine process exited with code -9"):
            for _ in chunks:
                pass
        assert not loop.alive and loop.counts() == LoadCounts(0, 0)
        ready = httpx.get(f"{server.url}/ready", headers=server.headers, timeout=10.0)
        assert ready.status_code == 503 and ready.json()["error"]["code"] == "engine_failed"
        with pytest.raises(openai.InternalServerError) as refused:
            server.client().completions.create(model=server.runtime.base_name, prompt=PROMPT, max_tokens=2)
        assert refused.value.status_code == 503


def long_stream(server: ServerUnderTest) -> openai.Stream:
    return server.client().completions.create(
        model=server.runtime.base_name, prompt=PROMPT, max_tokens=LONG, stream=True, extra_body=NO_EOS
    )
