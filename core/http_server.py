"""The uvicorn server every loraplex HTTP process (the API, inference servers) runs, configured in one place.

Keep-alive: uvicorn closes an idle connection after 5 s by default, and httpx (the openai SDK, our own API
toward its replicas) keeps one for reuse for 5 s too. A client that reuses a connection in the instant the
server closes it gets a reset, not an answer; a load balancer with a longer idle timeout than its backends
(60 s on AWS ALB) meets the same race on every quiet connection. So servers keep connections well past
what their clients do (``LORAPLEX_HTTP_KEEP_ALIVE_S``, 75 s as nginx), and the client closes first.
"""

from __future__ import annotations

import uvicorn
from starlette.types import ASGIApp

from core.settings import Settings


def http_server(
    app: ASGIApp, settings: Settings, *, host: str, port: int, graceful_shutdown_s: int | None = None
) -> uvicorn.Server:
    """A uvicorn server for ``app``; ``graceful_shutdown_s``: how long open requests may finish on SIGTERM
    (None: as long as they take)."""
    config = uvicorn.Config(
        app,
        host=host,
        port=port,
        log_level=settings.log_level,
        timeout_keep_alive=settings.http_keep_alive_s,
        timeout_graceful_shutdown=graceful_shutdown_s,
    )
    return uvicorn.Server(config)
