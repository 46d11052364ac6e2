"""The operator's dashboard (``GET /dashboard``) in a real browser, its sign-in, and the Grafana board.

A real server (the tiny random-weight model, an API key file, an admin key, a disk KV tier) and
Debian's Chromium driven by Playwright (the system browser: nothing is downloaded). The browser signs
in through the form, requests are sent, and the numbers the page shows are compared with
``GET /v1/cache/stats``; a screenshot goes to ``tests/artifacts/dashboard.png``.

Without Chromium the browser tests fail (CI installs it, see ``.ci/run``); ``HOTPREFIX_NO_BROWSER=1``
skips them instead.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import time
from pathlib import Path

import httpx
import pytest

from hotprefix.config.sections import ServerConfig
from server_support import LONG_SYSTEM, LiveServer, tiny_config, wait_idle

ROOT = Path(__file__).resolve().parent.parent
ARTIFACTS = Path(__file__).resolve().parent / "artifacts"
GRAFANA = ROOT / "deploy" / "grafana" / "hotprefix.json"
ADMIN = "sk-dash-admin"
KEYS = {"sk-dash-alice": "alice", "sk-dash-bob": "bob"}
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--no-first-run"]
QUESTIONS = ["When do warehouses open?", "How big is a container?", "What is Tally?",
             "Who do I ask about a delay?"]


def admin() -> dict[str, str]:
    return {"Authorization": f"Bearer {ADMIN}"}


def chromium_path() -> str:
    """The system Chromium; fails (not skips) when it is missing, unless HOTPREFIX_NO_BROWSER=1."""
    if os.environ.get("HOTPREFIX_NO_BROWSER") == "1":
        pytest.skip("HOTPREFIX_NO_BROWSER=1: browser tests skipped")
    for cand in (os.environ.get("HOTPREFIX_CHROMIUM"), shutil.which("chromium"), "/usr/bin/chromium",
                 shutil.which("chromium-browser")):
        if cand and os.path.exists(cand):
            return cand
    pytest.fail("Chromium not found: install Debian's `chromium` package (apt-get install -y chromium), "
                "point HOTPREFIX_CHROMIUM at a Chromium binary, or set HOTPREFIX_NO_BROWSER=1 to skip")


@pytest.fixture(scope="module")
def browser():
    path = chromium_path()
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        pytest.fail("the `playwright` package is missing: pip install -e '.[dev]'")
    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=path, args=CHROMIUM_ARGS)
        yield b
        b.close()


@pytest.fixture(scope="module")
def srv(tiny_model_dir, tmp_path_factory):
    d = tmp_path_factory.mktemp("dashboard")
    keys = d / "keys.json"
    keys.write_text(json.dumps(KEYS))
    cfg = tiny_config(tiny_model_dir, kv_store=[f"disk:{d / 'kv'}"])
    with LiveServer(cfg, ServerConfig(api_keys=str(keys), admin_key=ADMIN)) as s:
        yield s


def chat(srv, key: str, question: str) -> None:
    r = httpx.post(srv.url + "/v1/chat/completions", timeout=120,
                   headers={"Authorization": f"Bearer {key}"},
                   json={"model": srv.model, "max_tokens": 3, "temperature": 0,
                         "messages": [{"role": "system", "content": LONG_SYSTEM},
                                      {"role": "user", "content": question}]})
    assert r.status_code == 200, r.text


# ---------------------------------------------------------------------------------- HTTP, no browser
def test_sign_in_rules_over_http(srv):
    url = srv.url + "/dashboard"
    with httpx.Client(follow_redirects=False, timeout=30) as c:
        r = c.get(url)
        assert r.status_code == 401 and 'name="key"' in r.text
        assert "script-src 'self'" in r.headers["content-security-policy"]
        assert c.get(url + "/data").status_code == 401
        # a tenant key is refused, as a bearer, in the URL, or through the form
        alice = {"Authorization": "Bearer sk-dash-alice"}
        assert c.get(url, headers=alice).status_code == 403
        assert c.get(url + "/data", headers=alice).status_code == 403
        assert c.get(url, params={"key": "sk-dash-alice"}).status_code == 403
        assert c.post(url + "/login", data={"key": "sk-dash-alice"}).status_code == 403
        assert c.get(url, params={"key": "wrong"}).status_code == 401
        assert c.post(url + "/login", data={"key": "wrong"}).status_code == 401
        assert "set-cookie" not in c.post(url + "/login", data={"key": "wrong"}).headers
        # more fields than the form has: refused like a wrong key (it was a 500 and a traceback)
        r = c.post(url + "/login", content=f"a=1&b=2&c=3&d=4&key={ADMIN}",
                   headers={"Content-Type": "application/x-www-form-urlencoded"})
        assert r.status_code == 401 and "set-cookie" not in r.headers
        # a form post from another site is refused
        assert c.post(url + "/login", data={"key": ADMIN},
                      headers={"Origin": "http://evil.example"}).status_code == 403
        # the admin key in the URL: a session cookie, and a redirect that drops the key
        r = c.get(url, params={"key": ADMIN})
        assert r.status_code == 303 and r.headers["location"] == "/dashboard"
        cookie = r.headers["set-cookie"]
        assert "HttpOnly" in cookie and "SameSite=strict" in cookie.replace("Strict", "strict")
        assert ADMIN not in cookie
        token = r.cookies["hotprefix_dashboard"]
        assert len(token) >= 32
        assert token not in repr(srv.app.state.dashboard_sessions.__dict__)  # only its hash is kept
        jar = {"hotprefix_dashboard": token}
        page = c.get(url, cookies=jar)
        assert page.status_code == 200 and 'id="chart-hit"' in page.text
        assert c.get(url + "/data", cookies=jar).json()["open"] is False
        # a bearer admin key works without a session; assets are public; nothing else is served
        assert c.get(url, headers=admin()).status_code == 200
        assert c.get(url + "/app.js").headers["content-type"].startswith("text/javascript")
        assert c.get(url + "/style.css").status_code == 200
        assert c.get(url + "/index.html").status_code == 404
        # signing out ends the session
        c.post(url + "/logout", cookies=jar)
        assert c.get(url + "/data", cookies=jar).status_code == 401
        assert c.get(url, cookies=jar).status_code == 401


def test_open_without_keys(tiny_model_dir):
    with LiveServer(tiny_config(tiny_model_dir, num_blocks=64)) as s:
        r = httpx.get(s.url + "/dashboard", timeout=30)
        assert r.status_code == 200 and 'id="chart-hit"' in r.text
        d = httpx.get(s.url + "/dashboard/data", timeout=30).json()
        assert d["open"] is True and d["requests"] == 0 and d["prefix_tree"] == []
        r = httpx.get(s.url + "/dashboard", params={"key": "x"}, timeout=30, follow_redirects=False)
        assert r.status_code == 303 and "key" not in r.headers["location"]


# ---------------------------------------------------------------------------------- the browser
def wait_until(page, js: str, timeout_s: float = 20.0) -> None:
    """Poll a JavaScript expression until it is true (``page.wait_for_function`` evaluates strings
    with eval, which the page's Content-Security-Policy forbids, rightly)."""
    deadline = time.monotonic() + timeout_s
    while not page.evaluate(js):
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {js}")
        page.wait_for_timeout(100)


def shown(page, element_id: str) -> str:
    return page.locator(f"#{element_id}").inner_text().strip()


def as_int(text: str) -> int:
    return int(text.replace(",", ""))


def as_pct(text: str) -> float:
    assert text.endswith("%"), text
    return float(text[:-1])


def test_dashboard_in_a_real_browser(srv, browser):
    ctx = browser.new_context(viewport={"width": 1440, "height": 900})
    try:
        page = ctx.new_page()
        errors: list[str] = []
        page.on("pageerror", lambda e: errors.append(str(e)))
        page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)

        # no cookie: the sign-in form; a wrong key and a tenant key are refused there
        resp = page.goto(srv.url + "/dashboard")
        assert resp.status == 401 and page.locator("form#signin input[name=key]").is_visible()
        page.fill("input[name=key]", "sk-dash-alice")
        page.click("button[type=submit]")
        assert "tenant key" in shown(page, "message")
        page.fill("input[name=key]", "nope")
        page.click("button[type=submit]")
        assert "not valid" in shown(page, "message")
        # the admin key: a session cookie (HttpOnly, SameSite=Strict), the page, no key in the URL
        page.fill("input[name=key]", ADMIN)
        page.click("button[type=submit]")
        page.wait_for_selector("#chart-hit")
        assert page.url == srv.url + "/dashboard"
        cookies = [c for c in ctx.cookies() if c["name"] == "hotprefix_dashboard"]
        assert len(cookies) == 1 and cookies[0]["httpOnly"] and cookies[0]["sameSite"] == "Strict"
        assert cookies[0]["value"] != ADMIN
        assert page.evaluate("document.cookie") == ""  # out of reach of scripts
        errors.clear()  # the sign-in pages above were 401/403 answers, by design
        wait_until(page, "Number(document.body.dataset.polls || 0) >= 1")

        # traffic: two tenants sharing a long system prompt among their own requests
        for i, q in enumerate(QUESTIONS):
            chat(srv, "sk-dash-alice", q)
            if i < 2:
                chat(srv, "sk-dash-bob", q)
        stats = wait_idle(srv.url, headers=admin())
        assert stats["requests"] == 6 and stats["hit_tokens"] > 0
        polls = page.evaluate("Number(document.body.dataset.polls)")
        wait_until(page, f"Number(document.body.dataset.polls) >= {polls + 2} && "
                         f"document.getElementById('v-requests').textContent === '{stats['requests']}'")
        stats = httpx.get(srv.url + "/v1/cache/stats", headers=admin(), timeout=30).json()

        # the numbers shown are those of /v1/cache/stats
        assert as_int(shown(page, "v-requests")) == stats["requests"]
        assert abs(as_pct(shown(page, "v-hit-rate")) - 100 * stats["hit_rate"]) <= 0.05 + 1e-9
        assert abs(as_pct(shown(page, "v-hit-rate-recent")) - 100 * stats["hit_rate_recent"]) <= 0.05 + 1e-9
        assert abs(as_pct(shown(page, "v-kv-usage")) - 100 * stats["kv_usage"]) <= 0.05 + 1e-9
        assert as_int(shown(page, "v-blocks-cached")) == stats["blocks_cached"]
        assert float(shown(page, "v-evictions")) == pytest.approx(stats["evictions_per_second"], abs=0.005)
        assert shown(page, "v-tokens") == f"{stats['queries_tokens']:,} prompt tokens"
        assert shown(page, "v-hit-tokens") == f"{stats['hit_tokens']:,} tokens from cache"
        causes = page.locator("#causes li").all_inner_texts()
        assert causes and len(causes) == len(stats["top_miss_causes"])
        for text, cause in zip(causes, stats["top_miss_causes"]):
            assert text.startswith(cause["summary"])
        for name, figures in stats["tenants"].items():
            row = page.locator(f'#tenants tr[data-tenant="{name}"]')
            assert as_int(row.locator("td").nth(1).inner_text()) == figures["requests"]
            assert abs(as_pct(row.locator(".pct").inner_text()) - 100 * figures["hit_rate"]) <= 0.05 + 1e-9
        assert set(stats["tenants"]) == {"alice", "bob"}
        tier_rows = page.locator("#tiers tbody tr")
        assert tier_rows.count() == len(stats["tiers"]) >= 1

        # the charts have data points, and the page draws the missed-token reasons by name
        for chart in ("chart-hit", "chart-kv", "chart-evictions", "chart-miss"):
            n = page.locator(f"#{chart} svg").get_attribute("data-points")
            assert int(n) > 0, chart
        assert page.locator("#chart-hit svg path").count() >= 1
        legend = page.locator("#chart-miss .legend").inner_text()
        for reason in stats["miss_tokens_by_reason"]:
            assert reason in legend

        # the prefix tree: reused blocks with their hits and an excerpt of the system prompt
        nodes = page.locator("#tree .node")
        assert nodes.count() >= 2
        hits = [int(h) for h in nodes.evaluate_all("ns => ns.map(n => n.dataset.hits)")]
        assert max(hits) >= 3 and min(hits) >= 1  # alice's block 0 hit by her 3 later requests
        assert "Quill" in page.locator("#tree").inner_text()
        assert {"alice", "bob"} <= set(page.locator("#tree .tenant").all_inner_texts())

        # a pool without window groups: the KV groups panel says one group of every layer, no table
        layers = len(stats["kv_groups"][0]["layers"])
        assert not stats["hybrid_kv"] and len(stats["kv_groups"]) == 1
        assert page.locator("#groups-single").is_visible() and not page.locator("#groups").is_visible()
        assert f"One KV group: every layer's K/V ({layers} layers)" in shown(page, "groups-single")

        ARTIFACTS.mkdir(exist_ok=True)
        page.screenshot(path=str(ARTIFACTS / "dashboard.png"), full_page=True)
        assert (ARTIFACTS / "dashboard.png").stat().st_size > 10_000
        assert not errors, errors

        # a tenant key in the URL: 403, no cookie
        other = browser.new_context()
        try:
            resp = other.new_page().goto(srv.url + "/dashboard?key=sk-dash-alice")
            assert resp.status == 403 and not other.cookies()
        finally:
            other.close()
    finally:
        ctx.close()


