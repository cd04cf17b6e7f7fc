"""The `loraplex` command. Components add their own commands through a ``register(app)`` function."""

from __future__ import annotations

import importlib
import json
import sys
from datetime import UTC, datetime
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.table import Table

from core.errors import ConfigError, LoraplexError
from core.settings import Settings, load_settings

app = typer.Typer(
    name="loraplex",
    help="Fine-tune and serve LoRA adapters for many tenants on shared GPUs.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
)
db_app = typer.Typer(help="Database schema.", no_args_is_help=True)
admin_app = typer.Typer(help="Tenants and API keys.", no_args_is_help=True)
app.add_typer(db_app, name="db")
app.add_typer(admin_app, name="admin")
console = Console(stderr=True)

# Modules that contribute commands; each defines register(app). Imported lazily at start-up so
# `loraplex --help` stays fast (they import torch, FastAPI, Celery only inside their commands).
COMPONENT_CLIS = ("api.cli", "worker.cli", "server.cli", "trainer.cli", "core.up")


def settings_or_exit(**overrides: object) -> Settings:
    """Settings from the environment, or a clean exit naming the bad variable."""
    try:
        return load_settings(**overrides)
    except ConfigError as exc:
        console.print(f"[red]error:[/red] {exc.message}")
        raise typer.Exit(2) from None


def ready_database(settings: Settings) -> str:
    """The database URL, migrated: SQLite is brought up to date in place; others must be already."""
    from core import db

    url = settings.db_url
    if url.startswith("sqlite"):
        db.upgrade(url)
        return url
    current, head = db.current_revision(url), db.head_revision()
    if current != head:
        console.print(f"[red]error:[/red] database at revision {current}, code needs {head}: run `loraplex db upgrade`")
        raise typer.Exit(2)
    return url


@app.command("make-tiny-model")
def make_tiny_model_cmd(
    out_dir: Annotated[Path, typer.Argument(help="Directory to write the model into.")],
    hidden: Annotated[int, typer.Option(help="Hidden size.")] = 128,
    layers: Annotated[int, typer.Option(help="Decoder layers.")] = 2,
    heads: Annotated[int, typer.Option(help="Attention heads.")] = 4,
    kv_heads: Annotated[int, typer.Option(help="Key/value heads (GQA).")] = 2,
    intermediate: Annotated[int | None, typer.Option(help="MLP width (default 8/3 * hidden).")] = None,
    seed: Annotated[int, typer.Option(help="Weight seed; same arguments give identical files.")] = 0,
    family: Annotated[
        str,
        typer.Option(
            help="llama, mistral, qwen2 (q/k/v biases), qwen3 (q/k norms), phi3 (fused, LongRoPE), "
            "gemma2 (soft-capping) or gemma3 (Gemma 3 text: local and global rope)."
        ),
    ] = "llama",
    head_dim: Annotated[
        int | None, typer.Option(help="Head width (default hidden/heads; qwen3: twice that, as Qwen3 does).")
    ] = None,
    sliding_window: Annotated[
        int | None,
        typer.Option(
            help="mistral/qwen2/qwen3/phi3/gemma2/gemma3: a window that binds (qwen: upper half of the layers; "
            "gemma: local layers). Default: none (phi3, gemma2, gemma3: 16 tokens)."
        ),
    ] = None,
) -> None:
    """Write a small random-init Llama-family model with a byte-level tokenizer (for tests and trying things out)."""
    from core.tiny_model import TinyModelSpec, make_tiny_model

    try:
        spec = TinyModelSpec(
            hidden=hidden,
            layers=layers,
            heads=heads,
            kv_heads=kv_heads,
            intermediate=intermediate,
            seed=seed,
            family=family,
            head_dim=head_dim,
            sliding_window=sliding_window,
        )
    except ValueError as exc:
        console.print(f"[red]error:[/red] {exc}")
        raise typer.Exit(2) from None
    path = make_tiny_model(out_dir, spec)
    name = {
        "llama": "Llama",
        "mistral": "Mistral",
        "qwen2": "Qwen2",
        "qwen3": "Qwen3",
        "phi3": "Phi-3",
        "gemma2": "Gemma 2",
        "gemma3": "Gemma 3",
    }[family]
    console.print(f"wrote tiny {name} to {path}")


@db_app.command("upgrade")
def db_upgrade(
    revision: Annotated[str, typer.Argument(help="Target revision.")] = "head",
) -> None:
    """Create or migrate the schema at LORAPLEX_DATABASE_URL (default: SQLite in the data dir)."""
    from core import db

    settings = settings_or_exit()
    db.upgrade(settings.db_url, revision)
    console.print(f"database at revision {db.current_revision(settings.db_url)}")


