"""infra/k8s renders with kubectl (kustomize v2.0.3 and v5 alike), validates against the Kubernetes schemas,
and its parts agree: one settings Secret, the models volume, the API's right to scale server Deployments,
one KEDA ScaledObject per base model with the API's idle TTL as cooldown, probes, ports, a non-root user."""

from __future__ import annotations

import re
from pathlib import Path
from urllib.parse import urlsplit

import click
import kubernetes_validate
import pytest

from core.settings import ENV_PREFIX, Settings
from tests.unit.infra.k8s_render import (
    K8S,
    KUBECTL_ENV,
    KUSTOMIZATIONS,
    PLAIN_MANIFESTS,
    base_label,
    command_envvars,
    component,
    container_port,
    containers,
    env_of,
    kubectls,
    kustomize,
    load_plain,
    loraplex_commands,
    name_of,
    normalised,
    of_kind,
    only,
    option,
    options_of,
    pod_templates,
    ref,
    resolve,
)

# The oldest Kubernetes the manifests claim, and the newest the installed kubernetes-validate knows.
KUBERNETES_VERSIONS = ("1.32", kubernetes_validate.latest_version())
NAMESPACE = "loraplex"
SETTINGS_SECRET = "loraplex-settings"
IMAGE_USER = 1000  # infra/Dockerfile: useradd --uid 1000
KEDA = "keda.sh/v1alpha1"
WANTED = re.compile(r'max\(loraplex_api_replicas_wanted\{base_model="([^"]+)"\}\)')
GPU = "nvidia.com/gpu"
# The Secret must carry the external services and the keys; pods get nothing else from outside.
SECRET_REQUIRED = {
    "LORAPLEX_DATABASE_URL",
    "LORAPLEX_REDIS_URL",
    "LORAPLEX_S3_ENDPOINT",
    "LORAPLEX_S3_ACCESS_KEY",
    "LORAPLEX_S3_SECRET_KEY",
    "LORAPLEX_ADMIN_KEY",
    "LORAPLEX_INTERNAL_TOKEN",
}

DIRS = pytest.mark.parametrize("directory", KUSTOMIZATIONS, ids=name_of)


@pytest.fixture(scope="module")
def rendered_by() -> dict[Path, dict[str, list[dict]]]:
    """Every kustomization rendered by every kubectl found."""
    binaries = kubectls()
    if not binaries:
        pytest.skip(f"no kubectl on PATH or in {KUBECTL_ENV} (.ci/run installs Debian's kubernetes-client)")
    return {directory: {kubectl: kustomize(kubectl, directory) for kubectl in binaries} for directory in KUSTOMIZATIONS}


@pytest.fixture(scope="module")
def renders(rendered_by: dict[Path, dict[str, list[dict]]]) -> dict[Path, list[dict]]:
    return {directory: next(iter(by_kubectl.values())) for directory, by_kubectl in rendered_by.items()}


@pytest.fixture(scope="module")
def cli() -> dict[str, click.Command]:
    return loraplex_commands()


def api_container(docs: list[dict]) -> dict:
    (api,) = only(docs, "Deployment", "api")
    (container,) = api["spec"]["template"]["spec"]["containers"]
    return container


def main_container(doc: dict) -> dict:
    (container,) = doc["spec"]["template"]["spec"]["containers"]
    return container


def named_pairs(value: str | None) -> dict[str, str]:
    """``A=x,B=y`` as a dict (the form of LORAPLEX_BASE_MODELS and LORAPLEX_KUBERNETES_DEPLOYMENTS here)."""
    pairs = [item.strip() for item in (value or "").split(",") if item.strip()]
    assert all("=" in item for item in pairs), f"{value!r}: give every entry as NAME=VALUE"
    return dict(item.split("=", 1) for item in pairs)


def schema_problem(doc: dict, version: str) -> str | None:
    """Why ``doc`` is not a valid object of Kubernetes ``version`` (strict: no unknown fields), or None."""
    try:
        kubernetes_validate.validate(doc, version, strict=True)
    except kubernetes_validate.ValidationError as exc:
        return f"{ref(doc)} is not valid Kubernetes {version} at /{'/'.join(map(str, exc.path))}: {exc.message}"
    except kubernetes_validate.SchemaNotFoundError as exc:
        return exc.message
    return None


