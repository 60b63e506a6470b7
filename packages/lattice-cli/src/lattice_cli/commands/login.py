"""``lattice login``: log in to the configured Lattice server with its identity provider.

::

    lattice login                     # browser: authorization code + PKCE
    lattice login --no-browser        # print the URL only (open it anywhere on this host)
    lattice login --device            # headless nodes: URL + code, approve elsewhere
    lattice login --server https://lattice.example.com

The server's ``/api/v1/auth/discovery`` names the IdP, so nothing else is configured.
The tokens are cached per server in ``~/.config/lattice/tokens.json`` (mode 0600) and
used by every later command for that server, refreshed silently. The machinery is
:mod:`lattice_cli.auth`.
"""

from __future__ import annotations

import enum
import os
import time
from typing import Annotated

import typer

from lattice_cli.context import fail, ssl_context_of, state_of, warn


class Flow(enum.StrEnum):
    browser = "browser"
    device = "device"


def register(app: typer.Typer) -> None:
    app.command("login")(login)


def login(
    ctx: typer.Context,
    device: Annotated[
        bool,
        typer.Option(
            "--device",
            help="Device code flow for hosts without a browser: print a URL and a code to "
            "approve on another device.",
        ),
    ] = False,
    flow: Annotated[
        Flow | None,
        typer.Option("--flow", help="browser (default) or device (same as --device)."),
    ] = None,
    no_browser: Annotated[
        bool,
        typer.Option("--no-browser", help="Print the login URL instead of opening a browser."),
    ] = False,
    server: Annotated[
        str | None,
        typer.Option(
            "--server",
            help="Server to log in to (default: the configured endpoint).",
            metavar="URL",
        ),
    ] = None,
    scope: Annotated[
        str,
        typer.Option(
            "--scope", help="Scopes to ask for (space separated), e.g. 'openid operator'."
        ),
    ] = "openid",
    timeout: Annotated[
        float,
        typer.Option("--timeout", help="Seconds to wait for the login to complete.", min=1),
    ] = 300.0,
) -> None:
    """Log in with the server's identity provider (OIDC) and cache the token."""
    from lattice_cli import auth

    state = state_of(ctx)
    if server:
        state.endpoint = server
    try:
        endpoint = state.config.parsed_endpoint.url
        auth.use_ssl_context(ssl_context_of(state))
        doc = auth.discover(endpoint)
        if device or flow == Flow.device:
            entry = auth.login_device(doc, scope=scope, timeout=timeout)
        else:
            entry = auth.login_browser(
                doc, scope=scope, open_browser=not no_browser, timeout=timeout
            )
    except auth.LoginError as exc:
        fail(exc.message, hint=exc.hint)
    except KeyboardInterrupt:
        raise typer.Exit(130) from None
    store = auth.TokenStore(auth.tokens_path(os.environ), warn=warn)
    store.put(endpoint, entry)
    claims = auth.jwt_claims(entry["access_token"])
    who = claims.get("preferred_username") or claims.get("sub") or "?"
    expires = entry.get("expires_at")
    until = (
        time.strftime(" until %Y-%m-%d %H:%M", time.localtime(expires))
        if isinstance(expires, int | float)
        else ""
    )
    if not state.quiet:
        print(f"Logged in to {endpoint} as {who}{until}.")
