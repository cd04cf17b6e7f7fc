"""The admin dashboard in a real browser: headless Chromium signs in with a login link, renders the page,
and the charts are there, in the DOM and on the screenshot."""

from __future__ import annotations

import re
import threading
from pathlib import Path

import httpx
import pytest

from api.dashboard.charts import PALETTE, POOL_COLORS
from tests.integration.api_inference.chromium import ChartCensus, dump_dom, png_pixels, screenshot
from tests.integration.api_inference.deployment import Deployment
from tests.integration.api_inference.serving import REPLICAS, TrainedAdapter

pytestmark = pytest.mark.slow
CHARTS = ("usage-over-time", "requests-over-time", "top-adapters", "job-outcomes", "pool-occupancy")
SIZE = (1400, 2000)


def login_link(serving: Deployment) -> str:
    with serving.admin() as admin:
        response = admin.post("/admin/login-links")
    assert response.status_code == 200, response.text
    return serving.api.url + response.json()["url"]


def test_the_dashboard_renders_its_charts_in_chromium(
    serving: Deployment, trained_adapter: TrainedAdapter, tmp_path: Path
) -> None:
    for tenant in (trained_adapter.owner, serving.make_tenant()):
        tenant.openai().completions.create(model=serving.base_model, prompt="chart me", max_tokens=4)
    trained_adapter.owner.openai().completions.create(model=trained_adapter.model, prompt="me too", max_tokens=4)

    census = ChartCensus()
    census.feed(dump_dom(login_link(serving), tmp_path / "profile"))

    assert set(CHARTS) <= {name for name, _ in census.charts}, census.charts
    [usage] = census.bars("usage-over-time")
    [top] = census.bars("top-adapters")
    [jobs] = census.bars("job-outcomes")
    assert usage >= 2  # a column segment per tenant with tokens today
    assert top >= 2  # the fine-tuned model and the base model
    assert jobs >= 1
    assert sorted(census.replicas) == REPLICAS
    pools = census.bars("pool-occupancy")  # one per replica, drawing its KV, adapter and free pages
    assert len(pools) == len(REPLICAS) and min(pools) >= 1

    shot = screenshot(login_link(serving), tmp_path / "dashboard.png", tmp_path / "profile-2", SIZE)
    pixels = png_pixels(shot)
    assert pixels.shape[:2] == (SIZE[1], SIZE[0])
    colours = {tuple(int(c) for c in px) for px in pixels[:, :, :3].reshape(-1, 3)[::7]}
    for hex_colour in (PALETTE[0], POOL_COLORS["free"]):  # a chart bar and a pool bar were drawn
        assert tuple(int(hex_colour[i : i + 2], 16) for i in (1, 3, 5)) in colours, hex_colour
    print(f"dashboard screenshot: {shot}")


def test_without_a_session_the_dashboard_asks_for_the_admin_key(serving: Deployment, tmp_path: Path) -> None:
    dom = dump_dom(serving.api.url + "/admin", tmp_path / "profile")
    assert 'name="key"' in dom and 'type="password"' in dom
    census = ChartCensus()
    census.feed(dom)
    assert census.charts == []


def test_signing_in_with_the_form_sets_an_httponly_cookie(serving: Deployment) -> None:
    key = serving.settings.admin_key.get_secret_value() if serving.settings.admin_key else ""
    with httpx.Client(base_url=serving.api.url) as browser:
        wrong = browser.post("/admin/login", data={"key": "nope"})
        assert wrong.status_code == 401 and "not the admin key" in wrong.text
        signed_in = browser.post("/admin/login", data={"key": key})
        assert signed_in.status_code == 303
        cookie = signed_in.headers["set-cookie"].lower()
        assert "httponly" in cookie and "samesite=strict" in cookie and "path=/admin" in cookie
        page = browser.get("/admin")
        assert page.status_code == 200 and 'data-chart="usage-over-time"' in page.text
        csv_export = browser.get("/admin/usage", params={"format": "csv"})  # the dashboard's own link
        assert csv_export.status_code == 200
        browser.post("/admin/logout")
        assert browser.get("/admin").status_code == 401


def test_the_replica_panel_shows_each_busy_tenants_load(serving: Deployment) -> None:
    """A tenant with requests in flight appears, by name, in its replica's heartbeat and on the panel; only
    admins see it (tenants have no route to the panel or to another tenant's queue)."""
    busy = serving.make_tenant()
    stop = threading.Event()

    def keep_busy() -> None:  # long answers one after another, so a heartbeat is sure to catch one running
        client = busy.openai()
        while not stop.is_set():
            client.completions.create(
                model=serving.base_model, prompt="go", max_tokens=1500, extra_body={"ignore_eos": True}
            )

    worker = threading.Thread(target=keep_busy, daemon=True)
    worker.start()
    try:
        loads = serving.wait_until(
            lambda: [t for s in serving.heartbeats().values() for t in s.tenants if t.tenant == busy.id and t.running],
            "the busy tenant running in a heartbeat",
        )
        assert loads[0].running == 1 and loads[0].kv_pages >= 1
        key = serving.settings.admin_key.get_secret_value() if serving.settings.admin_key else ""
        with httpx.Client(base_url=serving.api.url) as browser:
            assert browser.post("/admin/login", data={"key": key}).status_code == 303

            def panel() -> str | None:
                text = browser.get("/admin").text
                return text if f'data-tenant="{busy.name}"' in text else None

            page = serving.wait_until(panel, "the busy tenant on the replica panel")
        assert re.search(rf'data-tenant="{busy.name}">{busy.name} \(running 1, waiting 0, \d+ KV pages\)', page)
        with busy.http() as http:
            assert http.get("/admin").status_code in (401, 403)
            assert http.get("/admin/usage").status_code in (401, 403)
    finally:
        stop.set()
        worker.join(timeout=60)
