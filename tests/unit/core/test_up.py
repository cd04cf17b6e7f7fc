"""``loraplex up`` supervising its children: one that exits with a configuration error (exit 2) is given up at
once with its last words shown; one that crashes otherwise is restarted, saying why. Each child runs with its
own share of the cores on top of the platform's environment."""

from __future__ import annotations

import os
import sys
from pathlib import Path

from core.base_catalogue import BaseEntry, base_catalogue
from core.settings import load_settings
from core.up import Child, _check_child, _entries


def exited(child: Child, env: dict[str, str], logs: Path) -> Child:
    child.start(env, logs)
    assert child.process is not None and child.process.proc is not None
    child.process.proc.wait(timeout=60)
    return child


def test_a_child_with_a_configuration_error_is_not_restarted_and_says_why(tmp_path: Path) -> None:
    env, said = dict(os.environ), list[str]()
    script = "import sys; print('error: the engine failed to start: model_type gpt_neox is not served'); sys.exit(2)"
    server = exited(Child("server", [sys.executable, "-c", script]), env, tmp_path)

    _check_child(server, env, tmp_path, said.append)
    assert server.state == "failed" and server.process is None and server.restarts == []
    assert "server cannot start: error: the engine failed to start: model_type gpt_neox is not served" in said[-1]
    assert str(tmp_path / "server.log") in said[-1]


def test_a_crashed_child_is_restarted_naming_its_last_words(tmp_path: Path) -> None:
    env, said = dict(os.environ), list[str]()
    worker = exited(Child("worker", [sys.executable, "-c", "raise SystemExit('lost the database')"]), env, tmp_path)

    _check_child(worker, env, tmp_path, said.append)
    try:
        assert said[-1] == "[yellow]worker exited with 1: lost the database; restarting"
        assert worker.process is not None and len(worker.restarts) == 1
    finally:
        assert worker.process is not None
        worker.process.stop()


def test_a_child_runs_with_its_own_environment_on_top_of_the_platforms(tmp_path: Path) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "8", "LORAPLEX_DATA_DIR": str(tmp_path)}
    script = "import os; print(os.environ['OMP_NUM_THREADS'], os.environ['LORAPLEX_DATA_DIR'])"
    child = exited(Child("server", [sys.executable, "-c", script], env={"OMP_NUM_THREADS": "3"}), env, tmp_path)
    assert child.process is not None and child.process.proc is not None and child.process.proc.returncode == 0
    assert (tmp_path / "server.log").read_text().split() == ["3", str(tmp_path)]


def test_up_serves_the_configured_catalogue_unless_bases_are_given(tmp_path: Path) -> None:
    configured = load_settings(data_dir=tmp_path, base_model="/m/tiny-llama", base_models="q=/m/tiny-qwen")
    assert _entries(configured, [], tmp_path) == base_catalogue(configured)  # both configured bases, not one
    assert _entries(configured, ["/m/a", "/m/b"], tmp_path) == [BaseEntry("a", "/m/a"), BaseEntry("b", "/m/b")]
    named = load_settings(data_dir=tmp_path, base_model_name="mine")
    assert _entries(named, ["/m/a", "/m/b"], tmp_path) == [BaseEntry("mine", "/m/a"), BaseEntry("b", "/m/b")]
