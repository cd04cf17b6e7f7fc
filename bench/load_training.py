"""Fine-tuning beside the serving, for the soak: one tenant keeps a job training (a new one as each ends)
while the clients run, through the public API as tenants do. Every job must succeed."""

from __future__ import annotations

import threading
import time
from collections import Counter

import httpx

from bench.load_platform import SoakPlatform, Tenant
from tests.integration.api.datasets import chat_jsonl

POLL_S = 1.0
HYPERPARAMETERS = {"n_epochs": 2, "batch_size": 2, "lora_r": 4}


class TrainingLoad:
    """A thread that trains job after job for ``tenant`` until stopped; ``statuses`` counts how they ended."""

    def __init__(self, platform: SoakPlatform, tenant: Tenant) -> None:
        self.platform = platform
        self.tenant = tenant
        self.statuses: Counter[str] = Counter()
        self.errors: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="soak-training", daemon=True)

    def __enter__(self) -> TrainingLoad:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=600)

    def _run(self) -> None:
        headers = {"Authorization": f"Bearer {self.tenant.key}"}
        with httpx.Client(base_url=self.platform.api_url, headers=headers, timeout=60) as http:
            try:
                dataset = {"file": ("train.jsonl", chat_jsonl(16))}
                uploaded = http.post("/v1/files", files=dataset, data={"purpose": "fine-tune"})
                uploaded.raise_for_status()
                while not self._stop.is_set():
                    self.statuses[self._train(http, uploaded.json()["id"])] += 1
            except httpx.HTTPError as exc:  # the soak reports it; a platform that cannot train fails the soak
                self.errors.append(f"{type(exc).__name__}: {exc}")

    def _train(self, http: httpx.Client, file_id: str) -> str:
        body = {"model": self.platform.base_model, "training_file": file_id, "hyperparameters": HYPERPARAMETERS}
        created = http.post("/v1/fine_tuning/jobs", json=body)
        created.raise_for_status()
        job_id = created.json()["id"]
        while True:  # a job started is seen to its end, even when the soak is over (no job left half-done)
            job = http.get(f"/v1/fine_tuning/jobs/{job_id}").json()
            if job["status"] in ("succeeded", "failed", "cancelled"):
                if job["status"] != "succeeded":
                    self.errors.append(f"job {job_id} {job['status']}: {job.get('error')}")
                return job["status"]
            time.sleep(POLL_S)

    def render(self) -> str:
        ended = ", ".join(f"{status} {n}" for status, n in self.statuses.most_common()) or "none ended"
        return f"training beside the serving: jobs {ended}; errors: {self.errors or 'none'}"
