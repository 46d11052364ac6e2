"""The operator's live dashboard: ``GET /dashboard`` (the page), ``GET /dashboard/data`` (what it
polls every 2 s), ``POST /dashboard/login`` and ``POST /dashboard/logout``, and the page's assets.

Who may look: everyone on a server without keys (no key file, no admin key); otherwise the admin
only. A browser signs in once with the admin key (the form, or ``GET /dashboard?key=KEY`` for
scripts, which redirects to drop the key from the URL) and gets an HttpOnly, SameSite=Strict cookie
holding a random session token; the server keeps only the token's hash, mapped to the admin role,
never the key. A bearer admin key works too. A tenant key gets 403: the page shows other tenants'
prompt excerpts (the prefix tree) and their figures.

The page, its script and its style ship in ``dashboard_assets/`` inside the package (no CDN, no
build step); the history the charts draw is kept by the browser. Knows nothing about the engine's
internals: it asks ``cache_stats``, ``prefix_tree`` and ``tenant_overview``. The KV groups of a
hybrid pool (bytes per group, hits by hit kind) come from ``cache_stats`` too and stay behind the
same sign-in: they move with every tenant's traffic.
"""

from __future__ import annotations

import hashlib
import html
import secrets
import time
from importlib import resources
from typing import Any, Callable
from urllib.parse import parse_qs

from fastapi import APIRouter, Depends, Request
from fastapi.responses import HTMLResponse, JSONResponse, RedirectResponse, Response

from hotprefix.engine.engine import LLMEngine
from hotprefix.server.deps import bearer, get_state
from hotprefix.server.protocol import APIError
from hotprefix.server.state import ServerState
from hotprefix.server.tenants import AuthError

router = APIRouter(include_in_schema=False)

COOKIE = "hotprefix_dashboard"
SESSION_TTL_S = 12 * 3600.0
"""A dashboard session lasts this long, then the browser signs in again."""
MAX_SESSIONS = 64
"""Signed-in browsers kept; the oldest session goes first."""
TREE_BLOCKS = 24
"""Blocks in the prefix tree the page shows."""
EXCERPT_CHARS = 80
"""Characters of each block's excerpt (a block of 16 tokens is about 60-80)."""
MAX_TENANTS = 20
"""Tenants in the page's table (most queried first)."""
MAX_FORM_BYTES = 4096
ASSETS = {"app.js": "text/javascript; charset=utf-8", "style.css": "text/css; charset=utf-8"}
PAGE_HEADERS = {
    "Content-Security-Policy": "default-src 'none'; script-src 'self'; style-src 'self'; "
                               "img-src 'self' data:; connect-src 'self'; form-action 'self'; "
                               "frame-ancestors 'none'; base-uri 'none'",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "same-origin",
    "Cache-Control": "no-store",
}


class Sessions:
    """Signed-in dashboard browsers: the SHA-256 of each session token -> its expiry time.

    Every session is the admin's (the only role that may sign in). One per app, on
    ``app.state.dashboard_sessions``.
    """

    def __init__(self, ttl_s: float = SESSION_TTL_S, max_sessions: int = MAX_SESSIONS,
                 clock: Callable[[], float] = time.monotonic):
        self.ttl_s = ttl_s
        self.max_sessions = max_sessions
        self.clock = clock
        self._expiry: dict[str, float] = {}  # token hash -> monotonic expiry, oldest first

    @staticmethod
    def _hash(token: str) -> str:
        return hashlib.sha256(token.encode()).hexdigest()

    def create(self) -> str:
        """A new session token (to hand to the browser; only its hash is kept)."""
        now = self.clock()
        for h in [h for h, exp in self._expiry.items() if exp <= now]:
            del self._expiry[h]
        while len(self._expiry) >= self.max_sessions:
            del self._expiry[next(iter(self._expiry))]
        token = secrets.token_urlsafe(32)
        self._expiry[self._hash(token)] = now + self.ttl_s
        return token

    def valid(self, token: str | None) -> bool:
        if not token:
            return False
        exp = self._expiry.get(self._hash(token))
        return exp is not None and exp > self.clock()

    def drop(self, token: str | None) -> None:
        if token:
            self._expiry.pop(self._hash(token), None)


def sessions_of(request: Request) -> Sessions:
    st = request.app.state
    s = getattr(st, "dashboard_sessions", None)
    if s is None:
        s = st.dashboard_sessions = Sessions()
    return s


def is_open(state: ServerState) -> bool:
    """No key file and no admin key: everyone may look (as everyone may read the stats)."""
    return not state.tenants.enabled and state.tenants.admin_key is None


def key_role(state: ServerState, key: str | None) -> str:
    """``admin``, ``tenant`` (a valid key without the admin right) or ``invalid``."""
    try:
        tenant = state.tenants.authenticate(key)
    except AuthError:
        return "invalid"
    return "admin" if tenant.admin else "tenant"