def validate(doc: dict, where: str) -> None:
    problems = [problem for version in KUBERNETES_VERSIONS if (problem := schema_problem(doc, version))]
    assert not problems, f"{where}: " + "; ".join(problems)


@DIRS
def test_every_object_is_valid_kubernetes(directory: Path, renders: dict[Path, list[dict]]) -> None:
    docs = renders[directory]
    assert docs, f"{name_of(directory)} renders nothing"
    for doc in docs:
        assert doc["metadata"].get("namespace") == NAMESPACE, f"{ref(doc)} is outside namespace {NAMESPACE}"
        assert doc["kind"] != "Secret", f"{ref(doc)}: credentials never enter a kustomization"
        if doc["apiVersion"] != KEDA:  # a CRD the schemas lack: test_scaled_objects_scale_servers_to_zero
            validate(doc, name_of(directory))


@pytest.mark.parametrize("path", PLAIN_MANIFESTS, ids=lambda path: path.name)
def test_plain_manifests_are_valid_kubernetes(path: Path) -> None:
    for doc in load_plain(path):
        assert doc["metadata"].get("namespace") == NAMESPACE, f"{path.name}: {ref(doc)} needs its namespace"
        validate(doc, path.name)


@DIRS
def test_every_kubectl_renders_the_same(directory: Path, rendered_by: dict[Path, dict[str, list[dict]]]) -> None:
    (first, docs), *others = rendered_by[directory].items()
    for kubectl, other in others:
        assert normalised(other) == normalised(docs), f"{kubectl} and {first} render {name_of(directory)} differently"


def test_secret_example_holds_every_external_setting_as_a_placeholder() -> None:
    (secret,) = load_plain(K8S / "secret.example.yaml")
    assert secret["kind"] == "Secret" and secret["metadata"]["name"] == SETTINGS_SECRET
    values = secret["stringData"]
    assert set(values) >= SECRET_REQUIRED, f"missing from the example: {SECRET_REQUIRED - set(values)}"
    for key in values:
        assert key.startswith(ENV_PREFIX) and key.removeprefix(ENV_PREFIX).lower() in Settings.model_fields, key
    for key in ("LORAPLEX_S3_ACCESS_KEY", "LORAPLEX_S3_SECRET_KEY", "LORAPLEX_ADMIN_KEY", "LORAPLEX_INTERNAL_TOKEN"):
        assert "REPLACE-ME" in values[key], f"{key} must be a placeholder, not a credential"


@pytest.mark.parametrize("source", [*KUSTOMIZATIONS, *PLAIN_MANIFESTS], ids=name_of)
def test_pods_take_settings_from_the_one_secret(
    source: Path, renders: dict[Path, list[dict]], cli: dict[str, click.Command]
) -> None:
    docs = renders[source] if source.is_dir() else load_plain(source)
    # A LORAPLEX_* name is a Settings field or an option's own variable (e.g. LORAPLEX_TRAIN_THREADS).
    known = {ENV_PREFIX + field.upper() for field in Settings.model_fields}
    known |= {variable for command in cli.values() for variable in command_envvars(command)}
    for doc, _, container in containers(docs):
        for entry in container.get("envFrom", []):
            assert entry == {"secretRef": {"name": SETTINGS_SECRET}}, f"{ref(doc)} reads {entry}"
        for entry in container.get("env", []):
            secret = entry.get("valueFrom", {}).get("secretKeyRef")
            assert secret is None or secret["name"] == SETTINGS_SECRET, f"{ref(doc)}: {entry}"
            if entry["name"].startswith(ENV_PREFIX):
                assert entry["name"] in known, f"{ref(doc)}: no setting {entry['name']}"
        if container["command"][0] == "loraplex":
            assert container.get("envFrom"), f"{ref(doc)} needs {SETTINGS_SECRET}"


