"""A base with no replica: the API holds its requests while a launcher starts one, and stops it again once idle.

The happy path under `loraplex up` (local launcher) is in tests/e2e/test_scale_to_zero.py; here, a start that
fails answers every held request with a 503 at once, and the Kubernetes launcher (through the official client,
against the recorded stand-in of ``tests.kube_stub``) scales a Deployment from zero and back while the test
plays the Deployment controller with a real replica.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import openai
import pytest

from core.local_services import EmbeddedRedis, ManagedProcess
from tests.integration.api_inference.deployment import Deployment, deploy, launch_replica
from tests.kube_stub import kube_stub
from tests.prometheus import Metrics
from tests.services import S3Service

pytestmark = pytest.mark.slow

NAMESPACE = "serving"


def metrics(deployment: Deployment) -> Metrics:
    return Metrics(httpx.get(f"{deployment.api.url}/metrics", timeout=30).text)


def ask(deployment: Deployment, client: openai.OpenAI) -> int:
    answer = client.completions.create(model=deployment.base_model, prompt="wake up", max_tokens=3)
    return answer.usage.completion_tokens if answer.usage else 0


def test_a_start_that_fails_answers_every_held_request_with_a_503(
    tmp_path: Path, redis_service: EmbeddedRedis, s3_service: S3Service, tiny_model_dir: Path
) -> None:
    deployment = deploy(
        tmp_path,
        redis_service.url,
        s3_service,
        tiny_model_dir,
        replica_launcher="local",
        replica_idle_ttl=60,
        replica_args="--no-such-flag",  # `loraplex server` exits 2 on it, before registering
        replica_start_timeout_s=600,  # a hang would wait this long: the test's own timeout catches it first
    )
    try:
        client = deployment.make_tenant().openai(max_retries=0)

        def held() -> openai.APIStatusError:
            with pytest.raises(openai.InternalServerError) as refused:
                ask(deployment, client)
            return refused.value

        with ThreadPoolExecutor(4) as pool:
            errors = list(pool.map(lambda _: held(), range(4)))
        assert {(e.status_code, e.code) for e in errors} == {(503, "replica_start_failed")}
        assert all("exited with code 2" in e.message for e in errors), errors[0].message
        assert all(int(e.response.headers["retry-after"]) >= 1 for e in errors)
        scrape = metrics(deployment)
        base = deployment.base_model
        # One launch served every request held at the time (a later arrival may have started a second).
        assert 1 <= scrape.value("loraplex_api_cold_starts_total", base_model=base, outcome="failed") <= 2
        assert scrape.value("loraplex_api_requests_waiting", base_model=base) == 0
        assert scrape.value("loraplex_api_requests_total", base_model=base, outcome="unavailable") == 4
    finally:
        deployment.stop()


def test_the_kubernetes_launcher_scales_a_deployment_from_zero_and_back(
    tmp_path: Path,
    redis_service: EmbeddedRedis,
    s3_service: S3Service,
    tiny_model_dir: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    with kube_stub({(NAMESPACE, "srv-tiny"): 0}) as stub:
        monkeypatch.setenv("KUBECONFIG", str(stub.kubeconfig(tmp_path / "kubeconfig", namespace=NAMESPACE)))
        deployment = deploy(
            tmp_path,
            redis_service.url,
            s3_service,
            tiny_model_dir,
            base_model_name="tiny-k8s",
            replica_launcher="kubernetes",
            kubernetes_deployments="tiny-k8s=srv-tiny",
            replica_idle_ttl=3.0,
        )
        pods: list[ManagedProcess] = []

        def controller(name: str, replicas: int) -> None:
            """What the Deployment controller would do: a pod per replica asked for."""
            while len(pods) < replicas:
                replica = launch_replica(deployment.settings, tiny_model_dir, f"srv-tiny-{len(pods)}", tmp_path)
                pods.append(replica.process)
                deployment.processes.append(replica.process)
            while len(pods) > replicas:
                pod = pods.pop()
                deployment.processes.remove(pod)
                pod.stop()

        stub.on_scale = controller
        try:
            client = deployment.make_tenant().openai(max_retries=0, timeout=300)
            with ThreadPoolExecutor(3) as pool:  # three requests arrive while the base is at zero
                assert list(pool.map(lambda _: ask(deployment, client), range(3))) == [3, 3, 3]
            assert stub.patches() == [("srv-tiny", 1)]  # one launch for all of them
            scrape = metrics(deployment)
            assert scrape.value("loraplex_api_cold_starts_total", base_model="tiny-k8s", outcome="started") == 1
            assert scrape.value("loraplex_api_cold_start_seconds_count", base_model="tiny-k8s") == 1
            assert scrape.value("loraplex_api_replicas_live", base_model="tiny-k8s") == 1
            assert scrape.value("loraplex_api_replicas_wanted", base_model="tiny-k8s") == 1
            assert scrape.value("loraplex_api_requests_total", base_model="tiny-k8s", outcome="completed") == 3

            # Idle past the TTL: the API scales the Deployment to zero, and says it wants none.
            def scaled_down() -> Metrics | None:
                scrape = metrics(deployment)
                return scrape if scrape.value("loraplex_api_scale_downs_total", base_model="tiny-k8s") == 1 else None

            idle = deployment.wait_until(scaled_down, "the scale-down", timeout=60)
            assert stub.patches() == [("srv-tiny", 1), ("srv-tiny", 0)] and not pods
            assert idle.value("loraplex_api_replicas_wanted", base_model="tiny-k8s") == 0

            assert ask(deployment, client) == 3  # and back from zero
            assert stub.patches()[-1] == ("srv-tiny", 1)
        finally:
            deployment.stop()