def access(request: Request, state: ServerState) -> str:
    """How this request may see the dashboard: ``admin``, ``tenant`` (refused), ``invalid``
    (a wrong bearer key), ``expired`` (a stale cookie) or ``anonymous``."""
    if is_open(state):
        return "admin"
    key = bearer(request)
    if key:
        return key_role(state, key)
    cookie = request.cookies.get(COOKIE)
    if sessions_of(request).valid(cookie):
        return "admin"
    return "expired" if cookie else "anonymous"


def _base(request: Request) -> str:
    return request.scope.get("root_path", "") + "/dashboard"


def _same_origin(request: Request) -> bool:
    """A form post from this server's own page, as the browser tells (``Sec-Fetch-Site``, else
    ``Origin``); a client that sends neither is not a browser and cannot be forged into posting."""
    site = request.headers.get("sec-fetch-site")
    if site is not None:
        return site in ("same-origin", "none")
    origin = request.headers.get("origin")
    if origin is None:
        return True
    return origin.split("://", 1)[-1] == request.headers.get("host", "")


def _asset(name: str) -> str:
    return (resources.files("hotprefix.server") / "dashboard_assets" / name).read_text("utf-8")


def _html(name: str, request: Request, **values: str) -> str:
    """A page of the assets with ``{{base}}`` (the dashboard's URL path) and ``values`` filled in."""
    text = _asset(name)
    for k, v in {"base": _base(request), **values}.items():
        text = text.replace("{{" + k + "}}", html.escape(v))
    return text


def _page(request: Request) -> HTMLResponse:
    return HTMLResponse(_html("index.html", request), headers=PAGE_HEADERS)


LOGIN_MESSAGES = {
    "anonymous": (401, ""),
    "expired": (401, "Your session has expired: sign in again."),
    "invalid": (401, "That key is not valid."),
    "tenant": (403, "That is a tenant key: the dashboard needs the admin key."),
    "signed_out": (401, "Signed out."),
    "bad_origin": (403, "Sign in from this server's own page."),
}


def _login_form(request: Request, why: str) -> HTMLResponse:
    status, message = LOGIN_MESSAGES[why]
    return HTMLResponse(_html("login.html", request, message=message), status_code=status,
                        headers=PAGE_HEADERS)


def _signed_in(request: Request) -> Response:
    """Start a session and send the browser to the page (the key is not in the URL it lands on)."""
    token = sessions_of(request).create()
    resp = RedirectResponse(_base(request), status_code=303, headers={"Cache-Control": "no-store",
                                                                        "Referrer-Policy": "no-referrer"})
    resp.set_cookie(COOKIE, token, max_age=int(SESSION_TTL_S), path=_base(request), httponly=True,
                    samesite="strict", secure=request.url.scheme == "https")
    return resp


GROUP_FIELDS = ("group", "kind", "window", "pages_in_use", "pages_cached", "pages_kept",
                "bytes_in_use", "bytes_cached")


def _layer_list(layers: list[int]) -> str:
    """``[0, 1, 2, 5]`` -> ``"0-2, 5"`` (a group of Gemma 3 27B holds a few of 62 layers)."""
    runs: list[list[int]] = []
    for i in layers:
        if runs and i == runs[-1][1] + 1:
            runs[-1][1] = i
        else:
            runs.append([i, i])
    return ", ".join(f"{a}" if a == b else f"{a}-{b}" for a, b in runs)


def kv_groups_view(s: dict[str, Any]) -> dict[str, Any]:
    """The pool's KV groups as the page's "KV groups" panel draws them: per group its kind,
    layers, bytes in use and cached, pages kept; a hybrid pool's hits by hit kind, the hits that
    resumed earlier than the full groups' run and its interior blocks (the operator's view)."""
    groups = s.get("kv_groups") or []
    return {
        "hybrid": bool(s.get("hybrid_kv")),
        "num_layers": sum(len(g.get("layers", [])) for g in groups),
        "page_bytes": s.get("page_bytes"),
        "groups": [{**{k: g.get(k) for k in GROUP_FIELDS}, "layers": _layer_list(g.get("layers", []))}
                   for g in groups],
        "hits_by_kind": dict(s.get("window_hits_by_kind", {})),
        "resumed_earlier": s.get("window_resumed_earlier", 0),
        "blocks_interior": s.get("blocks_interior", 0),
    }


