"""The ``loraplex`` command as an operator runs it, in fresh processes on an embedded SQLite database: help,
tenants and their keys, and a clear refusal of a bad setting."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest


@pytest.fixture
def run(tmp_path: Path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("LORAPLEX_")}
    env["LORAPLEX_DATA_DIR"] = str(tmp_path / "data")

    def run(*args: str, ok: bool = True, **extra_env: str) -> subprocess.CompletedProcess[str]:
        done = subprocess.run(
            [sys.executable, "-m", "core", *args], capture_output=True, text=True, env={**env, **extra_env}, timeout=120
        )
        assert (done.returncode == 0) == ok, done.stdout + done.stderr
        return done

    return run


def test_help_names_every_command(run) -> None:
    out = run("--help").stdout
    for command in ("up", "api", "worker", "server", "train", "make-tiny-model", "db", "admin"):
        assert command in out
    assert "create-tenant" in run("admin", "--help").stdout


def test_tenants_and_keys_from_the_command_line(run) -> None:
    created = json.loads(run("admin", "create-tenant", "acme", "--json").stdout)
    assert created["name"] == "acme" and created["api_key"].startswith("lpx-")
    run("admin", "create-key", "acme", "--name", "ci")
    [acme] = json.loads(run("admin", "list-tenants", "--json").stdout)
    assert (acme["id"], acme["name"], acme["active_keys"], acme["disabled"]) == (created["id"], "acme", 2, False)
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ", acme["created_at"])
    # The table is not cut to 80 columns: the whole id and an ISO time, even beside a long name.
    run("admin", "create-tenant", "a-tenant-whose-name-is-long-enough-to-squeeze-other-columns")
    table = run("admin", "list-tenants").stdout
    assert created["id"] in table and acme["created_at"] in table
    assert "a-tenant-whose-name-is-long-enough-to-squeeze-other-columns" in table

    refused = run("admin", "create-tenant", "acme", ok=False)
    assert "acme" in refused.stdout + refused.stderr  # a second tenant of that name is refused by name


def test_a_bad_setting_is_refused_with_its_name(run) -> None:
    refused = run("admin", "list-tenants", ok=False, LORAPLEX_API_PORT="not-a-port")
    assert "LORAPLEX_API_PORT" in refused.stdout + refused.stderr
