"""``lattice admin backup create|verify|restore``: backups of the quorum state.

Where a backup goes or comes from:

* ``s3://bucket/key`` — the server writes or reads it (its ``storage`` S3 endpoint and
  credentials);
* ``server:/path`` — a path on the serving quorum member (a directory gets a
  ``backup-<UTC timestamp>.lattice`` file);
* any other path — a file on this machine: ``create`` has the server send the backup
  back and saves it here; ``verify`` and ``restore`` check it here, with the same
  verification the server runs (checksum, format version, Raft metadata, decoding);
* nothing — ``create``: the server's ``quorum.backup_dir``; ``verify``: the latest
  scheduled snapshot (``snap-latest.bin``).

A restore needs a restart into a fresh quorum (``lattice-server --recover-from FILE
--bootstrap`` on member 1): ``restore`` verifies the file and prints those steps.
"""

from __future__ import annotations

import datetime as dt
import sys
from pathlib import Path
from typing import Annotated, Any

import typer

from lattice_cli.context import OutputOpt, emit, fail, run_api, state_of

backup_app = typer.Typer(
    help="Back up the quorum state, verify a backup, restore one into a fresh quorum.",
    no_args_is_help=True,
)

SERVER = "server:"


def _progress(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def _where(target: str) -> tuple[str, str]:
    """("server", path-or-url) or ("local", path)."""
    if target.startswith("s3://"):
        return "server", target
    if target.startswith(SERVER):
        return "server", target[len(SERVER) :]
    return "local", target


def summary(info: dict[str, Any]) -> str:
    when = dt.datetime.fromtimestamp(float(info.get("created_at") or 0), dt.UTC)
    lines = [
        f"Path:        {info.get('path', '')}",
        f"Checksum:    {info.get('checksum', '')}",
        f"Size:        {info.get('size_bytes', 0)} bytes",
        f"Created:     {when.strftime('%Y-%m-%dT%H:%M:%SZ')} (site {info.get('site') or '-'}, "
        f"Lattice {info.get('lattice_version') or '-'}, format {info.get('format_version')})",
        f"Raft:        term {info.get('raft_term')}, index {info.get('raft_index')}, "
        f"members {', '.join(str(m) for m in info.get('members') or []) or '-'}",
        f"Revision:    {info.get('revision')}",
        f"Holds:       {info.get('allocations', 0)} allocations, {info.get('nodes', 0)} nodes, "
        f"{info.get('tenants', 0)} tenants, {info.get('vclusters', 0)} vClusters, "
        f"{info.get('audit_entries', 0)} audit entries",
    ]
    return "\n".join(lines)


def _verify_local(path: Path) -> dict[str, Any]:
    from lattice_common import backup

    try:
        data = path.read_bytes()
    except OSError as e:
        fail(f"cannot read {path}: {e.strerror or e}", code=2)
    try:
        report, _view = backup.verify(data)
    except backup.BackupError as e:
        fail(f"{path}: {e.message}", hint=e.hint)
    return {"path": str(path), **backup.report_dict(report)}


@backup_app.command("create")
def backup_create(
    ctx: typer.Context,
    to: Annotated[
        str | None,
        typer.Option(
            "--to",
            help="A local file (or directory) to save it here; server:/PATH on the quorum "
            "member; s3://BUCKET/KEY. Default: the server's quorum.backup_dir.",
        ),
    ] = None,
    output: OutputOpt = None,
) -> None:
    """Take a consistent snapshot of the quorum state (checksum and version included)."""
    st = state_of(ctx)
    kind, target = _where(to) if to else ("server", "")
    if kind == "server":
        if not st.quiet:
            _progress(f"Taking a backup on the server ({target or 'quorum.backup_dir'})...")

        async def remote(client: Any) -> Any:
            return await client.create_backup(target)

        info = run_api(st, remote, min_timeout=600)
    else:
        if not st.quiet:
            _progress("Taking a backup and downloading it...")

        async def fetch(client: Any) -> bytes:
            return await client.download_backup()

        data = run_api(st, fetch, min_timeout=600)
        path = Path(target)
        if path.is_dir() or target.endswith("/"):
            stamp = dt.datetime.now(dt.UTC).strftime("%Y%m%dT%H%M%SZ")
            path = path / f"backup-{stamp}.lattice"
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_name(f".{path.name}.tmp")
            tmp.write_bytes(data)
            tmp.replace(path)
        except OSError as e:
            fail(f"cannot write {path}: {e.strerror or e}")
        info = _verify_local(path)  # what arrived is what the server checksummed
    emit(st, st.output(output), info, lambda: "Backup written.\n" + summary(info))


@backup_app.command("verify")
def backup_verify(
    ctx: typer.Context,
    file: Annotated[
        str | None,
        typer.Argument(
            help="A local backup file, server:/PATH or s3://BUCKET/KEY.", metavar="[FILE]"
        ),
    ] = None,
    source: Annotated[
        str | None,
        typer.Option(
            "--source", help="Same as FILE (spec form: --source=s3://lattice-backup/raft/...)."
        ),
    ] = None,
    output: OutputOpt = None,
) -> None:
    """Check a backup (checksum, version, Raft metadata, decoding) and show what it holds.

    A damaged or newer file exits 1 with the reason."""
    st = state_of(ctx)
    if file and source:
        fail("give FILE or --source, not both", code=2)
    where = file or source or ""
    kind, target = _where(where) if where else ("server", "")
    fmt = st.output(output)
    if kind == "local":
        info = _verify_local(Path(target))
    else:

        async def remote(client: Any) -> Any:
            return await client.verify_backup(target)

        info = run_api(st, remote, min_timeout=600)
        if not info.get("valid"):
            if fmt in ("json", "yaml"):
                emit(st, fmt, info)
            fail(f"{info.get('path') or target}: {info.get('message')}", hint=info.get("hint", ""))
    emit(st, fmt, info, lambda: "OK: the backup is valid.\n" + summary(info))


@backup_app.command("restore")
def backup_restore(
    ctx: typer.Context,
    file: Annotated[
        str, typer.Argument(help="A local backup file, server:/PATH or s3://BUCKET/KEY.")
    ],
    force: Annotated[
        bool, typer.Option(help="Let lattice-server move an existing data dir aside.")
    ] = False,
    output: OutputOpt = None,
) -> None:
    """Verify a backup for a restore and print the restart steps.

    A restore replaces the whole state, so it runs into a fresh quorum at startup:
    `lattice-server --recover-from FILE --bootstrap` on member 1 (the file must be
    readable there: a path on that machine or s3://). A damaged or newer file is refused.
    """
    st = state_of(ctx)
    kind, target = _where(file)
    if kind == "local":
        info = _verify_local(Path(target))
        flag = " --force" if force else ""
        message = (
            "The backup is valid. Restoring requires a restart into a fresh quorum:\n"
            "  1. stop lattice-server on every quorum member;\n"
            "  2. move each member's quorum.data_dir aside (or pass --force below);\n"
            f"  3. copy {target} to member 1 and run there: lattice-server --config "
            f"CONFIG --recover-from {Path(target).name} --bootstrap{flag}\n"
            "  4. start the other members as usual (they join and receive the state);\n"
            "  5. check with `lattice admin raft status` and `lattice node list`."
        )
        out = {"info": info, "message": message}
    else:

        async def remote(client: Any) -> Any:
            return await client.restore_backup(target, force=force)

        out = run_api(st, remote, min_timeout=600)
    emit(st, st.output(output), out, lambda: summary(out["info"]) + "\n\n" + out["message"])
