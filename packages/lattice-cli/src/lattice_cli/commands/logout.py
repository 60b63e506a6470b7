"""``lattice logout``: forget this server's cached tokens and revoke them at the identity
provider when it has a revocation endpoint (best effort)."""

from __future__ import annotations

import os
from typing import Annotated

import typer

from lattice_cli.context import state_of, warn


def register(app: typer.Typer) -> None:
    app.command("logout")(logout)


def logout(
    ctx: typer.Context,
    server: Annotated[
        str | None,
        typer.Option(
            "--server",
            help="Server to log out of (default: the configured endpoint).",
            metavar="URL",
        ),
    ] = None,
) -> None:
    """Remove the cached token of this server (and revoke it at the IdP)."""
    from lattice_cli import auth

    state = state_of(ctx)
    if server:
        state.endpoint = server
    endpoint = state.config.parsed_endpoint.url
    store = auth.TokenStore(auth.tokens_path(os.environ), warn=warn)
    entry = store.remove(endpoint)
    if entry is None:
        if not state.quiet:
            print(f"Not logged in to {endpoint}.")
        return
    note = ""
    if entry.get("revocation_endpoint"):
        note = (
            " (tokens revoked at the identity provider)"
            if auth.revoke(entry)
            else " (the identity provider did not confirm the revocation)"
        )
    if not state.quiet:
        print(f"Logged out of {endpoint}{note}.")
