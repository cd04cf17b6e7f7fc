"""OpenAPI links: which field of one operation's response feeds which later request.

They turn the schema into a map of the resources' life cycles (a file trains a job; a job has events,
checkpoints and a model; a model answers completions; a tenant has keys and limits), for client
generators and for the stateful fuzzing in ``tests/security/test_fuzz_api.py``, which walks them.
They are declared here, in one table, and added to the schema FastAPI generates.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from fastapi import FastAPI


@dataclass(frozen=True)
class Link:
    source: str  # "METHOD /path" whose response feeds the target
    status: str
    name: str
    target: str
    parameters: dict[str, str] = field(default_factory=dict)  # target parameter -> runtime expression
    request_body: dict[str, str] | None = None  # fields merged into the target's body

    def definition(self) -> dict[str, Any]:
        method, path = self.target.split(" ", 1)
        pointer = path.replace("~", "~0").replace("/", "~1")
        link: dict[str, Any] = {"operationRef": f"#/paths/{pointer}/{method.lower()}"}
        if self.parameters:
            link["parameters"] = self.parameters
        if self.request_body is not None:
            link["requestBody"] = self.request_body
        return link


def _each(source: str, status: str, expression: str, parameter: str, targets: dict[str, str]) -> list[Link]:
    return [Link(source, status, name, target, {parameter: expression}) for name, target in targets.items()]


FILE_ID = "$response.body#/id"
LISTED_MODEL = "$response.body#/data/0/id"
MODEL_SOURCES = (("POST /v1/adapters", "$response.body#/model"), ("GET /v1/models", LISTED_MODEL))
LINKS: list[Link] = [
    *_each(
        "POST /v1/files",
        "200",
        FILE_ID,
        "file_id",
        {
            "RetrieveFile": "GET /v1/files/{file_id}",
            "DownloadFile": "GET /v1/files/{file_id}/content",
            "DeleteFile": "DELETE /v1/files/{file_id}",
        },
    ),
    Link("POST /v1/files", "200", "TrainOnFile", "POST /v1/fine_tuning/jobs", request_body={"training_file": FILE_ID}),
    *_each(
        "POST /v1/fine_tuning/jobs",
        "200",
        "$response.body#/id",
        "job_id",
        {
            "RetrieveJob": "GET /v1/fine_tuning/jobs/{job_id}",
            "JobEvents": "GET /v1/fine_tuning/jobs/{job_id}/events",
            "JobCheckpoints": "GET /v1/fine_tuning/jobs/{job_id}/checkpoints",
            "CancelJob": "POST /v1/fine_tuning/jobs/{job_id}/cancel",
        },
    ),
    Link(
        "GET /v1/fine_tuning/jobs/{job_id}",
        "200",
        "FineTunedModel",
        "GET /v1/models/{model}",
        {"model": "$response.body#/fine_tuned_model"},
    ),
    Link(
        "GET /v1/fine_tuning/jobs/{job_id}/checkpoints",
        "200",
        "CheckpointModel",
        "POST /v1/completions",
        request_body={"model": "$response.body#/data/0/fine_tuned_model_checkpoint"},
    ),
    *_each(
        "POST /v1/adapters",
        "200",
        "$response.body#/id",
        "adapter_id",
        {"RetrieveAdapter": "GET /v1/adapters/{adapter_id}", "DeleteAdapter": "DELETE /v1/adapters/{adapter_id}"},
    ),
    *_each(
        "POST /v1/adapters",
        "200",
        "$response.body#/model",
        "model",
        {"RetrieveModel": "GET /v1/models/{model}", "DeleteModel": "DELETE /v1/models/{model}"},
    ),
    *[
        Link(source, "200", name, target, request_body={"model": expression})
        for source, expression in MODEL_SOURCES
        for name, target in (("Complete", "POST /v1/completions"), ("Chat", "POST /v1/chat/completions"))
    ],
    Link("GET /v1/models", "200", "RetrieveListedModel", "GET /v1/models/{model}", {"model": LISTED_MODEL}),
    *_each(
        "POST /admin/tenants",
        "201",
        "$response.body#/id",
        "tenant",
        {
            "RetrieveTenant": "GET /admin/tenants/{tenant}",
            "DisableTenant": "POST /admin/tenants/{tenant}/disable",
            "EnableTenant": "POST /admin/tenants/{tenant}/enable",
            "ListKeys": "GET /admin/tenants/{tenant}/keys",
            "CreateKey": "POST /admin/tenants/{tenant}/keys",
            "RetrieveLimits": "GET /admin/tenants/{tenant}/limits",
            "SetLimits": "PUT /admin/tenants/{tenant}/limits",
        },
    ),
    Link(
        "POST /admin/tenants/{tenant}/keys",
        "201",
        "RevokeKey",
        "DELETE /admin/tenants/{tenant}/keys/{key_id}",
        {"tenant": "$request.path.tenant", "key_id": "$response.body#/id"},
    ),
]


def add_links(schema: dict[str, Any], links: list[Link]) -> dict[str, Any]:
    """``schema`` with ``links`` on their source responses; a link naming an operation that is not there is
    a bug (KeyError), not a silently missing link."""
    paths = schema["paths"]
    for link in links:
        method, path = link.target.split(" ", 1)
        paths[path][method.lower()]  # the target must exist; the source's lookup below checks the source
        method, path = link.source.split(" ", 1)
        response = paths[path][method.lower()]["responses"][link.status]
        response.setdefault("links", {})[link.name] = link.definition()
    return schema


def install_links(app: FastAPI) -> None:
    """Make ``app``'s OpenAPI schema carry ``LINKS``, added once to the schema FastAPI generates and caches."""
    generate = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            add_links(generate(), LINKS)  # generate() caches its schema in app.openapi_schema
        return app.openapi_schema  # type: ignore[return-value]

    app.openapi = openapi  # type: ignore[method-assign]
