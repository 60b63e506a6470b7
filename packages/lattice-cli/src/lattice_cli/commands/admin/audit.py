"""``lattice admin audit query|export|verify``: the tamper-evident audit log.

``query`` lists entries (who did what to what, oldest first) with filters; ``export``
writes the whole log to a file for archival; ``verify`` checks a file offline with the
public key (``--public-key PEM``, repeatable for rotated keys), or, with no file, the
cluster's log: with ``--public-key`` the CLI fetches the export and checks it here,
without one the server checks its committed chain. A bad log exits 1 naming the first
bad entry ("entry 17: hash does not match its contents (edited?)").
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Annotated, Any

import typer

from lattice_cli.context import OutputOpt, emit, fail, run_api, state_of, warn

audit_app = typer.Typer(
    help="Query, export and verify the tamper-evident audit log.", no_args_is_help=True
)

TimeOpt = Annotated[
    str | None, typer.Option(help="A time: 24h / 7d ago, 2026-03-01, ISO 8601, or epoch seconds.")
]


def parse_when(value: str | None, name: str, now: float | None = None) -> float | None:
    """``24h``/``30m``/``7d`` ago, an ISO 8601 date or time (UTC unless it says), or
    epoch seconds."""
    if value is None or not value.strip():
        return None
    text = value.strip()
    try:
        return float(text)
    except ValueError:
        pass
    import datetime as dt

    from lattice_common.duration import parse_duration
    from lattice_common.errors import ValidationError

    if text[-1:].lower() in ("s", "m", "h", "d") and text[:-1].isdigit():
        try:
            return (now if now is not None else time.time()) - parse_duration(text, field=name)
        except ValidationError as e:
            fail(e.message, hint=e.hint, code=2)
    try:
        when = dt.datetime.fromisoformat(text.replace("Z", "+00:00"))
    except ValueError:
        fail(
            f"--{name}: {text!r} is not a time",
            hint="Use 24h or 7d (ago), 2026-03-01, 2026-03-01T12:00:00Z or epoch seconds.",
            code=2,
        )
    if when.tzinfo is None:
        when = when.replace(tzinfo=dt.UTC)
    return when.timestamp()


def _details_text(details: dict[str, str]) -> str:
    return " ".join(f"{k}={v}" for k, v in sorted(details.items()))


def entries_table(entries: list[dict[str, Any]]) -> str:
    from lattice_cli import output as out

    rows = [
        [
            str(e.get("seq", "")),
            out.iso_utc(e.get("time")),
            str(e.get("actor", "")),
            str(e.get("action", "")),
            str(e.get("target", "")) or out.DASH,
            str(e.get("tenant", "")) or out.DASH,
            _details_text(e.get("details") or {}),
        ]
        for e in entries
    ]
    return out.render_table(["SEQ", "TIME", "ACTOR", "ACTION", "TARGET", "TENANT", "DETAILS"], rows)


@audit_app.command("query")
def audit_query(
    ctx: typer.Context,
    since: TimeOpt = None,
    until: TimeOpt = None,
    user: Annotated[str | None, typer.Option(help="Who acted.")] = None,
    action: Annotated[
        str | None, typer.Option(help='What, e.g. node.drain or "node." for every node action.')
    ] = None,
    tenant: Annotated[str | None, typer.Option(help="Entries of this tenant.")] = None,
    target: Annotated[
        str | None, typer.Option(help="What it was done to: node:ID or an id.")
    ] = None,
    limit: Annotated[int, typer.Option(help="At most this many entries.", min=1)] = 100,
    output: OutputOpt = None,
) -> None:
    """List audit entries, oldest first: who did what to what, when."""
    st = state_of(ctx)
    filters = {
        "since": parse_when(since, "since"),
        "until": parse_when(until, "until"),
        "user": user,
        "action": action,
        "tenant": tenant,
        "target": target,
    }

    async def go(client: Any) -> Any:
        got: list[dict[str, Any]] = []
        more = False
        async for entry in client.audit_entries(**filters, limit=min(limit, 1000)):
            if len(got) == limit:
                more = True
                break
            got.append(entry)
        return got, more

    entries, more = run_api(st, go)
    fmt = st.output(output)
    emit(st, fmt, entries, lambda: entries_table(entries) if entries else "No audit entries.")
    if more and fmt not in ("json", "yaml"):
        warn(f"more entries match: showing the first {limit} (--limit, --since or --until)")


@audit_app.command("export")
def audit_export(
    ctx: typer.Context,
    to: Annotated[Path, typer.Option("--to", help="File to write the export to.")],
) -> None:
    """Write the whole audit log to a file for archival.

    JSON lines, a signed header naming the public keys first; check the file later,
    anywhere, with `lattice admin audit verify FILE --public-key PEM`."""
    from lattice_common import audit

    st = state_of(ctx)

    async def go(client: Any) -> bytes:
        return await client.export_audit()

    data = run_api(st, go, min_timeout=300)
    try:
        header, _ = audit.read_export(data)
    except ValueError as e:
        fail(f"the server sent something that is not an audit export: {e}")
    try:
        to.write_bytes(data)
    except OSError as e:
        fail(f"cannot write {to}: {e.strerror or e}")
    if not st.quiet:
        keys = ", ".join(header.public_keys) or "none"
        print(
            f"Exported {header.count} entries to {to} (last hash {header.last_hash[:16]}; keys {keys})"
        )


def _read_keys(paths: list[Path]) -> list[Any]:
    from lattice_common import audit

    keys = []
    for p in paths:
        try:
            keys.append(audit.load_public_key(p.read_bytes()))
        except OSError as e:
            fail(f"cannot read public key {p}: {e.strerror or e}", code=2)
        except ValueError as e:
            fail(f"{p}: {e}", hint="Give the audit signing key's public key in PEM.", code=2)
    return keys


@audit_app.command("verify")
def audit_verify(
    ctx: typer.Context,
    file: Annotated[
        Path | None,
        typer.Argument(
            help="An export to check offline; none = the cluster's log.", metavar="[FILE]"
        ),
    ] = None,
    public_key: Annotated[
        list[Path] | None,
        typer.Option(
            "--public-key",
            help="Trusted public key (PEM); repeat for rotated keys. Without it a file is "
            "checked with the keys it names itself.",
        ),
    ] = None,
    output: OutputOpt = None,
) -> None:
    """Check hashes, links and signatures; exit 1 naming the first bad entry."""
    from lattice_common import audit

    st = state_of(ctx)
    keys = _read_keys(public_key or [])
    if file is None and not keys:  # the server checks its committed chain

        async def server(client: Any) -> Any:
            return await client.verify_audit()

        data = run_api(st, server)
        fmt = st.output(output)
        if not data.get("valid"):
            if fmt in ("json", "yaml"):
                emit(st, fmt, data)
            fail(
                str(data.get("message")), hint="The cluster's committed audit log does not verify."
            )
        emit(st, fmt, data, lambda: f"OK: {data.get('message')}")
        return

    if file is not None:
        try:
            raw = file.read_bytes()
        except OSError as e:
            fail(f"cannot read {file}: {e.strerror or e}", code=2)
        where = str(file)
    else:

        async def fetch(client: Any) -> bytes:
            return await client.export_audit()

        raw = run_api(st, fetch, min_timeout=300)
        where = "the cluster's audit log"
    result = audit.verify_export(raw, keys or None)
    fmt = st.output(output)
    data = {
        "valid": result.ok,
        "count": result.count,
        "first_bad": result.first_bad,
        "message": result.message,
        "last_hash": result.last_hash,
        "key_ids": list(result.key_ids),
    }
    if not result.ok:
        if fmt in ("json", "yaml"):
            emit(st, fmt, data)
        fail(
            result.message,
            hint=f"{where} was changed after it was signed, or is not signed by these keys.",
        )
    emit(
        st,
        fmt,
        data,
        lambda: f"OK: {where}: {result.message} (keys {', '.join(result.key_ids) or 'none'})",
    )
    if not keys and fmt not in ("json", "yaml"):
        warn(
            "checked with the public keys the file names itself: this proves it is intact, "
            "not who signed it; pass --public-key with the cluster's audit public key"
        )