@db_app.command("current")
def db_current() -> None:
    """Print the schema revision of the configured database."""
    from core import db

    settings = settings_or_exit()
    print(db.current_revision(settings.db_url) or "(empty)")


@admin_app.command("create-tenant")
def create_tenant_cmd(
    name: Annotated[str, typer.Argument(help="Tenant name: lowercase letters, digits, '-', '_'.")],
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON (id, name, api_key).")] = False,
) -> None:
    """Create a tenant and print its API key (shown only this once)."""
    from core.accounts import create_tenant
    from core.db import make_engine, session_scope

    settings = settings_or_exit()
    engine = make_engine(ready_database(settings))
    with session_scope(engine) as session:
        tenant, key = create_tenant(session, name)
    if as_json:
        print(json.dumps({"id": tenant.id, "name": tenant.name, "api_key": key}))
    else:
        console.print(f"tenant [bold]{tenant.name}[/bold] ({tenant.id})")
        console.print("API key (store it now, it is not shown again):")
        print(key)


def iso_time(unix_seconds: int) -> str:
    """``2026-12-06T20:17:43Z``: what the API's Unix seconds mean, readable and sortable."""
    return datetime.fromtimestamp(unix_seconds, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def print_table(columns: tuple[str, ...], rows: list[list[str]]) -> None:
    """A table whose cells are never cut: ids and names must copy whole, so it may be wider than the terminal."""
    table = Table(*columns)
    for column in table.columns:
        column.no_wrap = True
    for row in rows:
        table.add_row(*row)
    widths = [max(len(c), *(len(r[i]) for r in rows)) if rows else len(c) for i, c in enumerate(columns)]
    console = Console()
    console.width = max(console.width, sum(widths) + 3 * len(columns) + 1)  # cells, padding and borders
    console.print(table)


@admin_app.command("list-tenants")
def list_tenants_cmd(
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON.")] = False,
) -> None:
    """List tenants with their key counts: full ids, creation times in ISO 8601 (UTC)."""
    from sqlmodel import func, select

    from core.db import make_engine, session_scope
    from core.models import ApiKey, Tenant

    settings = settings_or_exit()
    engine = make_engine(ready_database(settings))
    with session_scope(engine) as session:
        rows = session.exec(
            select(Tenant, func.count(ApiKey.id))
            .join(ApiKey, (ApiKey.tenant_id == Tenant.id) & ApiKey.revoked_at.is_(None), isouter=True)
            .group_by(Tenant.id)
            .order_by(Tenant.created_at, Tenant.id)
        ).all()
    items = [
        {"id": t.id, "name": t.name, "disabled": t.disabled, "active_keys": n, "created_at": iso_time(t.created_at)}
        for t, n in rows
    ]
    if as_json:
        print(json.dumps(items))
        return
    print_table(("id", "name", "disabled", "active keys", "created"), [[str(v) for v in i.values()] for i in items])


@admin_app.command("create-key")
def create_key_cmd(
    tenant: Annotated[str, typer.Argument(help="Tenant id or name.")],
    name: Annotated[str | None, typer.Option(help="A label for the key.")] = None,
) -> None:
    """Issue another API key for a tenant (printed once)."""
    from core.accounts import create_api_key, get_tenant
    from core.db import make_engine, session_scope

    settings = settings_or_exit()
    engine = make_engine(ready_database(settings))
    with session_scope(engine) as session:
        _, key = create_api_key(session, get_tenant(session, tenant), name=name)
    print(key)


@admin_app.command("revoke-key")
def revoke_key_cmd(key_id: Annotated[str, typer.Argument(help="Key id (key-...).")]) -> None:
    """Revoke an API key; requests with it fail with 401 from then on."""
    from core.accounts import revoke_api_key
    from core.db import make_engine, session_scope

    settings = settings_or_exit()
    engine = make_engine(ready_database(settings))
    with session_scope(engine) as session:
        revoke_api_key(session, key_id)
    console.print(f"revoked {key_id}")


def _register_components() -> None:
    for module_name in COMPONENT_CLIS:
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as exc:
            if exc.name == module_name:  # that component is not part of this build
                continue
            raise
        module.register(app)


def main() -> None:
    """Entry point of the `loraplex` console script."""
    _register_components()
    try:
        app()
    except LoraplexError as exc:
        console.print(f"[red]error:[/red] {exc.message}")
        # 2: the request or configuration is wrong (retrying will not help); 1: anything else.
        sys.exit(2 if exc.status_code < 500 or isinstance(exc, ConfigError) else 1)
