"""Render the kustomizations under infra/k8s with kubectl and read what they hold: pod templates,
containers, env, options. Shared by the manifest tests; knows nothing about what is right."""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import click
import typer
import yaml

K8S = Path(__file__).resolve().parents[3] / "infra" / "k8s"
KUSTOMIZATIONS = sorted(path.parent for path in K8S.rglob("kustomization.yaml"))
# Applied with `kubectl apply -f`, outside every kustomization: the example Secret, the model download Job.
PLAIN_MANIFESTS = sorted(K8S.glob("*.yaml"))
KUBECTL_ENV = "LORAPLEX_TEST_KUBECTL"  # more kubectl binaries to render with, os.pathsep-separated


def name_of(directory: Path) -> str:
    return directory.relative_to(K8S).as_posix()


def kubectls() -> list[str]:
    """kubectl on PATH, then every binary named in LORAPLEX_TEST_KUBECTL (e.g. Debian's 1.20, kustomize v2.0.3)."""
    found = [shutil.which("kubectl") or "", *os.environ.get(KUBECTL_ENV, "").split(os.pathsep)]
    return list(dict.fromkeys(path for path in found if path))


def kustomize(kubectl: str, directory: Path) -> list[dict]:
    """``kubectl kustomize directory``, parsed (deprecation warnings go to stderr and are ignored)."""
    done = subprocess.run([kubectl, "kustomize", str(directory)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, f"{kubectl} kustomize {name_of(directory)} failed:\n{done.stderr}"
    return [doc for doc in yaml.safe_load_all(done.stdout) if doc]


def load_plain(path: Path) -> list[dict]:
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc]


def normalised(docs: list[dict]) -> list[dict]:
    """The render with what kustomize versions order differently put in one order: documents by kind and
    name (v2 sorts claims last), env entries by name (strategic merges append in different places)."""

    def walk(node: object, key: str = "") -> object:
        if isinstance(node, dict):
            return {k: walk(v, k) for k, v in node.items()}
        if isinstance(node, list):
            items = [walk(item) for item in node]
            return sorted(items, key=lambda item: item["name"]) if key == "env" else items
        return node

    ordered = sorted(docs, key=lambda doc: (doc["kind"], doc["metadata"]["name"]))
    return [walk(doc) for doc in ordered]


def ref(doc: dict) -> str:
    return f"{doc['kind']}/{doc['metadata']['name']}"


def of_kind(docs: list[dict], kind: str) -> dict[str, dict]:
    return {doc["metadata"]["name"]: doc for doc in docs if doc["kind"] == kind}


def component(doc: dict) -> str | None:
    return doc["metadata"].get("labels", {}).get("app.kubernetes.io/component")


def base_label(doc: dict) -> str | None:
    return doc["metadata"].get("labels", {}).get("loraplex.dev/base-model")


def pod_templates(docs: list[dict]) -> Iterator[tuple[dict, dict]]:
    """(workload, pod template) for every Deployment and Job."""
    for doc in docs:
        if doc["kind"] in ("Deployment", "Job"):
            yield doc, doc["spec"]["template"]


def containers(docs: list[dict]) -> Iterator[tuple[dict, dict, dict]]:
    """(workload, pod spec, container) for every container of every pod template, init containers too."""
    for doc, template in pod_templates(docs):
        spec = template["spec"]
        for container in spec.get("initContainers", []) + spec["containers"]:
            yield doc, spec, container


def env_of(container: dict) -> dict[str, str | None]:
    """Literal env values by name; None for values taken from elsewhere (valueFrom)."""
    return {entry["name"]: entry.get("value") for entry in container.get("env", [])}


def option(command: list[str], flag: str) -> str:
    assert flag in command, f"{command} has no {flag}"
    return command[command.index(flag) + 1]


def container_port(container: dict, port: int | str) -> int:
    """A probe's or Service's port, by number or by the container port's name."""
    if isinstance(port, int):
        return port
    named = {p.get("name"): p["containerPort"] for p in container.get("ports", [])}
    assert port in named, f"container {container['name']} has no port named {port}"
    return named[port]


def only(docs: list[dict], kind: str, component_name: str) -> list[dict]:
    return [doc for doc in docs if doc["kind"] == kind and component(doc) == component_name]


def loraplex_commands() -> dict[str, click.Command]:
    """The real ``loraplex`` subcommands by name, from the CLI modules (registered on an app of our own,
    not on the shared ``core.cli.app``)."""
    import api.cli
    import core.cli
    import server.cli
    import worker.cli

    components = typer.Typer()

    @components.callback()
    def _root() -> None:  # a callback makes it a group whatever the modules register
        pass

    for module in (api.cli, worker.cli, server.cli):
        module.register(components)
    return {
        **typer.main.get_command(core.cli.app).commands,  # type: ignore[attr-defined]
        **typer.main.get_command(components).commands,  # type: ignore[attr-defined]
    }


def resolve(commands: dict[str, click.Command], words: list[str]) -> tuple[click.Command, list[str]]:
    """The click command a container's ``loraplex ...`` command line runs, and the words after its name."""
    assert words[0] == "loraplex" and words[1] in commands, f"no such command: {words[:2]}"
    command, rest = commands[words[1]], words[2:]
    if isinstance(command, click.Group):
        assert rest and rest[0] in command.commands, f"no such command: {words[:3]}"
        command, rest = command.commands[rest[0]], rest[1:]
    return command, rest


def command_envvars(command: click.Command) -> set[str]:
    """Environment variables that options of ``command`` (and of its subcommands) read."""
    subcommands = command.commands.values() if isinstance(command, click.Group) else ()
    own = {name for param in command.params for name in _names(param.envvar)}
    return own.union(*(command_envvars(sub) for sub in subcommands))


def _names(envvar: str | list[str] | None) -> list[str]:
    return [envvar] if isinstance(envvar, str) else list(envvar or ())


def options_of(command: click.Command) -> set[str]:
    return {flag for param in command.params for flag in (*param.opts, *param.secondary_opts) if flag.startswith("-")}
