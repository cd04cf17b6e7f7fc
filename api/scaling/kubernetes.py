"""Replicas as a server Deployment's pods, scaled through the Kubernetes API with the official client.

Each base has its own Deployment (``LORAPLEX_KUBERNETES_DEPLOYMENTS``: ``BASE=DEPLOYMENT`` pairs) in one
namespace (``LORAPLEX_KUBERNETES_NAMESPACE``, else the API pod's own). Starting a base sets its Deployment's
``scale`` subresource to one replica when it is at zero; stopping sets it to zero. With KEDA scaling the same
Deployments on ``loraplex_api_replicas_wanted`` (infra/k8s), both act on the same signal: the API only makes
the step from zero at once, rather than after the next metrics poll. Credentials: the pod's service account
in a cluster, else the kubeconfig (``KUBECONFIG``). The API needs get and patch on ``deployments/scale``.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

from api.base_model import BaseModelInfo, BaseModels
from api.scaling.launchers import LaunchFailed
from core.errors import ConfigError
from core.settings import Settings

log = logging.getLogger(__name__)

SERVICE_ACCOUNT_NAMESPACE = Path("/var/run/secrets/kubernetes.io/serviceaccount/namespace")


def parse_deployments(text: str | None, bases: BaseModels) -> dict[str, str]:
    """``BASE=DEPLOYMENT,...`` as a mapping; every served base must have one (else ``ConfigError``)."""
    deployments: dict[str, str] = {}
    for pair in (text or "").split(","):
        if not pair.strip():
            continue
        base, sep, deployment = pair.partition("=")
        if not sep or not base.strip() or not deployment.strip():
            raise ConfigError(f"LORAPLEX_KUBERNETES_DEPLOYMENTS: {pair.strip()!r} is not BASE=DEPLOYMENT")
        deployments[base.strip()] = deployment.strip()
    missing = [name for name in bases.names if name not in deployments]
    if missing:
        raise ConfigError(
            f"LORAPLEX_KUBERNETES_DEPLOYMENTS names no server Deployment for {', '.join(map(repr, missing))}; "
            "give BASE=DEPLOYMENT for every base model"
        )
    return deployments


class KubernetesLauncher:
    """Scales each base's server Deployment between zero and one; KEDA (or an operator) takes it higher."""

    kind = "kubernetes"

    def __init__(self, apps: Any, namespace: str, deployments: dict[str, str]) -> None:
        self.apps = apps  # kubernetes.client.AppsV1Api
        self.namespace = namespace
        self.deployments = deployments

    @classmethod
    def from_settings(cls, settings: Settings, bases: BaseModels) -> KubernetesLauncher:
        try:
            from kubernetes import client, config
        except ImportError as exc:
            raise ConfigError(
                "LORAPLEX_REPLICA_LAUNCHER=kubernetes needs the kubernetes client: pip install 'loraplex[kubernetes]'"
            ) from exc
        deployments = parse_deployments(settings.kubernetes_deployments, bases)
        namespace = settings.kubernetes_namespace
        try:
            config.load_incluster_config()
            if namespace is None and SERVICE_ACCOUNT_NAMESPACE.is_file():
                namespace = SERVICE_ACCOUNT_NAMESPACE.read_text().strip()
        except config.ConfigException:
            try:
                # Named explicitly: the client reads KUBECONFIG once, when it is first imported.
                config.load_kube_config(config_file=os.environ.get("KUBECONFIG"))
            except (config.ConfigException, OSError) as exc:
                raise ConfigError(
                    "LORAPLEX_REPLICA_LAUNCHER=kubernetes: no in-cluster service account and no usable "
                    f"kubeconfig ({exc})"
                ) from exc
            if namespace is None:
                _, context = config.list_kube_config_contexts()
                namespace = (context or {}).get("context", {}).get("namespace")
        return cls(client.AppsV1Api(), namespace or "default", deployments)

    def _deployment(self, base: BaseModelInfo) -> str:
        return self.deployments[base.name]

    def _scale(self, base: BaseModelInfo, replicas: int) -> None:
        name = self._deployment(base)
        body = {"spec": {"replicas": replicas}}
        try:
            self.apps.patch_namespaced_deployment_scale(name, self.namespace, body)
        except Exception as exc:  # ApiException (refused), urllib3 errors (unreachable)
            raise LaunchFailed(
                f"Kubernetes did not scale deployment {self.namespace}/{name} to {replicas}: {_reason(exc)}"
            ) from exc
        log.info("scaled deployment %s/%s (%s) to %d", self.namespace, name, base.name, replicas)

    def start(self, base: BaseModelInfo) -> None:
        if self.replicas(base, strict=True) < 1:
            self._scale(base, 1)

    def failure(self, base: BaseModelInfo) -> str | None:
        return None  # a crashing pod is restarted by its Deployment; held requests wait until their deadline

    def replicas(self, base: BaseModelInfo, *, strict: bool = False) -> int:
        name = self._deployment(base)
        try:
            scale = self.apps.read_namespaced_deployment_scale(name, self.namespace)
        except Exception as exc:
            if strict:
                raise LaunchFailed(
                    f"Kubernetes did not answer for deployment {self.namespace}/{name}: {_reason(exc)}"
                ) from exc
            log.warning("could not read the scale of %s/%s: %s", self.namespace, name, _reason(exc))
            return 0
        return int(scale.spec.replicas or 0) if scale.spec is not None else 0

    def stop(self, base: BaseModelInfo) -> None:
        self._scale(base, 0)

    def close(self) -> None:
        self.apps.api_client.close()


def _reason(exc: Exception) -> str:
    status, reason = getattr(exc, "status", None), getattr(exc, "reason", None)
    if status is not None:
        return f"HTTP {status} {reason or ''}".strip()
    return f"{type(exc).__name__}: {exc}"
