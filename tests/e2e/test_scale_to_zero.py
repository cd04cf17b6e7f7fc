"""`loraplex up --replica-idle-ttl`: no server runs until a request comes; requests that arrive meanwhile are held
and all answered; with no traffic the server stops after the TTL, and the next request brings it back."""

from __future__ import annotations

import json
import re
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
from openai import OpenAI

from tests.e2e.up import RunningPlatform, running_up, wait_for
from tests.prometheus import Metrics

BASE_MODEL = "tiny-llama"
IDLE_TTL_S = 4


def scrape(platform: RunningPlatform) -> Metrics:
    return Metrics(httpx.get(f"{platform.api_url}/metrics", timeout=30).text)


def served_replicas(platform: RunningPlatform) -> float | None:
    try:
        return scrape(platform).value("loraplex_api_replicas_live", base_model=BASE_MODEL)
    except httpx.HTTPError:
        return None


def scale_downs(platform: RunningPlatform) -> float | None:
    try:
        return scrape(platform).value("loraplex_api_scale_downs_total", base_model=BASE_MODEL)
    except httpx.HTTPError:
        return None


def test_the_server_starts_on_demand_and_stops_when_idle(tmp_path: Path) -> None:
    with running_up(tmp_path / "up", "--replica-idle-ttl", str(IDLE_TTL_S), components={"api", "worker"}) as platform:
        assert "server" not in platform.child_pids()
        assert f"started on demand, stopped after {IDLE_TTL_S} s idle" in platform.output()
        api_log = platform.data_dir / "logs" / "api.log"
        tenant = json.loads(platform.cli("admin", "create-tenant", "sleeper", "--json"))
        client = OpenAI(base_url=f"{platform.api_url}/v1", api_key=tenant["api_key"], max_retries=0, timeout=300)

        def complete(_: int = 0) -> int:
            answer = client.completions.create(model=BASE_MODEL, prompt="good morning", max_tokens=2)
            assert answer.usage is not None
            return answer.usage.completion_tokens

        assert served_replicas(platform) == 0
        # Four requests find the base at zero: they are held while one replica starts, and all are answered.
        with ThreadPoolExecutor(4) as pool:
            assert list(pool.map(complete, range(4))) == [2, 2, 2, 2]
        first = scrape(platform)
        assert first.value("loraplex_api_cold_starts_total", base_model=BASE_MODEL, outcome="started") == 1
        assert first.value("loraplex_api_replicas_live", base_model=BASE_MODEL) == 1
        assert re.search(rf"cold start of {BASE_MODEL}: a replica registered after \d+\.\d s", api_log.read_text())

        # No traffic: the replica stops after the TTL, and the API wants none. The scale-down is counted once
        # the process has exited, which is after it left the registry (live goes to 0 first): wait for the count.
        wait_for(lambda: scale_downs(platform) == 1, "the idle replica to be stopped", platform, 120)
        idle = scrape(platform)
        assert idle.value("loraplex_api_replicas_live", base_model=BASE_MODEL) == 0
        assert idle.value("loraplex_api_replicas_wanted", base_model=BASE_MODEL) == 0
        assert f"stopped replica {BASE_MODEL}-local-" in api_log.read_text()

        # The next request brings it back.
        assert complete() == 2
        assert scrape(platform).value("loraplex_api_cold_starts_total", base_model=BASE_MODEL, outcome="started") == 2
