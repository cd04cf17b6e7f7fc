"""One API in front of two base models (a tiny Llama and a tiny Qwen2 of another width), each with its own
replica, and a training worker for the second only: models, routing, training, uploads and continued jobs
go to the base they name, and every answer is what transformers (+ PEFT) generates on that base."""

from __future__ import annotations

import json
import shutil
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from openai import BadRequestError

from core.local_services import EmbeddedRedis
from core.protocol import replica_key
from core.settings import Settings
from core.storage import open_store
from core.tiny_model import TinyModelSpec, make_tiny_model
from tests.integration.api.conftest import TenantHandle
from tests.integration.api.datasets import chat_jsonl
from tests.integration.api.peft_adapters import adapter_files, make_peft_adapter
from tests.integration.api.test_end_to_end import follow
from tests.integration.api_inference.deployment import Deployment, deploy, launch_replica
from tests.integration.conftest import launch_worker
from tests.integration.training.jobs import greedy_completions
from tests.services import S3Service

pytestmark = pytest.mark.slow
PROMPTS = ["The capital of France is", "1, 2, 3,"]


@dataclass
class TwoBases:
    deployment: Deployment
    first: str
    first_dir: Path
    second: str
    second_dir: Path
    second_settings: Settings
    workdir: Path


@pytest.fixture(scope="module")
def two_bases(
    tmp_path_factory: pytest.TempPathFactory, redis_service: EmbeddedRedis, s3_service: S3Service, tiny_model_dir: Path
) -> Iterator[TwoBases]:
    workdir = tmp_path_factory.mktemp("two-bases")
    second_dir = make_tiny_model(workdir / "tiny-qwen", TinyModelSpec(family="qwen2", hidden=64, seed=1))
    second = f"qwen-{uuid.uuid4().hex[:8]}"
    deployment = deploy(workdir, redis_service.url, s3_service, tiny_model_dir, base_models=f"{second}={second_dir}")
    # The second base's own processes: a server and a worker that load it as their LORAPLEX_BASE_MODEL.
    own = {"base_model": str(second_dir), "base_model_name": second, "base_models": None}
    second_settings = deployment.settings.model_copy(update=own)
    try:
        deployment.start_replicas(tiny_model_dir, ["first-a"], workdir)
        replica = launch_replica(second_settings, second_dir, "second-a", workdir)
        deployment.replicas["second-a"] = replica
        deployment.processes.append(replica.process)
        deployment.processes.append(launch_worker(second_settings, workdir / "worker-second.log"))
        deployment.wait_until(lambda: deployment.redis.exists(replica_key("second-a")), "the second base's server")
        yield TwoBases(deployment, deployment.base_model, tiny_model_dir, second, second_dir, second_settings, workdir)
    finally:
        deployment.stop()


def greedy(tenant: TenantHandle, model: str, prompt: str) -> str:
    """The API's greedy completion of ``prompt`` on ``model``."""
    with tenant.http() as http:
        answer = http.post(
            "/v1/completions", json={"model": model, "prompt": prompt, "max_tokens": 40, "temperature": 0}
        )
    assert answer.status_code == 200, answer.text
    return answer.json()["choices"][0]["text"]


def same_text(api: list[str], transformers: list[str]) -> bool:
    """Equal up to a last character cut mid-way: 40 tokens of a random byte-level model may end inside a UTF-8
    sequence, which the server holds back and transformers' decode prints as U+FFFD."""
    return [a.rstrip("\ufffd") for a in api] == [t.rstrip("\ufffd") for t in transformers]


def replicas_that_served(bases: TwoBases, tenant: TenantHandle) -> set[str | None]:
    return {record.replica for record in bases.deployment.usage_records(tenant.id)}


def test_each_base_is_listed_and_answers_from_its_own_server_as_transformers_does(two_bases: TwoBases) -> None:
    bases = two_bases
    tenant = bases.deployment.make_tenant()
    client = tenant.openai()

    listed = [m.id for m in client.models.list()]
    assert listed[:2] == [bases.first, bases.second]  # the default base first
    assert client.models.retrieve(bases.second).id == bases.second

    for name, model_dir, replica in (
        (bases.first, bases.first_dir, "first-a"),
        (bases.second, bases.second_dir, "second-a"),
    ):
        before = replicas_that_served(bases, tenant)
        answers = [greedy(tenant, name, prompt) for prompt in PROMPTS]
        assert same_text(answers, greedy_completions(model_dir, PROMPTS)), answers
        bases.deployment.wait_until(
            lambda r=replica, b=before: r in replicas_that_served(bases, tenant) - b, f"usage served by {replica}"
        )
        assert replicas_that_served(bases, tenant) - before == {replica}


