"""``lattice whoami``: who the server takes you for -- user, role, tenant, how you
authenticated and when your token expires (``GET /api/v1/auth/whoami``)."""

from __future__ import annotations

import time
from typing import Any

import typer

from lattice_cli.context import OutputOpt, emit, run_api, state_of


def register(app: typer.Typer) -> None:
    app.command("whoami")(whoami)


def whoami_text(me: dict[str, Any], server: str, now: float) -> str:
    from lattice_cli.output import key_values

    expires = me.get("expires_at")
    if isinstance(expires, int | float):
        left = expires - now
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(expires))
        expiry = f"{when} (in {_span(left)})" if left > 0 else f"{when} (expired)"
    else:
        expiry = "-"
    return key_values(
        [
            ("User", me.get("user") or "-"),
            ("Role", me.get("role") or "-"),
            ("Tenant", me.get("tenant") or "-"),
            ("Auth", me.get("method") or "-"),
            ("Expires", expiry),
            ("Server", server),
        ]
    )


def _span(seconds: float) -> str:
    s = int(seconds)
    if s >= 3600:
        return f"{s // 3600}h {s % 3600 // 60}m"
    if s >= 60:
        return f"{s // 60}m {s % 60}s"
    return f"{s}s"


def whoami(ctx: typer.Context, output: OutputOpt = None) -> None:
    """Show the user, role, tenant and token expiry the server sees."""
    state = state_of(ctx)
    me = run_api(state, lambda client: client.whoami())
    fmt = state.output(output)
    server = state.config.parsed_endpoint.url
    emit(state, fmt, me, lambda: whoami_text(me, server, time.time()))
