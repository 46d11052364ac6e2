"""The dashboard's "KV groups" panel on a hybrid pool, in a real browser (issue 28).

A tiny random Gemma 3 (5 window layers of 40 keys, 1 full layer: ``test_hybrid_engine``) under the
real server with a key file and an admin key. After a prompt longer than the window the panel has a
row per KV group whose figures are those of ``GET /v1/cache/stats``; after the same prompt again
(a resumed hit) it shows the hits by hit kind. A tenant key gets none of it: not the page, not its
data, not the figures in its own stats or in ``/metrics``. The browser fixture and helpers are
``test_dashboard``'s (Debian's Chromium; ``HOTPREFIX_NO_BROWSER=1`` skips).
"""

from __future__ import annotations

import json
import re

import httpx
import pytest

from hotprefix.config.sections import ServerConfig
from model_support import save_random_model
from server_support import LONG_SYSTEM, LiveServer, tiny_config, wait_idle
from test_dashboard import ADMIN, ARTIFACTS, KEYS, admin, browser, shown, wait_until  # noqa: F401
from test_hybrid_engine import BS, GEMMA3, WINDOW

TENANT = {"Authorization": "Bearer sk-dash-alice"}
GROUP_FIGURES = ("kv_groups", "hybrid_kv", "page_bytes", "blocks_interior", "window_hits_by_kind",
                 "window_resumed_earlier")
"""The operator's hybrid-pool figures in ``/v1/cache/stats``: none of them in a tenant's view."""
UNITS = {"B": 1, "KiB": 1024, "MiB": 1024 ** 2, "GiB": 1024 ** 3, "TiB": 1024 ** 4}


@pytest.fixture(scope="module")
def gemma_srv(tmp_path_factory, default_tokenizer):
    d = tmp_path_factory.mktemp("dashboard-gemma3")
    model = save_random_model(d / "model", default_tokenizer, "Gemma3ForCausalLM", "Gemma3TextConfig",
                              GEMMA3, norm_offset=0.0)
    keys = d / "keys.json"
    keys.write_text(json.dumps(KEYS))
    cfg = tiny_config(str(model), block_size=BS, num_blocks=160, max_model_len=1024, dtype="float32",
                      num_threads=1)
    with LiveServer(cfg, ServerConfig(api_keys=str(keys), admin_key=ADMIN)) as s:
        yield s


def complete(srv) -> dict:
    r = httpx.post(srv.url + "/v1/completions", headers=TENANT, timeout=120,
                   json={"model": srv.model, "prompt": LONG_SYSTEM, "max_tokens": 2, "temperature": 0})
    assert r.status_code == 200, r.text
    return r.json()["usage"]


def as_bytes(text: str) -> float:
    """``"12.5 KiB"`` -> 12800.0 (the page's ``bytes()``, read back)."""
    m = re.fullmatch(r"([0-9.]+) (B|KiB|MiB|GiB|TiB)", text)
    assert m, text
    return float(m.group(1)) * UNITS[m.group(2)]


def fresh_poll(page) -> None:
    """Wait for two more polls of the page: its data is at least as new as the caller's stats."""
    polls = page.evaluate("Number(document.body.dataset.polls || 0)")
    wait_until(page, f"Number(document.body.dataset.polls || 0) >= {polls + 2}")


def check_rows(page, stats: dict) -> None:
    rows = page.locator("#groups tbody tr")
    assert rows.count() == len(stats["kv_groups"])
    for i, g in enumerate(stats["kv_groups"]):
        cells = rows.nth(i).locator("td")
        assert cells.nth(0).inner_text() == str(g["group"])
        assert cells.nth(1).inner_text() == g["kind"]
        for col, key in ((3, "bytes_in_use"), (4, "bytes_cached")):
            cell = cells.nth(col)
            assert int(cell.get_attribute("data-bytes")) == g[key]
            assert cell.get_attribute("title") == f"{g[key]:,} bytes"
            shown_bytes = as_bytes(cell.inner_text())
            assert abs(shown_bytes - g[key]) <= 0.05 * max(1, g[key]) and (shown_bytes > 0) == (g[key] > 0)
        assert int(cells.nth(5).inner_text().replace(",", "")) == g["pages_kept"]


