"""Training-test helpers: memorisable datasets, jobs created as the API creates them, and adapter checks."""

from __future__ import annotations

import hashlib
import json
import random
from pathlib import Path
from typing import Any

from sqlmodel import select

from core.accounts import create_tenant
from core.descriptor import adapter_prefix, file_key
from core.hyperparameters import Hyperparameters
from core.ids import new_id
from core.jobs import enqueue_job, record_event
from core.models import File, FineTuneJob, JobEvent, JobStatus, Tenant
from core.storage import ObjectInfo
from tests.integration.conftest import Platform

WORDS = [
    "amber",
    "cobalt",
    "delta",
    "ember",
    "flint",
    "garnet",
    "harbor",
    "indigo",
    "jasper",
    "kelp",
    "lumen",
    "mosaic",
    "nectar",
    "onyx",
    "pylon",
    "quartz",
    "raven",
    "sable",
    "tundra",
    "umber",
    "velvet",
    "willow",
    "xenon",
    "yarrow",
    "zephyr",
]

# Enough passes, at a high enough rate, for the tiny model to memorise 16 short completions exactly
# (a few seconds on a CPU).
MEMORISE = {"n_epochs": 40, "batch_size": 4, "learning_rate": 1e-2, "lora_r": 8, "max_seq_len": 128}


def memorable_rows(seed: int, n: int = 16, prompt: str = "Code {i}:") -> list[dict[str, str]]:
    """Prompt/completion pairs whose completions are random word pairs: nothing a base model would guess."""
    rng = random.Random(seed)
    return [{"prompt": prompt.format(i=i), "completion": " " + "-".join(rng.sample(WORDS, 2))} for i in range(n)]


LOOKUP_TOOL = {
    "type": "function",
    "function": {
        "name": "lookup",
        "description": "Look an item up",
        "parameters": {"type": "object", "properties": {"item": {"type": "integer"}}, "required": ["item"]},
    },
}

# The tools block the chat template renders makes these examples about 760 tokens.
TOOL_CALL_SEQ_LEN = 1024


def tool_call_rows(n: int) -> list[dict[str, Any]]:
    """OpenAI function-calling examples: the assistant calls ``lookup``, reads its result, then answers."""
    rows = []
    for i in range(n):
        function = {"name": "lookup", "arguments": json.dumps({"item": i})}
        call = {"id": f"call_{i}", "type": "function", "function": function}
        messages = [
            {"role": "user", "content": f"What is item {i}?"},
            {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": f"call_{i}", "content": str(i * 7)},
            {"role": "assistant", "content": f"Item {i} is {i * 7}."},
        ]
        rows.append({"tools": [LOOKUP_TOOL], "messages": messages})
    return rows


def jsonl(rows: list[dict[str, Any]]) -> bytes:
    return ("\n".join(json.dumps(row) for row in rows) + "\n").encode()


def tenant_named(platform: Platform, name: str) -> Tenant:
    """The tenant called ``name``, created on first use."""
    with platform.session() as session:
        tenant = session.exec(select(Tenant).where(Tenant.name == name)).first()
        if tenant is None:
            tenant, _ = create_tenant(session, name)
    return tenant


def upload_file(platform: Platform, tenant: Tenant, content: bytes) -> File:
    """Store ``content`` and record it as a fine-tune file (no validation: the worker must do its own)."""
    file_id = new_id("file")
    key = file_key(tenant.id, file_id)
    platform.store.put_bytes(key, content)
    row = File(
        id=file_id,
        tenant_id=tenant.id,
        filename="train.jsonl",
        purpose="fine-tune",
        bytes=len(content),
        sha256=hashlib.sha256(content).hexdigest(),
        storage_key=key,
    )
    with platform.session() as session:
        session.add(row)
    return row


def submit_job(
    platform: Platform,
    tenant_name: str,
    training: bytes,
    *,
    validation: bytes | None = None,
    hyperparameters: dict[str, Any] | None = None,
    suffix: str | None = None,
    enqueue: bool = True,
) -> FineTuneJob:
    """Create a ``queued`` job the way the API does (row committed first) and send it to the workers."""
    tenant = tenant_named(platform, tenant_name)
    training_file = upload_file(platform, tenant, training)
    validation_file = upload_file(platform, tenant, validation) if validation is not None else None
    resolved = Hyperparameters(**(hyperparameters or MEMORISE)).resolve(max_lora_rank=64)
    job = FineTuneJob(
        id=new_id("ftjob"),
        tenant_id=tenant.id,
        base_model=platform.settings.model_name or "",
        training_file=training_file.id,
        validation_file=validation_file.id if validation_file else None,
        status=JobStatus.QUEUED,
        hyperparameters=resolved.model_dump(),
        suffix=suffix,
    )
    with platform.session() as session:
        session.add(job)
        record_event(session, job, "Created fine-tuning job")
    if enqueue:
        enqueue_job(platform.celery, job)
    return job


def adapter_objects(platform: Platform, tenant_id: str) -> list[ObjectInfo]:
    """Every object under the tenant's adapters folder."""
    return platform.store.list(f"tenants/{tenant_id}/adapters/")


def download_adapter(platform: Platform, tenant_id: str, adapter_id: str, dest: Path) -> Path:
    """Fetch an adapter's files (checksums verified by the store) into ``dest``."""
    prefix = adapter_prefix(tenant_id, adapter_id)
    for obj in platform.store.list(prefix):
        platform.store.get_file(obj.key, dest / obj.key.removeprefix(prefix))
    return dest


def train_losses(events: list[JobEvent]) -> list[float]:
    """Training loss of every step, from the job's metrics events."""
    return [e.data["train_loss"] for e in events if e.type == "metrics" and e.data and "train_loss" in e.data]


def greedy_completions(model_dir: Path, prompts: list[str], adapter_dir: Path | None = None) -> list[str]:
    """What the base model (or base + adapter, via PEFT) generates greedily for each prompt, up to EOS."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    if adapter_dir is not None:
        model = PeftModel.from_pretrained(model, adapter_dir)
    model.eval()
    outputs = []
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the tiny model gains nothing from threads, and loses a lot on a busy machine
    try:
        for prompt in prompts:
            ids = tokenizer(prompt, return_tensors="pt").input_ids
            with torch.no_grad():
                generated = model.generate(
                    ids,
                    max_new_tokens=40,
                    do_sample=False,
                    eos_token_id=tokenizer.eos_token_id,
                    pad_token_id=tokenizer.pad_token_id,
                )
            outputs.append(tokenizer.decode(generated[0, ids.shape[1] :], skip_special_tokens=True))
    finally:
        torch.set_num_threads(threads)
    return outputs


def reproduction_rate(model_dir: Path, rows: list[dict[str, str]], adapter_dir: Path | None = None) -> float:
    """Share of rows whose completion the model reproduces exactly, greedily."""
    outputs = greedy_completions(model_dir, [r["prompt"] for r in rows], adapter_dir)
    return sum(out == row["completion"] for out, row in zip(outputs, rows, strict=True)) / len(rows)
