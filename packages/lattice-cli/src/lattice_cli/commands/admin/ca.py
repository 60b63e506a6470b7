"""``lattice admin ca init|show|issue``: the cluster's internal CA.

``init`` creates it in the quorum (``--rotate`` replaces it; the old one stays trusted
until what it signed expires); ``show`` prints its certificate for distribution;
``issue`` makes a key here, has the CA sign it and writes both: bootstrap certificates
for a node's first contact (``--kind bootstrap --name NODE``, 1 h at most), certificates
of schedulers, brokers and API members. Private keys are written mode 0600 and never
leave this machine.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Annotated, Any

import typer

from lattice_cli.context import OutputOpt, emit, fail, run_api, state_of

ca_app = typer.Typer(help="The cluster's internal certificate authority.", no_args_is_help=True)

KINDS = ("bootstrap", "agent", "api", "scheduler", "checkpoint", "accounting")


def _expiry(epoch: Any) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%SZ", time.gmtime(float(epoch or 0)))


def _ca_text(ca: dict[str, Any]) -> str:
    if not ca.get("cert_pem"):
        return "No internal CA. Create one with `lattice admin ca init`."
    lines = [
        f"Site:     {ca.get('site', '')}",
        f"Serial:   {ca.get('serial', '')}",
        f"Expires:  {_expiry(ca.get('not_after'))}",
        f"Previous: {len(ca.get('previous_pem') or [])} rotated-out CA(s) still trusted",
    ]
    return "\n".join(lines)


@ca_app.command("init")
def ca_init(
    ctx: typer.Context,
    rotate: Annotated[
        bool, typer.Option("--rotate", help="Replace the existing CA (the old one stays trusted).")
    ] = False,
    output: OutputOpt = None,
) -> None:
    """Create the internal CA that signs node agents' certificates."""
    st = state_of(ctx)

    async def go(client: Any) -> Any:
        return await client.init_ca(rotate=rotate)

    ca = run_api(st, go)
    emit(st, st.output(output), ca, lambda: _ca_text(ca))


@ca_app.command("show")
def ca_show(
    ctx: typer.Context,
    pem: Annotated[bool, typer.Option("--pem", help="Print the certificate (PEM) only.")] = False,
    output: OutputOpt = None,
) -> None:
    """Show the internal CA (--pem: its certificate, to distribute as a trust root)."""
    st = state_of(ctx)

    async def go(client: Any) -> Any:
        return await client.get_ca()

    ca = run_api(st, go)
    if pem:
        if not ca.get("cert_pem"):
            fail("the cluster has no internal CA", hint="Create it with `lattice admin ca init`.")
        print(ca["cert_pem"] + "".join(ca.get("previous_pem") or []), end="")
        return
    emit(st, st.output(output), ca, lambda: _ca_text(ca))


def _write(path: Path, data: str, mode: int) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
    with os.fdopen(fd, "w") as f:
        f.write(data)
    os.chmod(path, mode)


@ca_app.command("issue")
def ca_issue(
    ctx: typer.Context,
    kind: Annotated[str, typer.Option("--kind", help=f"One of: {', '.join(KINDS)}.")],
    name: Annotated[
        str, typer.Option("--name", help="The node id (bootstrap, agent) or component name.")
    ],
    out: Annotated[
        Path,
        typer.Option(
            "--out", help="Directory for NAME.crt, NAME.key (0600) and ca.crt.", file_okay=False
        ),
    ],
    lifetime: Annotated[
        float,
        typer.Option("--lifetime", help="Seconds; 0 = the kind's default (bootstrap: 3600)."),
    ] = 0.0,
    host: Annotated[
        list[str] | None,
        typer.Option("--host", help="Extra DNS name or IP address (servers); repeatable."),
    ] = None,
    output: OutputOpt = None,
) -> None:
    """Make a key here and have the internal CA sign its certificate."""
    from lattice_common import pki

    st = state_of(ctx)
    try:
        k = pki.Kind(kind)
    except ValueError:
        fail(f"unknown kind {kind!r}", hint=f"Use one of: {', '.join(KINDS)}.", code=2)
    key = pki.generate_key()
    try:
        site = run_api(st, lambda client: client.get_ca()).get("site", "")
        csr = pki.make_csr(key, k, name, site)
    except pki.CertError as e:
        fail(str(e), hint="A name has no dots; the site comes from the server.", code=2)

    async def go(client: Any) -> Any:
        return await client.issue_certificate(
            kind, name, csr.decode(), lifetime_seconds=lifetime, hosts=host or []
        )

    got = run_api(st, go)
    try:
        _write(out / f"{name}.key", pki.key_pem(key).decode(), 0o600)
        _write(out / f"{name}.crt", got["cert_pem"], 0o644)
        _write(out / "ca.crt", got["ca_pem"], 0o644)
    except OSError as e:
        fail(f"cannot write to {out}: {e.strerror or e}")
    view = {k2: v for k2, v in got.items() if k2 != "ca_pem"}
    view.update(key_file=str(out / f"{name}.key"), cert_file=str(out / f"{name}.crt"))
    emit(
        st,
        st.output(output),
        view,
        lambda: (
            f"Issued {kind} certificate for {name}: serial {got['serial']}, expires "
            f"{_expiry(got['not_after'])}\n  {out / f'{name}.crt'}\n  {out / f'{name}.key'} (0600)\n"
            f"  {out / 'ca.crt'} (the internal CA)"
        ),
    )