def test_kv_groups_panel_in_a_real_browser(gemma_srv, browser):
    ctx = browser.new_context(viewport={"width": 1440, "height": 1100})
    try:
        page = ctx.new_page()
        errors: list[str] = []
        page.on("pageerror", lambda e: errors.append(str(e)))
        page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
        resp = page.goto(gemma_srv.url + f"/dashboard?key={ADMIN}")
        assert resp.status == 200 and page.url == gemma_srv.url + "/dashboard"
        wait_until(page, "Number(document.body.dataset.polls || 0) >= 1")
        assert page.locator("#groups").is_visible() and not page.locator("#groups-single").is_visible()

        # a prompt longer than the window: every group caches pages, a window group keeps a few
        usage = complete(gemma_srv)
        assert usage["prompt_tokens"] > WINDOW
        stats = wait_idle(gemma_srv.url, headers=admin())
        assert stats["hybrid_kv"] and stats["window_hits_by_kind"] == {}
        kinds = [g["kind"] for g in stats["kv_groups"]]
        assert kinds[0] == "full" and f"window-{WINDOW}" in kinds
        full, win = stats["kv_groups"][0], stats["kv_groups"][kinds.index(f"window-{WINDOW}")]
        assert win["bytes_cached"] > 0 and 0 < win["pages_kept"] < full["pages_kept"]
        fresh_poll(page)
        check_rows(page, stats)
        assert page.locator("#group-hits li").count() == 0 and page.locator("#group-hits-empty").is_visible()
        for figure, key in (("resumed_earlier", "window_resumed_earlier"), ("blocks_interior", "blocks_interior")):
            shown_n = page.locator(f'#group-extra [data-figure="{figure}"]').inner_text()
            assert int(shown_n.replace(",", "")) == stats[key]
        assert shown(page, "groups-note").startswith(
            f"{len(stats['kv_groups'])} groups of {GEMMA3['num_hidden_layers']} layers")

        # the same prompt again resumes from a window: the hits by kind appear, as the stats count them
        second = complete(gemma_srv)
        assert second["prompt_tokens_details"]["cached_tokens"] > WINDOW
        stats = wait_idle(gemma_srv.url, headers=admin())
        hits = stats["window_hits_by_kind"]
        assert hits and sum(hits.values()) >= 1
        wait_until(page, f"document.querySelectorAll('#group-hits li').length === {len(hits)}")
        fresh_poll(page)
        for kind, n in hits.items():
            assert int(page.locator(f'#group-hits [data-kind="{kind}"]').inner_text().replace(",", "")) == n
        assert not page.locator("#group-hits-empty").is_visible()
        check_rows(page, stats)

        ARTIFACTS.mkdir(exist_ok=True)
        page.locator("#groups-panel").screenshot(path=str(ARTIFACTS / "dashboard_groups.png"))
        assert not errors, errors

        # a tenant key in the URL: refused, no cookie, no panel
        other = browser.new_context()
        try:
            tenant_page = other.new_page()
            resp = tenant_page.goto(gemma_srv.url + "/dashboard?key=sk-dash-alice")
            assert resp.status == 403 and not other.cookies()
            assert tenant_page.locator("#groups").count() == 0
        finally:
            other.close()
    finally:
        ctx.close()


def test_a_tenant_key_gets_no_group_figures(gemma_srv):
    complete(gemma_srv)
    wait_idle(gemma_srv.url, headers=admin())
    with httpx.Client(timeout=30) as c:
        url = gemma_srv.url
        ops = c.get(url + "/v1/cache/stats", headers=admin()).json()
        assert all(k in ops for k in GROUP_FIGURES)  # the operator has them (so the checks below bite)
        assert "kv_groups" in c.get(url + "/dashboard/data", headers=admin()).json()
        r = c.get(url + "/dashboard/data", headers=TENANT)
        assert r.status_code == 403 and "kv_groups" not in r.text and "window" not in r.text
        own = c.get(url + "/v1/cache/stats", headers=TENANT)
        assert own.status_code == 200 and own.json()["requests"] >= 1
        assert not [k for k in GROUP_FIGURES if k in own.json()]
        scrape = c.get(url + "/metrics", headers=admin()).text
        assert "hotprefix_kv_group_bytes_cached{" in scrape and "hotprefix_window_hits" in scrape
        m = c.get(url + "/metrics", headers=TENANT)
        assert m.status_code in (401, 403) and "hotprefix_kv_group" not in m.text


def test_layers_are_written_as_runs():
    from hotprefix.server.dashboard import _layer_list
    assert _layer_list([0, 1, 2, 5, 7, 8]) == "0-2, 5, 7-8"
    assert _layer_list([4]) == "4" and _layer_list([]) == ""
