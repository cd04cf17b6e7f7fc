"""Base models named by Hugging Face hub id, as an operator starts them with the network off: ``loraplex server``
and ``loraplex train`` read ``org/name`` from the HF cache (``HF_HOME``), and stop at start when it is not there."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from openai import OpenAI

from core.local_services import LOOPBACK, ManagedProcess, free_port
from tests.hf_cache import cache_repo

REPO = "acme/tiny-llama"
REPO_ROOT = Path(__file__).resolve().parents[3]


@pytest.fixture(scope="module")
def hf_home(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path) -> Path:
    home = tmp_path_factory.mktemp("hf-home")
    cache_repo(home / "hub", REPO, tiny_model_dir)
    return home


@pytest.fixture
def env(hf_home: Path, tmp_path: Path) -> dict[str, str]:
    """The environment of an offline machine whose HF cache holds ``acme/tiny-llama``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("LORAPLEX_", "HF_"))}
    env.update({
        "HF_HOME": str(hf_home), "HF_HUB_OFFLINE": "1", "LORAPLEX_DATA_DIR": str(tmp_path / "data"),
        "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "COLUMNS": "250",
    })  # fmt: skip
    return env


@pytest.fixture
def train_data(tmp_path: Path) -> Path:
    path = tmp_path / "train.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"Item {i}:", "completion": f" {i * 7}"}) + "\n" for i in range(12)))
    return path


def loraplex(env: dict[str, str], *args: str) -> tuple[int, str]:
    done = subprocess.run(
        [sys.executable, "-m", "core", *args], env=env, cwd=REPO_ROOT, capture_output=True, text=True, timeout=300
    )
    return done.returncode, " ".join((done.stdout + done.stderr).split())  # rich wraps long lines


def test_the_server_serves_a_cached_hub_model_under_its_repo_id(env: dict[str, str], tmp_path: Path) -> None:
    port = free_port()
    url = f"http://{LOOPBACK}:{port}"
    argv = [
        sys.executable, "-m", "core", "server", "--model", REPO, "--host", LOOPBACK, "--port", str(port),
        "--pool-bytes", str(4 << 20), "--max-model-len", "512", "--threads", "1",
    ]  # fmt: skip
    process = ManagedProcess("server", argv, tmp_path / "server.log", env=env, cwd=REPO_ROOT).start()
    try:
        process.wait_ready(lambda: _ready(url), timeout=120)
        client = OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
        assert [m.id for m in client.models.list()] == [REPO]
        answer = client.completions.create(model=REPO, prompt="hello", max_tokens=3)
        assert answer.usage is not None and answer.usage.completion_tokens > 0
    finally:
        process.stop()


def test_training_on_a_cached_hub_model_records_its_repo_id(
    env: dict[str, str], train_data: Path, tmp_path: Path
) -> None:
    out = tmp_path / "adapter"
    code, output = loraplex(
        env, "train", "--model", REPO, "--data", str(train_data), "--out", str(out),
        "--epochs", "1", "--batch-size", "4", "--lora-r", "2", "--max-seq-len", "64",
    )  # fmt: skip
    assert code == 0, output
    assert "3 steps" in output
    assert json.loads((out / "manifest.json").read_text())["base_model"]["name"] == REPO
    assert json.loads((out / "adapter_config.json").read_text())["base_model_name_or_path"] == REPO


@pytest.mark.parametrize("command", ["server", "train"])
def test_a_hub_model_missing_from_the_cache_stops_the_command_at_start(
    command: str, env: dict[str, str], train_data: Path, tmp_path: Path
) -> None:
    extra = {
        "server": ["--port", str(free_port())],
        "train": ["--data", str(train_data), "--out", str(tmp_path / "adapter")],
    }[command]
    code, output = loraplex(env, command, "--model", "acme/absent", *extra)
    assert code == 2, output
    assert "--model acme/absent: no such directory" in output
    assert "not (completely) in the Hugging Face cache" in output and "HF_HUB_OFFLINE is set" in output
    assert "pass a local model directory instead" in output


def _ready(url: str) -> bool:
    try:
        return httpx.get(f"{url}/ready", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False
