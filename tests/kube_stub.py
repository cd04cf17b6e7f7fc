"""A stand-in for the Kubernetes API server's ``deployments/scale`` subresource, and a kubeconfig pointing at it.

This is the one stand-in the tests use on purpose: no Kubernetes cluster can run on these machines. The code
under test is the real ``kubernetes`` client, loading a real kubeconfig and speaking HTTP to this server, which
records each call (method, path, bearer token, body) and keeps each Deployment's replica count.
"""

from __future__ import annotations

import json
import re
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

from core.local_services import LOOPBACK

SCALE_PATH = re.compile(r"^/apis/apps/v1/namespaces/(?P<ns>[^/]+)/deployments/(?P<name>[^/]+)/scale$")
TOKEN = "stub-service-account-token"


@dataclass
class Call:
    method: str
    path: str
    token: str | None
    body: dict | None


@dataclass
class KubeStub:
    """Deployments by (namespace, name) -> replicas; ``forbid`` makes every call a 403 (RBAC missing)."""

    url: str = ""
    replicas: dict[tuple[str, str], int] = field(default_factory=dict)
    calls: list[Call] = field(default_factory=list)
    forbid: bool = False
    on_scale: Callable[[str, int], None] | None = None  # (deployment, replicas) after each accepted PATCH

    def patches(self) -> list[tuple[str, int]]:
        return [
            (c.path.split("/")[-2], c.body["spec"]["replicas"]) for c in self.calls if c.method == "PATCH" and c.body
        ]

    def kubeconfig(self, path: Path, namespace: str) -> Path:
        path.write_text(
            json.dumps(
                {
                    "apiVersion": "v1",
                    "kind": "Config",
                    "clusters": [{"name": "stub", "cluster": {"server": self.url}}],
                    "users": [{"name": "loraplex-api", "user": {"token": TOKEN}}],
                    "contexts": [
                        {"name": "stub", "context": {"cluster": "stub", "user": "loraplex-api", "namespace": namespace}}
                    ],
                    "current-context": "stub",
                }
            )
        )
        return path


def _handler(stub: KubeStub) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args: object) -> None:
            pass

        def _answer(self, status: int, body: dict) -> None:
            data = json.dumps(body).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def _handle(self) -> None:
            length = int(self.headers.get("Content-Length") or 0)
            body = json.loads(self.rfile.read(length)) if length else None
            auth = self.headers.get("Authorization", "")
            stub.calls.append(Call(self.command, self.path, auth.removeprefix("Bearer ") or None, body))
            match = SCALE_PATH.match(self.path.split("?")[0])
            if stub.forbid or auth != f"Bearer {TOKEN}":
                self._answer(403, {"kind": "Status", "status": "Failure", "reason": "Forbidden", "code": 403})
                return
            key = (match["ns"], match["name"]) if match else None
            if key is None or key not in stub.replicas:
                self._answer(404, {"kind": "Status", "status": "Failure", "reason": "NotFound", "code": 404})
                return
            if self.command == "PATCH" and body is not None:
                stub.replicas[key] = int(body["spec"]["replicas"])
                if stub.on_scale is not None:
                    stub.on_scale(key[1], stub.replicas[key])
            count = stub.replicas[key]
            self._answer(
                200,
                {
                    "apiVersion": "autoscaling/v1",
                    "kind": "Scale",
                    "metadata": {"name": key[1], "namespace": key[0]},
                    "spec": {"replicas": count},
                    "status": {"replicas": count},
                },
            )

        do_GET = do_PATCH = _handle

    return Handler


@contextmanager
def kube_stub(deployments: dict[tuple[str, str], int]) -> Iterator[KubeStub]:
    """A stub API server on a loopback port, serving ``deployments`` until the block ends."""
    stub = KubeStub(replicas=dict(deployments))
    server = ThreadingHTTPServer((LOOPBACK, 0), _handler(stub))
    stub.url = f"http://{LOOPBACK}:{server.server_address[1]}"
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield stub
    finally:
        server.shutdown()
        server.server_close()
