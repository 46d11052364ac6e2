"""FastAPI dependencies: the server state, the caller's tenant, admin-only and metrics access."""

from __future__ import annotations

from fastapi import Depends, Request

from hotprefix.server.protocol import APIError
from hotprefix.server.state import ServerState
from hotprefix.server.tenants import AuthError, Tenant, bearer_key


def get_state(request: Request) -> ServerState:
    return request.app.state.hotprefix


def bearer(request: Request) -> str | None:
    """The API key: ``Authorization: Bearer KEY`` (or a bare value), else ``x-api-key``."""
    return bearer_key(request.headers)


def tenant_dep(request: Request, state: ServerState = Depends(get_state)) -> Tenant:
    try:
        return state.tenants.authenticate(bearer(request))
    except AuthError as e:
        raise APIError(e.status, str(e), code="invalid_api_key") from None


def _require_admin(state: ServerState, tenant: Tenant) -> Tenant:
    try:
        state.tenants.require_admin(tenant)
    except AuthError as e:
        raise APIError(e.status, str(e), type="permission_error", code="permission_denied") from None
    return tenant


def admin_dep(tenant: Tenant = Depends(tenant_dep), state: ServerState = Depends(get_state)) -> Tenant:
    return _require_admin(state, tenant)


def metrics_dep(request: Request, state: ServerState = Depends(get_state)) -> None:
    """/metrics: open on a server without keys or with ``--public-metrics``, else admin only."""
    open_server = not state.tenants.enabled and state.tenants.admin_key is None
    if state.config.public_metrics or open_server:
        return
    _require_admin(state, tenant_dep(request, state))
