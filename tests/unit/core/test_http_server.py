"""The HTTP server of the API and inference servers keeps idle connections longer than clients keep theirs,
so a client never reuses a connection the server is closing (a reset instead of an answer)."""

from __future__ import annotations

import socket
import threading
import time

import httpx
from starlette.types import Receive, Scope, Send

from core.http_server import http_server
from core.local_services import LOOPBACK
from core.settings import Settings

REQUEST = b"GET / HTTP/1.1\r\nHost: test\r\n\r\n"


async def hello(scope: Scope, receive: Receive, send: Send) -> None:
    if scope["type"] != "http":
        return
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"2")]})
    await send({"type": "http.response.body", "body": b"ok"})


def answer(conn: socket.socket) -> bytes:
    """One response read off a kept-alive connection (b"" if the server closed it)."""
    data = b""
    while not data.endswith(b"ok"):
        piece = conn.recv(4096)
        if not piece:
            return data
        data += piece
    return data


def test_servers_outlast_the_keep_alive_of_httpx_clients_and_load_balancers() -> None:
    assert Settings().http_keep_alive_s > httpx.Limits().keepalive_expiry  # httpx, hence the openai SDK: 5 s
    assert Settings().http_keep_alive_s > 60  # AWS ALB's default idle timeout


def test_an_idle_connection_stays_open_for_the_keep_alive_then_closes() -> None:
    listener = socket.socket()
    listener.bind((LOOPBACK, 0))
    listener.listen(8)
    server = http_server(hello, Settings(http_keep_alive_s=1, log_level="warning"), host=LOOPBACK, port=0)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [listener]}, daemon=True)
    thread.start()
    try:
        with socket.create_connection(listener.getsockname(), timeout=10) as conn:
            conn.sendall(REQUEST)
            assert answer(conn).startswith(b"HTTP/1.1 200")
            time.sleep(0.5)  # idle for half the keep-alive: the same connection still answers
            conn.sendall(REQUEST)
            assert answer(conn).startswith(b"HTTP/1.1 200")
            time.sleep(2.0)  # idle past it: the server has closed the connection already
            conn.settimeout(0.5)
            assert conn.recv(4096) == b""
    finally:
        server.should_exit = True
        thread.join(timeout=10)
