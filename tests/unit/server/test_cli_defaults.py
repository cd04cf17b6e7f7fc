"""``loraplex server``'s option defaults are literals (importing the engine's config would load torch for every
``loraplex`` command); they must stay the defaults ``ServerConfig`` documents."""

from __future__ import annotations

import dataclasses

import typer
from typer.main import get_command

from server.cli import register
from server.config import ServerConfig

# Resolved at start-up rather than defaulted: the model is required, the largest rank comes from
# LORAPLEX_MAX_LORA_RANK, and a replica without an id gets a random one.
RESOLVED_LATER = {"model", "max_lora_rank", "replica_id"}


def test_every_server_option_defaults_to_the_configs_default() -> None:
    app = typer.Typer()
    register(app)
    app.command("other")(lambda: None)  # two commands make a group, so the server command keeps its name
    options = {p.name: p.default for p in get_command(app).commands["server"].params}
    compared = 0
    for field in dataclasses.fields(ServerConfig):
        if field.name not in options or field.name in RESOLVED_LATER:
            continue
        assert options[field.name] == field.default, f"--{field.name.replace('_', '-')}"
        compared += 1
    assert compared >= 20  # the step stretch, the host cache's bytes and the rest
    assert {"step_stretch", "host_cache_bytes"} <= options.keys()
