"""A FastAPI app served by a real uvicorn on a free loopback port, in a background thread."""

from __future__ import annotations

import socket
import threading
from dataclasses import dataclass

import uvicorn
from fastapi import FastAPI

from core.local_services import LOOPBACK


@dataclass
class LiveServer:
    url: str
    app: FastAPI
    server: uvicorn.Server
    thread: threading.Thread

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)


def serve(app: FastAPI) -> LiveServer:
    """Start serving ``app``; usable at once (the socket listens before uvicorn starts, so early
    connections wait in the backlog instead of being refused)."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind((LOOPBACK, 0))
    sock.listen(128)
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="on"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, name=f"uvicorn-{port}", daemon=True)
    thread.start()
    return LiveServer(url=f"http://{LOOPBACK}:{port}", app=app, server=server, thread=thread)