@pytest.mark.parametrize("source", [*KUSTOMIZATIONS, *PLAIN_MANIFESTS], ids=name_of)
def test_volume_claims_exist_and_models_are_read_only(source: Path, renders: dict[Path, list[dict]]) -> None:
    docs = renders[source] if source.is_dir() else load_plain(source)
    # The migration Job and the plain manifests use the claims the base makes.
    claims = set(of_kind(docs, "PersistentVolumeClaim")) | set(of_kind(renders[K8S / "base"], "PersistentVolumeClaim"))
    for doc, template in pod_templates(docs):
        spec = template["spec"]
        for volume in spec.get("volumes", []):
            if "persistentVolumeClaim" in volume:
                claim = volume["persistentVolumeClaim"]
                assert claim["claimName"] in claims, f"{ref(doc)} claims {claim['claimName']}, which nothing makes"
                if doc["kind"] == "Deployment":
                    assert claim.get("readOnly") is True, f"{ref(doc)} must mount {claim['claimName']} read-only"
        volumes = {volume["name"] for volume in spec.get("volumes", [])}
        for container in spec["containers"]:
            for mount in container.get("volumeMounts", []):
                assert mount["name"] in volumes, f"{ref(doc)} mounts undeclared volume {mount['name']}"
                if doc["kind"] == "Deployment" and mount["mountPath"] == "/models":
                    assert mount.get("readOnly") is True, f"{ref(doc)} must mount /models read-only"


@DIRS
def test_only_the_api_may_scale_deployments_and_only_in_its_namespace(
    directory: Path, renders: dict[Path, list[dict]]
) -> None:
    docs = renders[directory]
    assert not [doc for doc in docs if doc["kind"] in ("ClusterRole", "ClusterRoleBinding")], "nothing cluster-wide"
    for doc, template in pod_templates(docs):
        if component(doc) != "api":
            assert template["spec"].get("automountServiceAccountToken") is False, f"{ref(doc)} needs no API token"
    if not only(docs, "Deployment", "api"):
        return
    (api,) = only(docs, "Deployment", "api")
    account = api["spec"]["template"]["spec"].get("serviceAccountName")
    assert account in of_kind(docs, "ServiceAccount"), f"the API runs as {account}, which is not rendered"
    roles = of_kind(docs, "Role")
    granted: set[tuple[str, str]] = set()
    for binding in of_kind(docs, "RoleBinding").values():
        subject = {"kind": "ServiceAccount", "name": account, "namespace": binding["metadata"]["namespace"]}
        if subject in binding["subjects"]:
            assert binding["roleRef"]["kind"] == "Role" and binding["roleRef"]["name"] in roles, ref(binding)
            for rule in roles[binding["roleRef"]["name"]]["rules"]:
                if "apps" in rule["apiGroups"]:
                    granted |= {(resource, verb) for resource in rule["resources"] for verb in rule["verbs"]}
    needed = {("deployments", "get"), ("deployments", "list"), ("deployments", "watch")}
    needed |= {("deployments/scale", "get"), ("deployments/scale", "patch"), ("deployments/scale", "update")}
    assert needed <= granted, f"the API's Role lacks {needed - granted}"


@DIRS
def test_every_base_model_has_servers_a_worker_and_a_scaler(directory: Path, renders: dict[Path, list[dict]]) -> None:
    docs = renders[directory]
    if not only(docs, "Deployment", "api"):
        return
    env = env_of(api_container(docs))
    sources = {
        env["LORAPLEX_BASE_MODEL_NAME"]: env["LORAPLEX_BASE_MODEL"],
        **named_pairs(env.get("LORAPLEX_BASE_MODELS")),
    }
    targets = named_pairs(env["LORAPLEX_KUBERNETES_DEPLOYMENTS"])
    assert set(targets) == set(sources), (
        f"LORAPLEX_KUBERNETES_DEPLOYMENTS names {set(targets)}, bases are {set(sources)}"
    )
    servers = {doc["metadata"]["name"]: doc for doc in only(docs, "Deployment", "server")}
    assert set(servers) == set(targets.values()), f"server Deployments {set(servers)} vs the API's {targets}"
    workers = {base_label(doc): doc for doc in only(docs, "Deployment", "worker")}
    assert set(workers) == set(sources), f"workers for {set(workers)}, bases are {set(sources)}"
    for base, deployment in targets.items():
        server = servers[deployment]
        assert "replicas" not in server["spec"], f"{ref(server)}: the API and KEDA own its replica count"
        pod_labels = server["spec"]["template"]["metadata"]["labels"]
        assert base_label(server) == pod_labels["loraplex.dev/base-model"] == base, ref(server)
        assert server["spec"]["selector"]["matchLabels"]["loraplex.dev/base-model"] == base, ref(server)
        for doc in (server, workers[base]):
            container = main_container(doc)
            assert env_of(container)["LORAPLEX_BASE_MODEL_NAME"] == base, ref(doc)
            assert env_of(container)["LORAPLEX_BASE_MODEL"] == sources[base], ref(doc)
        assert option(main_container(server)["command"], "--model") == sources[base], ref(server)


