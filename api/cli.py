"""``loraplex api``: serve the control plane with uvicorn."""

from __future__ import annotations

import logging
from typing import Annotated

import typer


def register(app: typer.Typer) -> None:
    """Add the ``api`` command to the ``loraplex`` CLI."""

    @app.command("api")
    def api_cmd(
        host: Annotated[str | None, typer.Option(help="Interface to bind (LORAPLEX_API_HOST).")] = None,
        port: Annotated[int | None, typer.Option(help="Port (LORAPLEX_API_PORT).")] = None,
    ) -> None:
        """Serve the OpenAI-compatible API (docs at /docs); SQLite databases are migrated first."""
        from api.app import create_app
        from core.cli import console, ready_database, settings_or_exit
        from core.errors import ConfigError
        from core.http_server import http_server
        from core.settings import LOG_FORMAT

        settings = settings_or_exit()
        # The app's own loggers (cold starts, scale-downs, background consumers); uvicorn configures its own.
        logging.basicConfig(level=settings.log_level.upper(), format=LOG_FORMAT)
        ready_database(settings)
        try:
            application = create_app(settings)
        except ConfigError as exc:
            console.print(f"[red]error:[/red] {exc.message}")
            raise typer.Exit(2) from None
        http_server(application, settings, host=host or settings.api_host, port=port or settings.api_port).run()