def test_a_job_trains_on_the_base_it_names_and_its_adapter_answers_as_peft_does_on_that_base(
    two_bases: TwoBases, tmp_path: Path
) -> None:
    bases = two_bases
    tenant = bases.deployment.make_tenant()
    client = tenant.openai()
    training = client.files.create(file=("train.jsonl", chat_jsonl(12)), purpose="fine-tune")
    hyperparameters = {"n_epochs": 2, "batch_size": 4, "lora_r": 4}
    waiting = client.fine_tuning.jobs.create(
        model=bases.first, training_file=training.id, hyperparameters=hyperparameters
    )
    job = client.fine_tuning.jobs.create(
        model=bases.second, training_file=training.id, hyperparameters=hyperparameters, suffix="q"
    )
    with pytest.raises(BadRequestError) as caught:
        client.fine_tuning.jobs.create(model="gpt-4o-mini", training_file=training.id)
    assert f"'{bases.first}', '{bases.second}'" in str(caught.value.body)

    final = follow(client, job.id, bases.deployment.processes[-1])

    assert final.status == "succeeded", final.error
    assert final.fine_tuned_model == f"ft:{bases.second}:{tenant.name}:q:{job.id}"
    # Only the second base has a worker here: the first base's job waits for one of its own.
    assert client.fine_tuning.jobs.retrieve(waiting.id).status == "queued"
    assert client.fine_tuning.jobs.cancel(waiting.id).status == "cancelled"
    models = {m.id: m for m in client.models.list()}
    assert (models[final.fine_tuned_model].model_extra or {})["parent"] == bases.second

    with tenant.http() as http:
        adapter = next(a for a in http.get("/v1/adapters").json()["data"] if a["model"] == final.fine_tuned_model)
    store = open_store(bases.deployment.settings)
    local = tmp_path / "adapter"
    for obj in store.list(f"tenants/{tenant.id}/adapters/{adapter['id']}/"):
        store.get_file(obj.key, local / obj.key.rsplit("/", 1)[-1])
    before = replicas_that_served(bases, tenant)
    answers = [greedy(tenant, final.fine_tuned_model, prompt) for prompt in PROMPTS]
    assert same_text(answers, greedy_completions(bases.second_dir, PROMPTS, local)), answers
    bases.deployment.wait_until(lambda: replicas_that_served(bases, tenant) - before, "the adapter's usage")
    assert replicas_that_served(bases, tenant) - before == {"second-a"}

    # Continuing it trains on its base too, whichever base the request does not name.
    more = client.fine_tuning.jobs.create(
        model=final.fine_tuned_model, training_file=training.id, hyperparameters={"n_epochs": 1, "batch_size": 4}
    )
    continued = follow(client, more.id, bases.deployment.processes[-1])
    assert continued.status == "succeeded", continued.error
    assert (continued.model, continued.fine_tuned_model) == (
        final.fine_tuned_model,
        f"ft:{bases.second}:{tenant.name}::{more.id}",
    )


def test_an_uploaded_adapter_goes_to_the_base_it_names_and_must_fit_it(two_bases: TwoBases, tmp_path: Path) -> None:
    bases = two_bases
    tenant = bases.deployment.make_tenant()
    for_second = make_peft_adapter(bases.second_dir, tmp_path / "second", r=4)
    for_first = make_peft_adapter(bases.first_dir, tmp_path / "first", r=4)
    claims_second = tmp_path / "claims-second"  # as PEFT saves one trained on a hub model served by that name
    claims_second.mkdir()
    config = json.loads((for_second / "adapter_config.json").read_text())
    (claims_second / "adapter_config.json").write_text(json.dumps({**config, "base_model_name_or_path": bases.second}))
    shutil.copy(for_second / "adapter_model.safetensors", claims_second / "adapter_model.safetensors")
    with tenant.http() as http:
        named = http.post("/v1/adapters", files=adapter_files(for_second), data={"model": bases.second})
        assert named.status_code == 200, named.text
        assert named.json()["base_model"] == bases.second
        # Without the field: the base its adapter_config.json names when one is served by that name, else the
        # default base.
        implied = http.post("/v1/adapters", files=adapter_files(claims_second))
        assert implied.status_code == 200 and implied.json()["base_model"] == bases.second, implied.text
        default = http.post("/v1/adapters", files=adapter_files(for_first))
        assert default.status_code == 200 and default.json()["base_model"] == bases.first, default.text
        # An adapter of another width does not fit the base it is sent for.
        misfit = http.post("/v1/adapters", files=adapter_files(for_first), data={"model": bases.second})
        assert misfit.status_code == 400 and "the base needs [r, 64]" in misfit.text, misfit.text
        unknown = http.post("/v1/adapters", files=adapter_files(for_second), data={"model": "nope"})
        assert unknown.status_code == 400 and unknown.json()["error"]["param"] == "model", unknown.text
    answer = greedy(tenant, named.json()["model"], PROMPTS[0])
    assert same_text([answer], greedy_completions(bases.second_dir, PROMPTS[:1], for_second)), answer