@DIRS
def test_scaled_objects_scale_servers_to_zero(directory: Path, renders: dict[Path, list[dict]]) -> None:
    docs = renders[directory]
    scalers = [doc for doc in docs if doc["kind"] == "ScaledObject"]
    servers = {doc["metadata"]["name"]: doc for doc in only(docs, "Deployment", "server")}
    assert sorted(scaler["spec"]["scaleTargetRef"]["name"] for scaler in scalers) == sorted(servers), (
        "exactly one ScaledObject per server Deployment"
    )
    if not scalers:
        return
    idle_ttl = env_of(api_container(docs))["LORAPLEX_REPLICA_IDLE_TTL"]
    assert env_of(api_container(docs))["LORAPLEX_REPLICA_LAUNCHER"] == "kubernetes"
    for scaler in scalers:
        spec = scaler["spec"]
        assert scaler["apiVersion"] == KEDA, ref(scaler)
        assert spec["scaleTargetRef"].get("kind", "Deployment") == "Deployment", ref(scaler)
        assert spec["scaleTargetRef"].get("apiVersion", "apps/v1") == "apps/v1", ref(scaler)
        server = servers[spec["scaleTargetRef"]["name"]]
        assert spec["minReplicaCount"] == 0 and spec["maxReplicaCount"] >= 1, ref(scaler)
        assert spec["cooldownPeriod"] == int(idle_ttl), f"{ref(scaler)}: cooldown must equal the API's idle TTL"
        (trigger,) = spec["triggers"]
        metadata = trigger["metadata"]
        assert trigger["type"] == "prometheus", ref(scaler)
        assert all(isinstance(value, str) for value in metadata.values()), f"{ref(scaler)}: KEDA reads strings"
        wanted = WANTED.fullmatch(metadata["query"])
        assert wanted, f"{ref(scaler)} queries {metadata['query']!r}"
        assert wanted.group(1) == base_label(server) == base_label(scaler), f"{ref(scaler)} scales another base"
        assert (metadata["threshold"], metadata["activationThreshold"]) == ("1", "0"), ref(scaler)
        address = urlsplit(metadata["serverAddress"])
        assert address.scheme in ("http", "https") and address.hostname, f"{ref(scaler)}: {metadata['serverAddress']}"


@pytest.mark.parametrize("source", [*KUSTOMIZATIONS, *PLAIN_MANIFESTS], ids=name_of)
def test_containers_run_as_the_image_user_with_resources(source: Path, renders: dict[Path, list[dict]]) -> None:
    docs = renders[source] if source.is_dir() else load_plain(source)
    for doc, spec, container in containers(docs):
        pod, own = spec.get("securityContext", {}), container.get("securityContext", {})
        assert own.get("runAsUser", pod.get("runAsUser")) == IMAGE_USER, f"{ref(doc)} must run as uid {IMAGE_USER}"
        assert own.get("runAsNonRoot", pod.get("runAsNonRoot")) is True, ref(doc)
        assert own.get("allowPrivilegeEscalation") is False, ref(doc)
        assert own.get("capabilities", {}).get("drop") == ["ALL"], ref(doc)
        assert container["image"].split(":")[0].rsplit("/", 1)[-1] == "loraplex", f"{ref(doc)}: one image for all"
        resources = container.get("resources", {})
        requests, limits = resources.get("requests", {}), resources.get("limits", {})
        assert {"cpu", "memory"} <= set(requests) and "memory" in limits, f"{ref(doc)} needs requests and limits"
        if component(doc) in ("server", "worker"):
            assert limits.get(GPU) == requests.get(GPU) == "1", f"{ref(doc)} needs one GPU"
        else:
            assert GPU not in limits, f"{ref(doc)} needs no GPU"


