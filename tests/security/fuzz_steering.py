"""Steering for the API fuzz: generated cases, bent now and then toward inputs that get through.

Random bytes never make a valid JSONL dataset or a PEFT adapter, and random strings never name a served
model, an existing file or job, or the admin key, so unaided a fuzzer stops at the first validation of
every deep route. Two cases in three get a valid part (the dataset, the adapter, a model, small token caps,
the id of something an earlier answer created, the key, a login token); everything else in them stays as
generated, and the third case stays wholly random, so the validation branches are fuzzed as well.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import schemathesis

INFERENCE = ("POST /v1/completions", "POST /v1/chat/completions")
INFERENCE_FIELDS = frozenset({"model", "n", "max_tokens", "max_completion_tokens", "stream", "temperature", "seed"})
JOB_FIELDS = frozenset({"suffix", "seed", "metadata"})
TOKEN_CAPS = {"max_tokens": 8, "max_completion_tokens": 8, "n": 2, "top_logprobs": 2}
SMALL_TRAINING = {"n_epochs": 1, "batch_size": 2, "lora_r": 2}
CREATES = {  # operation -> the path parameter its answer's id fills
    "POST /v1/files": "file_id",
    "POST /v1/fine_tuning/jobs": "job_id",
    "POST /v1/adapters": "adapter_id",
    "POST /admin/tenants": "tenant",
    "POST /admin/tenants/{tenant}/keys": "key_id",
}


@dataclass
class Steering:
    base_model: str
    dataset: bytes  # a valid JSONL training file
    adapter: dict[str, bytes]  # multipart parts of a valid PEFT adapter upload
    admin_key: str
    login_token: Callable[[], str]
    models: set[str] = field(default_factory=set)  # served models seen so far (uploaded adapters)
    ids: dict[str, list[Any]] = field(default_factory=lambda: defaultdict(list))  # path parameter -> created ids
    adapter_models: dict[str, str] = field(default_factory=dict)
    _seen: Counter[str] = field(default_factory=Counter)

    def __call__(self, case: schemathesis.Case, *, walking: bool = False) -> schemathesis.Case:
        """Steer ``case``; ``walking``: it follows a link, whose values (ids, a training file) stay as they are."""
        label = case.operation.label
        self._seen[label] += 1
        if self._seen[label] % 3 == 0:
            return case  # left as generated
        body = case.body if isinstance(case.body, dict) else None
        if label == "POST /v1/files":
            case.body = {"file": self.dataset, "purpose": "fine-tune"}
        elif label == "POST /v1/adapters":
            case.body = dict(self.adapter)
        elif label == "POST /v1/fine_tuning/jobs":
            case.body = {**_known(body, JOB_FIELDS), "model": self.base_model, "hyperparameters": SMALL_TRAINING}
            if walking and body and "training_file" in body:
                case.body["training_file"] = body["training_file"]
            elif self.ids["file_id"]:
                case.body["training_file"] = self.ids["file_id"][-1]
        elif label in INFERENCE:
            case.body = _known(body, INFERENCE_FIELDS)
            _aim(case.body, self.base_model, self.models)
            if label == "POST /v1/chat/completions":
                case.body["messages"] = [{"role": "user", "content": "Say something."}]
            elif not isinstance(case.body.get("prompt"), str):
                case.body["prompt"] = "Once upon a time"
        elif label == "POST /admin/tenants":
            case.body = {"name": f"fuzz-{self._seen[label]}"}
        elif label == "POST /admin/tenants/{tenant}/keys":
            case.body = {"name": "fuzz"}
        elif label == "PUT /admin/tenants/{tenant}/limits":
            case.body = {"requests_per_minute": 0, "tokens_per_minute": 0, "scheduling_weight": 1.0}
        elif label == "POST /admin/login":
            case.body = {"key": self.admin_key}
        elif label == "GET /admin/login":
            case.query = {"token": self.login_token()}
        if not walking:
            self._aim_path(case)
        return case

    def _aim_path(self, case: schemathesis.Case) -> None:
        """Path parameters that name something created earlier; a DELETE takes the oldest, so the rest stay."""
        params = case.path_parameters or {}
        if "key_id" in params and self.ids["key_id"]:
            params["tenant"], params["key_id"] = self._pick("key_id", case)
            return
        for name in params:
            if self.ids[name]:
                params[name] = self._pick(name, case)

    def _pick(self, name: str, case: schemathesis.Case) -> Any:
        """DELETE takes (and forgets) the oldest, disabling takes the oldest too, the rest the newest."""
        if case.operation.method.upper() == "DELETE":
            return self.ids[name].pop(0)
        return self.ids[name][0 if case.operation.path.endswith("/disable") else -1]

    def learn(self, case: schemathesis.Case, status: int, answer: Any) -> None:
        """Remember what a successful creation made: its id for later paths, a model for later inference."""
        if not (200 <= status < 300 and isinstance(answer, dict)):
            return
        created = CREATES.get(case.operation.label)
        if created == "key_id":
            self.ids["key_id"].append((case.path_parameters["tenant"], answer["id"]))
        elif created is not None:
            self.ids[created].append(answer["id"])
        if case.operation.label == "POST /v1/adapters":
            self.models.add(answer["model"])
            self.ids["model"].append(answer["model"])
            self.adapter_models[answer["id"]] = answer["model"]
        elif case.operation.label == "DELETE /v1/adapters/{adapter_id}":  # its model went with it
            model = self.adapter_models.get(case.path_parameters["adapter_id"])
            self.models.discard(model)
            if model in self.ids["model"]:
                self.ids["model"].remove(model)


def _known(body: dict[str, Any] | None, fields: frozenset[str]) -> dict[str, Any]:
    """The generated fields the route knows (the others are refused by name, which the third case covers)."""
    return {key: value for key, value in (body or {}).items() if key in fields}


def _aim(body: dict[str, Any], base_model: str, models: set[str]) -> None:
    """A served model (the one a link put there if it is one) and token counts that finish in moments."""
    if body.get("model") not in models:
        body["model"] = base_model
    for name, cap in TOKEN_CAPS.items():
        if isinstance(body.get(name), int) and not isinstance(body.get(name), bool):
            body[name] = max(1, min(body[name], cap))
    if "max_tokens" not in body and "max_completion_tokens" not in body:
        body["max_tokens"] = TOKEN_CAPS["max_tokens"]  # a chat answer would otherwise run to the context
