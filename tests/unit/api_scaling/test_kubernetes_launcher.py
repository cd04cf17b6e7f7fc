"""The Kubernetes launcher, through the official client and a kubeconfig, against a stand-in API server
(``tests.kube_stub``: no cluster runs here) that records the scale calls."""

from __future__ import annotations

from pathlib import Path

import pytest

from api.scaling.kubernetes import KubernetesLauncher
from api.scaling.launchers import LaunchFailed, make_launcher
from core.errors import ConfigError
from core.settings import Settings
from tests.kube_stub import TOKEN, kube_stub
from tests.unit.api_scaling.test_launchers import bases


@pytest.fixture(autouse=True)
def _outside_a_cluster(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)


def test_it_scales_a_base_from_zero_and_back_with_the_kubeconfigs_credentials(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with kube_stub({("serving", "srv-tiny"): 0, ("serving", "srv-qwen"): 2}) as stub:
        monkeypatch.setenv("KUBECONFIG", str(stub.kubeconfig(tmp_path / "config", namespace="serving")))
        settings = Settings(
            data_dir=tmp_path, replica_launcher="kubernetes", kubernetes_deployments="tiny=srv-tiny,qwen=srv-qwen"
        )
        served = bases("tiny", "qwen")
        launcher = make_launcher(settings, served)
        assert isinstance(launcher, KubernetesLauncher) and launcher.namespace == "serving"
        tiny, qwen = served.get("tiny"), served.get("qwen")
        assert tiny is not None and qwen is not None

        assert launcher.replicas(tiny) == 0
        launcher.start(tiny)
        launcher.start(qwen)  # already running: only read
        assert stub.replicas == {("serving", "srv-tiny"): 1, ("serving", "srv-qwen"): 2}
        launcher.stop(qwen)
        assert stub.patches() == [("srv-tiny", 1), ("srv-qwen", 0)]
        assert {c.token for c in stub.calls} == {TOKEN}
        assert all(c.path.startswith("/apis/apps/v1/namespaces/serving/deployments/") for c in stub.calls)
        launcher.close()


def test_a_refused_scale_says_which_deployment_and_why(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with kube_stub({("other", "srv-tiny"): 0}) as stub:
        monkeypatch.setenv("KUBECONFIG", str(stub.kubeconfig(tmp_path / "config", namespace="serving")))
        settings = Settings(
            data_dir=tmp_path,
            replica_launcher="kubernetes",
            kubernetes_deployments="tiny=srv-tiny",
            kubernetes_namespace="other",
        )
        launcher = make_launcher(settings, bases("tiny"))
        assert launcher is not None
        tiny = bases("tiny").default
        stub.forbid = True  # the API's Role lacks deployments/scale
        with pytest.raises(LaunchFailed, match=r"deployment other/srv-tiny: HTTP 403 Forbidden"):
            launcher.start(tiny)
        assert launcher.replicas(tiny) == 0  # the idle watch logs it and leaves the base alone


def test_no_credentials_is_a_config_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KUBECONFIG", str(tmp_path / "missing"))
    settings = Settings(data_dir=tmp_path, replica_launcher="kubernetes", kubernetes_deployments="tiny=srv-tiny")
    with pytest.raises(ConfigError, match="no in-cluster service account and no usable kubeconfig"):
        make_launcher(settings, bases("tiny"))