def test_data_is_small_and_the_tree_is_consistent(srv):
    r = httpx.get(srv.url + "/dashboard/data", headers=admin(), timeout=30)
    assert r.status_code == 200
    assert len(r.content) < 8192  # polled every 2 s: under 4 KB/s
    tree = r.json()["prefix_tree"]
    by_id = {n["id"]: n for n in tree}
    for n in tree:
        assert n["hits"] >= 1 and n["tokens"] == (n["depth"] + 1) * r.json()["block_size"]
        if n["parent"] is not None:
            assert by_id[n["parent"]]["depth"] == n["depth"] - 1
        assert n["excerpt"] and len(n["excerpt"]) <= 80


# ---------------------------------------------------------------------------------- Grafana
def grafana_exprs(board: dict) -> list[str]:
    out = []

    def walk(panels):
        for p in panels:
            out.extend(t["expr"] for t in p.get("targets", []) if t.get("expr"))
            walk(p.get("panels", []))
    walk(board["panels"])
    return out


def test_grafana_board_queries_only_metrics_that_exist(srv):
    board = json.loads(GRAFANA.read_text())
    ids = [p["id"] for p in board["panels"]]
    assert len(ids) == len(set(ids))
    exprs = grafana_exprs(board)
    titles = " ".join(p["title"] for p in board["panels"]).lower()
    for needed in ("hit rate", "kv usage", "evictions", "missed", "time to first token", "queue"):
        assert needed in titles, needed
    chat(srv, "sk-dash-alice", "What is Dockside?")  # at least one finished request and histogram
    httpx.get(srv.url + "/dashboard/data", timeout=30)  # a refused request: a 'rejected' sample
    wait_idle(srv.url, headers=admin())
    scrape = httpx.get(srv.url + "/metrics", headers=admin(), timeout=30).text
    exposed = {m.group(1) for m in re.finditer(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{| )", scrape, re.M)}
    queried = {name for e in exprs for name in re.findall(r"\bhotprefix_[a-zA-Z0-9_]+", e)}
    assert len(queried) >= 20
    missing = sorted(queried - exposed)
    assert not missing, f"the Grafana board queries metrics that /metrics does not expose: {missing}"
    for e in exprs:  # the brackets and parentheses of every query balance
        for o, c in ("()", "[]", "{}"):
            assert e.count(o) == e.count(c), e
