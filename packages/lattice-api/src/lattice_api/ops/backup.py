"""Backups of the quorum state (AdminService.CreateBackup, VerifyBackup, RestoreBackup;
``POST /api/v1/admin/backup``, ``GET /api/v1/admin/backup/verify``,
``POST /api/v1/admin/restore``) and the leader's scheduled snapshots.

The file format is lattice_common.backup's; the snapshot at one applied index and the
typed decoding are lattice_quorum.backup's. Here: where files go and come from.

Locations (:func:`parse_location`): a path on the serving member, or ``s3://bucket/key``
(endpoint and credentials of the ``storage`` section, as for the log store). A path
that is a directory or ends with ``/`` gets a file named ``backup-<UTC timestamp>.lattice``
(``create``); an empty one means ``quorum.backup_dir`` (default /var/lib/lattice/backups).

Restore (spec: "requires restart"): a backup is restored into a *fresh* quorum only, by
``lattice-server --recover-from FILE --bootstrap`` on member 1 (lattice_api.main, which
verifies the file and proposes ``RestoreBackup`` before it serves anything). The
``restore`` operation here verifies the file where the server can read it, refuses a
damaged or newer one, and answers the exact restart steps; it never touches the running
state.

Scheduled snapshots (:class:`BackupScheduler`): every ``backup.schedule_interval_seconds``
the leader writes ``snap-<UTC timestamp>.bin`` and ``snap-latest.bin`` to
``backup.destination`` (a directory or s3://bucket/prefix; default quorum.backup_dir) and
deletes the oldest ``snap-*.bin`` beyond ``backup.retention_count`` (default
quorum.snapshot_retention_count, 5). Failures are logged and counted
(``lattice_backup_failures_total``), never raised into the quorum.

Permissions: system administrators only (``backup.admin``); ``backup.create`` and
``backup.restore`` are audited.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import logging
import os
import re
import time
from pathlib import Path
from typing import Any, Literal

import msgspec
from lattice_common import backup as fmt
from lattice_common.backup import BackupError
from lattice_common.config import BackupConfig, LatticeConfig, StorageConfig
from lattice_common.errors import FailedPrecondition, NotFound, Unavailable, ValidationError
from lattice_common.logstore import LogStoreError, S3LogStore
from lattice_quorum import backup
from lattice_quorum.quorum import Quorum
from prometheus_client import Counter, Gauge, Histogram

from lattice_api.audit import AuditRecorder
from lattice_api.auth import Identity

log = logging.getLogger("lattice.api.backup")

__all__ = [
    "BackupOps",
    "BackupScheduler",
    "Location",
    "Recovery",
    "backup_name",
    "parse_location",
    "prepare_recovery",
    "restore_into",
    "snapshots_to_prune",
]

BACKUP_CREATE = "backup.create"
BACKUP_RESTORE = "backup.restore"

LAST_SUCCESS = Gauge(
    "lattice_backup_last_success_timestamp_seconds",
    "When the last scheduled snapshot was written (Unix time)",
)
FAILURES = Counter("lattice_backup_failures_total", "Scheduled snapshots that failed")
PAUSE = Histogram(
    "lattice_backup_snapshot_pause_seconds",
    "Time the apply lock was held to take a snapshot (commits wait that long)",
    buckets=(0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5),
)

SNAP_LATEST = "snap-latest.bin"
_SNAP = re.compile(r"^snap-\d{8}T\d{6}(\d{6})?Z\.bin$")


# --- pure parts ---------------------------------------------------------------------


class Location(msgspec.Struct, frozen=True):
    kind: Literal["fs", "s3"]
    path: str  # fs: the path; s3: the key (may be "" or end with "/")
    bucket: str = ""

    def __str__(self) -> str:
        return f"s3://{self.bucket}/{self.path}" if self.kind == "s3" else self.path

    def join(self, name: str) -> Location:
        if self.kind == "s3":
            key = f"{self.path.rstrip('/')}/{name}" if self.path.strip("/") else name
            return Location("s3", key, self.bucket)
        return Location("fs", os.path.join(self.path, name))


def parse_location(text: str) -> Location:
    """``s3://bucket/key`` or a filesystem path (ValidationError for an s3 URL without
    a bucket)."""
    if text.startswith("s3://"):
        bucket, _, key = text[5:].partition("/")
        if not bucket:
            raise ValidationError(
                f"no bucket in {text!r}", hint="Write s3://BUCKET/KEY (or s3://BUCKET/PREFIX/)."
            )
        return Location("s3", key, bucket)
    if not text:
        raise ValidationError("empty backup path")
    return Location("fs", text)


def _stamp(now: float) -> str:
    return dt.datetime.fromtimestamp(now, dt.UTC).strftime("%Y%m%dT%H%M%SZ")


def backup_name(now: float) -> str:
    """``backup-20260305T120000Z.lattice``: the name ``create`` gives in a directory."""
    return f"backup-{_stamp(now)}.lattice"


def snapshot_name(now: float) -> str:
    """``snap-20260305T120000Z.bin`` (spec: ``s3://lattice-backup/raft/snap-{timestamp}.bin``)."""
    return f"snap-{_stamp(now)}.bin"


def snapshots_to_prune(names: list[str], keep: int) -> list[str]:
    """The ``snap-<timestamp>.bin`` names beyond the newest ``keep`` (timestamps sort
    as text); other names (``snap-latest.bin``, anything else) are never pruned."""
    snaps = sorted(n for n in names if _SNAP.match(n))
    return snaps[: max(0, len(snaps) - keep)]


# --- where files live ------------------------------------------------------------------


class Storage:
    """Read, write, list and delete backup files at locations (fs or S3)."""

    def __init__(self, storage: StorageConfig | None = None) -> None:
        self.cfg = storage or StorageConfig()
        self._s3: dict[str, S3LogStore] = {}

    def _store(self, bucket: str) -> S3LogStore:
        if bucket not in self._s3:
            key_id, secret = self.cfg.s3_access_key_id, self.cfg.s3_secret_access_key
            self._s3[bucket] = S3LogStore(
                bucket=bucket,
                endpoint_url=self.cfg.s3_endpoint,
                region=self.cfg.s3_region,
                access_key_id=key_id.get_secret_value() if key_id else None,
                secret_access_key=secret.get_secret_value() if secret else None,
                read_timeout=300.0,
            )
        return self._s3[bucket]

    async def write(self, loc: Location, data: bytes) -> None:
        if loc.kind == "s3":
            await self._wrap(self._store(loc.bucket).put(loc.path, data))
            return
        await asyncio.to_thread(_write_file, Path(loc.path), data)

    async def read(self, loc: Location) -> bytes:
        if loc.kind == "s3":
            got = await self._wrap(self._store(loc.bucket).get(loc.path))
            if got is None:
                raise NotFound(f"no backup at {loc}", hint="List the bucket to find the key.")
            return got
        try:
            return await asyncio.to_thread(Path(loc.path).read_bytes)
        except FileNotFoundError:
            raise NotFound(
                f"no backup file {loc} on this server",
                hint="The path is read on the serving member; give a path there, an "
                "s3:// URL, or a local file to the CLI (it verifies local files itself).",
            ) from None
        except IsADirectoryError:
            raise ValidationError(f"{loc} is a directory, not a backup file") from None

    async def list(self, loc: Location) -> list[str]:
        """Names directly inside a directory or prefix."""
        if loc.kind == "s3":
            prefix = loc.path.rstrip("/") + "/" if loc.path.strip("/") else ""
            keys = await self._wrap(self._store(loc.bucket).list(prefix))
            return [k[len(prefix) :] for k in keys if "/" not in k[len(prefix) :]]
        p = Path(loc.path)
        return sorted(x.name for x in p.iterdir() if x.is_file()) if p.is_dir() else []

    async def delete(self, loc: Location) -> None:
        if loc.kind == "s3":
            store = self._store(loc.bucket)
            # S3LogStore has no delete (logs are never deleted by Lattice): its client does
            client = await store._s3()
            await self._wrap(client.delete_object(Bucket=loc.bucket, Key=loc.path))
            return
        with contextlib.suppress(FileNotFoundError):
            os.unlink(loc.path)

    async def is_dir(self, loc: Location) -> bool:
        return loc.kind == "fs" and await asyncio.to_thread(os.path.isdir, loc.path)

    async def _wrap(self, aw: Any) -> Any:
        try:
            return await aw
        except LogStoreError as e:
            raise Unavailable(
                str(e).replace("log store ", "backup storage ", 1),
                hint="Check storage.s3_endpoint and the S3 credentials of the storage section.",
            ) from None
        except Exception as e:
            if type(e).__module__.startswith(("botocore", "aiobotocore")):
                raise Unavailable(f"backup storage: {e}") from None
            raise

    async def close(self) -> None:
        for store in self._s3.values():
            await store.close()
        self._s3.clear()


def _write_file(path: Path, data: bytes) -> None:
    """Written whole or not at all: a temporary file renamed into place, synced."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


# --- operations --------------------------------------------------------------------------


def _info(loc: Location, report: fmt.VerifyReport) -> dict[str, Any]:
    return {"path": str(loc), **fmt.report_dict(report)}


class BackupOps:
    def __init__(
        self,
        quorum: Quorum,
        *,
        audit: AuditRecorder | None = None,
        config: BackupConfig | None = None,
        storage: StorageConfig | None = None,
        data_dir: str = "",
        backup_dir: str = "",
        retention_count: int = 5,
        site: str = "",
        config_path: str = "",
    ) -> None:
        """``backup_dir``: quorum.backup_dir ("" = ``<data_dir>/backups``);
        ``retention_count``: quorum.snapshot_retention_count, unless the backup section
        sets its own."""
        self.quorum = quorum
        self.audit = audit
        self.cfg = config or BackupConfig()
        self.storage = Storage(storage)
        self.data_dir = data_dir or "."
        self.backup_dir = backup_dir or os.path.join(self.data_dir, "backups")
        self.retention_count = self.cfg.retention_count or retention_count
        self.site = site
        self.config_path = config_path  # named in the restore steps

    @property
    def directory(self) -> Location:
        """Where ``create`` writes without a path (quorum.backup_dir)."""
        return parse_location(self.backup_dir)

    @property
    def destination(self) -> Location:
        """Where scheduled snapshots go (backup.destination, else quorum.backup_dir)."""
        return parse_location(self.cfg.destination or self.backup_dir)

    async def snapshot(self) -> tuple[bytes, fmt.VerifyReport]:
        """A backup file of the state now, and its report (leader or caught-up member)."""
        self.quorum.require_caught_up()
        t0 = time.perf_counter()
        snap = backup.take(self.quorum)
        PAUSE.observe(time.perf_counter() - t0)
        data = await asyncio.to_thread(backup.build, snap, site=self.site, created_at=time.time())
        header, _ = fmt.read_header(data)
        report = fmt.VerifyReport(
            header=header, checksum=fmt.checksum(data), size_bytes=len(data), counts=snap.counts
        )
        return data, report

    async def create(self, who: Identity, to: str = "") -> dict[str, Any]:
        """Write a backup to ``to`` (a path or directory on this member, or s3://...;
        empty = ``quorum.backup_dir``) and describe it."""
        data, report = await self.snapshot()
        loc = parse_location(to) if to else self.directory
        if (loc.kind == "s3" and (not loc.path or loc.path.endswith("/"))) or (
            loc.kind == "fs" and (not to or to.endswith("/") or await self.storage.is_dir(loc))
        ):
            loc = loc.join(backup_name(report.header.created_at))
        await self.storage.write(loc, data)
        info = _info(loc, report)
        self._audit(who, BACKUP_CREATE, loc, report)
        log.info("backup written to %s (%s, revision %s)", loc, info["checksum"], info["revision"])
        return info

    async def download(self, who: Identity) -> tuple[bytes, dict[str, Any]]:
        """A backup streamed back to the caller (``lattice admin backup create --to
        ./file``): nothing is written on the server."""
        data, report = await self.snapshot()
        info = _info(Location("fs", "-"), report)
        self._audit(who, BACKUP_CREATE, Location("fs", "(downloaded)"), report)
        return data, info

    async def load(self, path: str = "") -> tuple[Location, bytes]:
        loc = parse_location(path) if path else self.destination.join(SNAP_LATEST)
        return loc, await self.storage.read(loc)

    async def verify(self, who: Identity, path: str = "") -> dict[str, Any]:
        """Check a backup (empty path: the latest scheduled snapshot). A damaged or
        newer file answers ``valid: false`` with the reason and a hint."""
        loc, data = await self.load(path)
        try:
            report, _state = await asyncio.to_thread(backup.verify, data)
        except BackupError as e:
            return {"path": str(loc), "valid": False, "message": e.message, "hint": e.hint}
        return _info(loc, report)

    async def restore(self, who: Identity, path: str, *, force: bool = False) -> dict[str, Any]:
        """Verify ``path`` for a restore and answer the restart steps (the restore itself
        is ``lattice-server --recover-from``, into a fresh quorum)."""
        if not path:
            raise ValidationError("a backup path is required", hint="Give a path or s3:// URL.")
        loc, data = await self.load(path)
        report, _state = await asyncio.to_thread(backup.verify, data)  # BackupError: refused
        self._audit(who, BACKUP_RESTORE, loc, report)
        return {"info": _info(loc, report), "message": self.restore_steps(str(loc), force)}

    def restore_steps(self, path: str, force: bool) -> str:
        config = f"--config {self.config_path} " if self.config_path else ""
        keep = (
            "(--force moves an existing data dir aside instead of refusing)"
            if force
            else "(or add --force to move it aside)"
        )
        return (
            "The backup is valid. Restoring requires a restart into a fresh quorum:\n"
            "  1. stop lattice-server on every quorum member;\n"
            f"  2. move each member's quorum.data_dir ({self.data_dir}) aside {keep};\n"
            f"  3. on member 1: lattice-server {config}--recover-from {path} --bootstrap\n"
            "  4. start the other members as usual (they join and receive the state);\n"
            "  5. check with `lattice admin raft status` and `lattice node list`; agents "
            "reconnect by themselves."
        )

    def _audit(self, who: Identity, action: str, loc: Location, report: fmt.VerifyReport) -> None:
        if self.audit is None:
            return
        details = {
            "path": str(loc),
            "checksum": report.checksum,
            "revision": str(report.header.revision),
        }
        self.audit.record(who.user, action, f"backup:{loc}", details=details)

    # --- scheduled snapshots -------------------------------------------------------------

    async def scheduled_snapshot(self, now: float | None = None) -> Location:
        """One scheduled snapshot: snap-<ts>.bin, then snap-latest.bin, then pruning."""
        data, _report = await self.snapshot()
        dest = self.destination
        loc = dest.join(snapshot_name(time.time() if now is None else now))
        await self.storage.write(loc, data)  # confirmed written before anything is deleted
        await self.storage.write(dest.join(SNAP_LATEST), data)
        for name in snapshots_to_prune(await self.storage.list(dest), self.retention_count):
            await self.storage.delete(dest.join(name))
        return loc


class BackupScheduler:
    """The leader's snapshot loop (``backup.schedule_interval_seconds``; 0 = off)."""

    def __init__(self, ops: BackupOps) -> None:
        self.ops = ops
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        if self.ops.cfg.schedule_interval_seconds > 0 and self._task is None:
            self._task = asyncio.create_task(self._run(), name="backup-scheduler")

    async def _run(self) -> None:
        interval = self.ops.cfg.schedule_interval_seconds
        while True:
            await asyncio.sleep(interval)
            if not self.ops.quorum.is_leader:
                continue
            try:
                loc = await self.ops.scheduled_snapshot()
            except asyncio.CancelledError:
                raise
            except Exception as e:  # logged and counted; the quorum never waits on it
                FAILURES.inc()
                log.error("scheduled snapshot to %s failed: %s", self.ops.destination, e)
                continue
            LAST_SUCCESS.set(time.time())
            log.info("scheduled snapshot written to %s", loc)

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        await self.ops.storage.close()


# --- lattice-server --recover-from FILE --bootstrap --------------------------------------


class Recovery(msgspec.Struct, kw_only=True):
    source: str
    data: bytes
    report: fmt.VerifyReport


async def prepare_recovery(
    cfg: LatticeConfig, source: str, bootstrap: bool, force: bool
) -> Recovery:
    """Before the member starts: the backup read (path or s3://) and verified, the data
    dir checked (refused when it holds Raft state, moved aside with ``force``)."""
    if not bootstrap:
        raise ValidationError(
            "--recover-from needs --bootstrap",
            hint="A backup is restored into a new quorum: run member 1 with "
            "`--recover-from FILE --bootstrap`; the other members start as usual.",
        )
    storage = Storage(cfg.storage)
    try:
        data = await storage.read(parse_location(source))
    finally:
        await storage.close()
    report, _state = await asyncio.to_thread(backup.verify, data)  # BackupError: refused
    data_dir = Path(cfg.quorum.data_dir)
    held = [p.name for p in _raft_files(data_dir)]
    if held and not force:
        raise ValidationError(
            f"quorum.data_dir {data_dir} already holds Raft state ({', '.join(held)})",
            hint="A backup is restored into a fresh quorum: stop every member and move "
            "their data dirs aside, or pass --force to move this one aside.",
        )
    if held:
        aside = data_dir.with_name(f"{data_dir.name}.pre-restore-{_stamp(time.time())}")
        os.replace(data_dir, aside)
        log.warning("moved the existing quorum.data_dir %s aside to %s", data_dir, aside)
    h = report.header
    log.info(
        "restoring %s: revision %s, Raft term %s index %s, taken %s on %r, %s",
        source,
        h.revision,
        h.raft.term,
        h.raft.index,
        dt.datetime.fromtimestamp(h.created_at, dt.UTC).isoformat(),
        h.site,
        report.counts,
    )
    return Recovery(source=source, data=data, report=report)


def _raft_files(data_dir: Path) -> list[Path]:
    names = ("cluster.json", "raft.journal", "raft.dump")
    return [data_dir / n for n in names if (data_dir / n).exists()]


def _restored(state: Any, recovery: Recovery) -> bool:
    h = recovery.report.header
    return state.revision >= h.revision and len(state.allocations) == h.counts["allocations"]


async def restore_into(quorum: Quorum, recovery: Recovery, *, wait_log: float = 10.0) -> None:
    """Propose the backup once the new quorum has a leader (the other members must be
    started for a majority); retried until committed. Only a fresh state accepts it."""
    from lattice_common import commands as c
    from lattice_common.errors import LatticeError

    from lattice_api.ops.base import raise_if_error

    waited = time.monotonic()
    while True:
        if quorum.caught_up:
            try:
                raise_if_error(
                    await quorum.propose(c.RestoreBackup(data=recovery.data, now=time.time()))
                )
                break
            except LatticeError as e:
                if isinstance(e, FailedPrecondition) and quorum.read(_restored, recovery):
                    break  # committed, but the answer was lost (a retry finds it applied)
                if not isinstance(e, Unavailable):
                    raise
                log.warning("restore not committed yet (%s); retrying", e.message)
        if time.monotonic() - waited > wait_log:
            log.warning(
                "waiting for a quorum majority to restore %s (start the other members)",
                recovery.source,
            )
            waited = time.monotonic()
        await asyncio.sleep(0.2)
    log.info("restored %s: the quorum is at revision %s", recovery.source, quorum.revision)