def dashboard_data(state: ServerState, e: LLMEngine) -> dict[str, Any]:
    """What one poll of the page gets (a few KB), read in the engine thread."""
    s = e.cache_stats()
    names = state.tenants.name_of
    tenants = []
    for salt, f in e.tenant_overview().items():
        causes = f.get("top_miss_causes") or []
        tenants.append({"tenant": names(salt), "requests": f["requests"],
                        "queries_tokens": f["queries_tokens"], "hit_tokens": f["hit_tokens"],
                        "hit_rate": f["hit_rate"], "hit_rate_recent": f["hit_rate_recent"],
                        "top_miss_cause": causes[0]["summary"] if causes else None})
    tenants.sort(key=lambda t: (-t["queries_tokens"], t["tenant"]))
    tree = e.prefix_tree(TREE_BLOCKS, EXCERPT_CHARS)
    for node in tree:
        salt = node.pop("salt")
        node["tenant"] = names(salt) if salt is not None else None
    tier_fields = ("kind", "url", "status", "last_error", "hit_tokens", "misses", "bytes_read",
                   "bytes_written", "dropped_writes", "corrupt", "errors", "timeouts", "entries",
                   "bytes", "evictions")
    return {
        "t": time.time(),
        "model": state.served_name,
        "block_size": s["block_size"],
        "eviction_policy": s["eviction_policy"],
        "bytes_per_token": s.get("bytes_per_token"),
        "kv_cache_dtype": s.get("kv_cache_dtype"),
        "enabled": s["enabled"],
        "requests": s["requests"],
        "queries_tokens": s["queries_tokens"],
        "hit_tokens": s["hit_tokens"],
        "hit_rate": s["hit_rate"],
        "hit_rate_recent": s["hit_rate_recent"],
        "recent_window_requests": s["recent_window_requests"],
        "written_blocks": s["written_blocks"],
        "kv_usage": s["kv_usage"],
        "evictions": s["evictions"],
        "evictions_per_second": s["evictions_per_second"],
        "miss_tokens_by_reason": s["miss_tokens_by_reason"],
        "top_miss_causes": [{"summary": c["summary"], "reason": c["reason"], "tokens": c["tokens"],
                             "share": c["share"]} for c in s["top_miss_causes"]],
        "pool": {"total": s["blocks_total"], "in_use": s["blocks_in_use"],
                 "cached": s["blocks_cached"], "empty": s["blocks_empty"],
                 "pinned": s["blocks_pinned"]},
        "running": s["running"],
        "waiting": s["waiting"],
        "tiers": {name: {k: t.get(k) for k in tier_fields} for name, t in s["tiers"].items()},
        "kv_groups": kv_groups_view(s),
        "tenants": tenants[:MAX_TENANTS],
        "num_tenants": len(tenants),
        "prefix_tree": tree,
    }


@router.get("/dashboard")
async def page(request: Request, key: str | None = None, state: ServerState = Depends(get_state)):
    if key is not None and not is_open(state):
        role = key_role(state, key)
        if role == "admin":
            return _signed_in(request)
        return _login_form(request, role)
    if key is not None:  # an open server: nothing to sign in to, but drop the key from the URL
        return RedirectResponse(_base(request), status_code=303)
    how = access(request, state)
    return _page(request) if how == "admin" else _login_form(request, how)


@router.post("/dashboard/login")
async def login(request: Request, state: ServerState = Depends(get_state)):
    if not _same_origin(request):
        return _login_form(request, "bad_origin")
    body = await request.body()
    if len(body) > MAX_FORM_BYTES:
        return _login_form(request, "invalid")
    try:
        form = parse_qs(body.decode("utf-8", "replace"), max_num_fields=4)
    except ValueError:  # more fields than the form has
        return _login_form(request, "invalid")
    key = (form.get("key") or [""])[0].strip()
    if is_open(state):
        return RedirectResponse(_base(request), status_code=303)
    role = key_role(state, key) if key else "invalid"
    return _signed_in(request) if role == "admin" else _login_form(request, role)


@router.post("/dashboard/logout")
async def logout(request: Request):
    if not _same_origin(request):
        return _login_form(request, "bad_origin")
    sessions_of(request).drop(request.cookies.get(COOKIE))
    resp = _login_form(request, "signed_out")
    resp.delete_cookie(COOKIE, path=_base(request), httponly=True, samesite="strict")
    return resp


@router.get("/dashboard/data")
async def data(request: Request, state: ServerState = Depends(get_state)):
    how = access(request, state)
    if how == "tenant":
        raise APIError(403, "The dashboard needs the admin key.", type="permission_error",
                       code="permission_denied")
    if how != "admin":
        raise APIError(401, "Sign in to the dashboard with the admin key.", code="invalid_api_key")
    payload = await state.aengine.call(lambda e: dashboard_data(state, e))
    payload["open"] = is_open(state)  # no sign-in on this server: the page hides "Sign out"
    return JSONResponse(payload, headers={"Cache-Control": "no-store"})


@router.get("/dashboard/{name}")
async def asset(name: str):
    if name not in ASSETS:
        raise APIError(404, f"No dashboard file {name!r}.", code="not_found")
    return Response(_asset(name), media_type=ASSETS[name],
                    headers={"Cache-Control": "no-cache", "X-Content-Type-Options": "nosniff"})