@DIRS
def test_probes_ports_and_signals(directory: Path, renders: dict[Path, list[dict]]) -> None:
    docs = renders[directory]
    for api in only(docs, "Deployment", "api"):
        container = main_container(api)
        assert int(option(container["command"], "--port")) == container_port(container, "http") == 8000
        for probe, path in (("readinessProbe", "/ready"), ("livenessProbe", "/health")):
            check = container[probe]["httpGet"]
            assert (check["path"], container_port(container, check["port"])) == (path, 8000), f"{ref(api)} {probe}"
        pod_labels = api["spec"]["template"]["metadata"]["labels"]
        services = [
            svc for svc in of_kind(docs, "Service").values() if svc["spec"]["selector"].items() <= pod_labels.items()
        ]
        assert [(svc["metadata"]["name"], svc["spec"]["ports"][0]["port"]) for svc in services] == [
            ("loraplex-api", 8000)
        ]
        assert container_port(container, services[0]["spec"]["ports"][0]["targetPort"]) == 8000
    for server in only(docs, "Deployment", "server"):
        container, spec = main_container(server), server["spec"]["template"]["spec"]
        command = container["command"]
        assert int(option(command, "--port")) == container_port(container, "http") == 8001, ref(server)
        assert option(command, "--host") == "0.0.0.0", ref(server)
        # Servers are reached at the address in their heartbeat: each pod advertises its own IP.
        assert option(command, "--advertise-url") == "http://$(POD_IP):8001", ref(server)
        pod_ip = next(entry for entry in container["env"] if entry["name"] == "POD_IP")
        assert pod_ip["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP", ref(server)
        for probe in ("readinessProbe", "startupProbe"):
            script = " ".join(container[probe]["exec"]["command"])  # /ready wants the internal token
            assert "http://127.0.0.1:8001/ready" in script and "${LORAPLEX_INTERNAL_TOKEN}" in script, ref(server)
        liveness = container["livenessProbe"]["httpGet"]
        assert (liveness["path"], container_port(container, liveness["port"])) == ("/health", 8001), ref(server)
        startup = container["startupProbe"]
        assert startup["periodSeconds"] * startup["failureThreshold"] >= 15 * 60, f"{ref(server)}: models load slowly"
        assert spec["terminationGracePeriodSeconds"] >= 60, f"{ref(server)}: open streams need time to drain"
    for worker in only(docs, "Deployment", "worker"):
        env = env_of(main_container(worker))
        assert env["LORAPLEX_WORKER_METRICS_HOST"] == "0.0.0.0", f"{ref(worker)}: /metrics only on loopback"
        annotated = worker["spec"]["template"]["metadata"]["annotations"]["prometheus.io/port"]
        assert env["LORAPLEX_WORKER_METRICS_PORT"] == annotated, ref(worker)
    for doc, template in pod_templates(docs):
        if component(doc) in ("api", "server", "worker"):
            notes = template["metadata"].get("annotations", {})
            ports = {port["containerPort"] for port in main_container(doc).get("ports", [])}
            assert notes.get("prometheus.io/scrape") == "true", f"{ref(doc)} is not scraped"
            assert notes.get("prometheus.io/path") == "/metrics" and int(notes["prometheus.io/port"]) in ports, ref(doc)


@pytest.mark.parametrize("source", [*KUSTOMIZATIONS, *PLAIN_MANIFESTS], ids=name_of)
def test_commands_use_real_cli_options(
    source: Path, renders: dict[Path, list[dict]], cli: dict[str, click.Command]
) -> None:
    docs = renders[source] if source.is_dir() else load_plain(source)
    for doc, _, container in containers(docs):
        if container["command"][0] != "loraplex":
            continue
        command, words = resolve(cli, container["command"])
        unknown = {word for word in words if word.startswith("--")} - options_of(command)
        assert not unknown, f"{ref(doc)}: `loraplex {command.name}` has no {sorted(unknown)}"
        if component(doc) == "migrate":
            assert container["command"] == ["loraplex", "db", "upgrade"], ref(doc)
            assert doc["spec"]["template"]["spec"]["restartPolicy"] in ("Never", "OnFailure"), ref(doc)


MIGRATIONS = {K8S / "base": K8S / "migrate"} | {
    directory: directory / "migrate" for directory in KUSTOMIZATIONS if (directory / "migrate").is_dir()
}


@pytest.mark.parametrize("directory", list(MIGRATIONS), ids=name_of)
def test_migration_runs_the_release_it_prepares(directory: Path, renders: dict[Path, list[dict]]) -> None:
    images = {container["image"] for _, _, container in containers(renders[directory])}
    (job,) = only(renders[MIGRATIONS[directory]], "Job", "migrate")
    assert {main_container(job)["image"]} == images, f"{name_of(MIGRATIONS[directory])} migrates another image"
