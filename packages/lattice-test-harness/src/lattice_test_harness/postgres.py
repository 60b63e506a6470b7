"""A throwaway PostgreSQL cluster (Debian's ``postgresql``) for tests and benchmarks.

``initdb`` in a temp dir, ``pg_ctl start`` on a free loopback port with the unix socket
in the same temp dir, trust authentication, one database created. PostgreSQL refuses to
run as root, so when the caller is root the data dir is chown'd to an unprivileged
account (``postgres`` when it exists, else ``nobody``) and the binaries run as that user.
:meth:`PostgresServer.stop` always stops the server (``pg_ctl stop -m immediate`` then,
if needed, SIGKILL to its process group) and removes the temp dir.

    with PostgresServer() as pg:
        pg.url          # postgresql+asyncpg://postgres@127.0.0.1:PORT/lattice
        pg.dsn          # postgresql://postgres@127.0.0.1:PORT/lattice (plain libpq form)
"""

from __future__ import annotations

import contextlib
import os
import pwd
import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path

from lattice_cli.devcluster import free_port as _free_port

__all__ = ["PostgresServer", "available", "pg_bin_dir"]

_SEARCH = (
    "/usr/local/bin",
    *sorted(map(str, Path("/usr/lib/postgresql").glob("*/bin")), reverse=True),
)


def pg_bin_dir() -> Path | None:
    """The directory holding ``initdb`` and ``pg_ctl``: PATH first, then Debian's
    versioned ``/usr/lib/postgresql/<major>/bin`` (not on PATH by default)."""
    found = shutil.which("initdb")
    if found and shutil.which("pg_ctl"):
        return Path(found).resolve().parent
    for d in _SEARCH:
        p = Path(d)
        if (p / "initdb").exists() and (p / "pg_ctl").exists():
            return p
    return None


def available() -> bool:
    return pg_bin_dir() is not None


def _run_as_user() -> pwd.struct_passwd | None:
    """The unprivileged account to run the server as when we are root."""
    if os.geteuid() != 0:
        return None
    for name in ("postgres", "nobody"):
        with contextlib.suppress(KeyError):
            return pwd.getpwnam(name)
    raise RuntimeError("running as root and neither a 'postgres' nor a 'nobody' account exists")


class PostgresServer:
    """One PostgreSQL cluster in a temp dir; ``start()``/``stop()`` or a with-block."""

    def __init__(
        self, database: str = "lattice", port: int = 0, base_dir: str | Path | None = None
    ) -> None:
        bindir = pg_bin_dir()
        if bindir is None:
            raise RuntimeError("PostgreSQL binaries (initdb, pg_ctl) not found")
        self.bindir = bindir
        self.database = database
        self.port = port or _free_port()
        self._own_dir = base_dir is None
        self.base = Path(base_dir or tempfile.mkdtemp(prefix="lattice-pg-"))
        self.data_dir = self.base / "data"
        self.socket_dir = self.base / "sock"
        self.log_path = self.base / "postgres.log"
        self.user = "postgres"  # the superuser initdb creates (-U), whatever the OS account
        self._account = _run_as_user()
        self._started = False

    # --- addresses -----------------------------------------------------------------------

    @property
    def dsn(self) -> str:
        return f"postgresql://{self.user}@127.0.0.1:{self.port}/{self.database}"

    @property
    def url(self) -> str:
        """SQLAlchemy async URL (asyncpg)."""
        return f"postgresql+asyncpg://{self.user}@127.0.0.1:{self.port}/{self.database}"

    def database_url(self, database: str) -> str:
        return f"postgresql+asyncpg://{self.user}@127.0.0.1:{self.port}/{database}"

    # --- lifecycle -----------------------------------------------------------------------

    def _cmd(self, name: str, *args: str, check: bool = True, timeout: float = 60.0) -> str:
        env = {**os.environ, "LC_ALL": "C", "PGTZ": "UTC"}
        preexec = None
        if self._account is not None:
            uid, gid = self._account.pw_uid, self._account.pw_gid

            def preexec() -> None:
                os.setgid(gid)
                os.setuid(uid)

            env["HOME"] = str(self.base)
        proc = subprocess.run(
            [str(self.bindir / name), *args],
            env=env,
            cwd=self.base,
            preexec_fn=preexec,
            capture_output=True,
            text=True,
            timeout=timeout,
        )
        if check and proc.returncode != 0:
            log = (
                self.log_path.read_text(errors="replace")[-2000:] if self.log_path.exists() else ""
            )
            raise RuntimeError(
                f"{name} {' '.join(args)} failed ({proc.returncode}): "
                f"{proc.stderr.strip()[-2000:]}\n{log}"
            )
        return proc.stdout

    def start(self, timeout: float = 60.0) -> PostgresServer:
        self.base.mkdir(parents=True, exist_ok=True)
        self.socket_dir.mkdir(exist_ok=True)
        if self._account is not None:
            for p in (self.base, self.socket_dir):
                os.chown(p, self._account.pw_uid, self._account.pw_gid)
            self.base.chmod(0o700)
        try:
            self._cmd(
                "initdb",
                "-D",
                str(self.data_dir),
                "-U",
                self.user,
                "--auth=trust",
                "--encoding=UTF8",
                "--no-sync",
            )
            opts = (
                f"-p {self.port} -c listen_addresses=127.0.0.1 "
                f"-c unix_socket_directories={self.socket_dir} "
                "-c fsync=off -c synchronous_commit=off -c full_page_writes=off "
                "-c max_connections=200 -c shared_buffers=128MB"
            )
            self._started = True
            self._cmd(
                "pg_ctl",
                "-D",
                str(self.data_dir),
                "-l",
                str(self.log_path),
                "-o",
                opts,
                "-w",
                "-t",
                str(int(timeout)),
                "start",
                timeout=timeout + 10,
            )
            self._create_database(self.database)
        except BaseException:
            self.stop()
            raise
        return self

    def _create_database(self, name: str) -> None:
        psql = self.bindir / "psql"
        if not psql.exists():
            raise RuntimeError(f"psql not found next to {self.bindir / 'initdb'}")
        self._cmd(
            "psql",
            "-h",
            str(self.socket_dir),
            "-p",
            str(self.port),
            "-U",
            self.user,
            "-d",
            "postgres",
            "-v",
            "ON_ERROR_STOP=1",
            "-c",
            f'CREATE DATABASE "{name}"',
        )

    def create_database(self, name: str) -> str:
        """A further empty database on the same server; returns its async URL."""
        self._create_database(name)
        return self.database_url(name)

    def _postmaster_pid(self) -> int | None:
        try:
            return int((self.data_dir / "postmaster.pid").read_text().split()[0])
        except (OSError, ValueError, IndexError):
            return None

    def stop(self) -> None:
        if self._started:
            self._started = False
            pid = self._postmaster_pid()
            try:
                self._cmd(
                    "pg_ctl", "-D", str(self.data_dir), "-m", "immediate", "-w", "stop",
                    check=False, timeout=30,
                )  # fmt: skip
            except subprocess.TimeoutExpired:
                pass
            if pid is not None and _alive(pid):
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(pid, signal.SIGKILL)
                deadline = time.monotonic() + 10
                while _alive(pid) and time.monotonic() < deadline:
                    time.sleep(0.05)
        if self._own_dir:
            shutil.rmtree(self.base, ignore_errors=True)

    def __enter__(self) -> PostgresServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # a zombie child of ours counts as gone
    with contextlib.suppress(OSError):
        stat = Path(f"/proc/{pid}/stat").read_text()
        return stat.rsplit(")", 1)[1].split()[0] != "Z"
    return True
