"""A real S3-compatible HTTP server for tests: moto's server mode on a free loopback port.

The product code (``lattice_common.logstore.S3LogStore``) talks HTTP to it through
aiobotocore exactly as to a real S3 service; nothing is mocked in process. Fixture
``s3_server`` (plugin.py); ``MotoS3`` is the context manager behind it.
``MotoS3Process`` is the same server as a process of its own (``moto_server``), for tests
of an outage: ``stop()`` kills it (every connection drops, as when an S3 service goes
down) and ``start()`` brings it back on the same endpoint (empty: moto keeps nothing).
"""

from __future__ import annotations

import contextlib
import logging
from types import TracebackType
from typing import Any

__all__ = ["ACCESS_KEY_ID", "SECRET_ACCESS_KEY", "MotoS3", "MotoS3Process"]

# moto accepts any credentials; these are what the tests configure
ACCESS_KEY_ID = "lattice-test-key"
SECRET_ACCESS_KEY = "lattice-test-secret"


class MotoS3:
    """``moto.server.ThreadedMotoServer`` on 127.0.0.1 and a free port (a thread of the
    test process; subprocesses reach it over HTTP at ``endpoint``)."""

    def __init__(self) -> None:
        from moto.server import ThreadedMotoServer

        self._server: Any = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
        self.endpoint = ""

    def start(self) -> MotoS3:
        # werkzeug logs every request at INFO: keep test output readable
        logging.getLogger("werkzeug").setLevel(logging.WARNING)
        self._server.start()
        host, port = self._server.get_host_and_port()
        self.endpoint = f"http://{host}:{port}"
        return self

    def stop(self) -> None:
        with contextlib.suppress(Exception):
            self._server.stop()

    def env(self, bucket: str) -> dict[str, str]:
        """``LATTICE_STORAGE__*`` for processes that should use this server's ``bucket``
        as their log store."""
        return {
            "LATTICE_STORAGE__LOG_STORE": "s3",
            "LATTICE_STORAGE__S3_ENDPOINT": self.endpoint,
            "LATTICE_STORAGE__LOG_BUCKET": bucket,
            "LATTICE_STORAGE__S3_ACCESS_KEY_ID": ACCESS_KEY_ID,
            "LATTICE_STORAGE__S3_SECRET_ACCESS_KEY": SECRET_ACCESS_KEY,
        }

    def create_bucket(self, bucket: str) -> None:
        """Create ``bucket`` (synchronously, for fixtures)."""
        import asyncio

        from lattice_common.logstore import S3LogStore

        async def make() -> None:
            store = S3LogStore(
                bucket=bucket,
                endpoint_url=self.endpoint,
                access_key_id=ACCESS_KEY_ID,
                secret_access_key=SECRET_ACCESS_KEY,
            )
            try:
                await store.create_bucket()
            finally:
                await store.close()

        asyncio.run(make())

    def __enter__(self) -> MotoS3:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()


class MotoS3Process:
    """``moto_server`` as a subprocess on 127.0.0.1 and a port fixed at construction
    (free then), so a restart keeps ``endpoint``. ``with MotoS3Process() as s3:``."""

    def __init__(self, port: int = 0) -> None:
        from lattice_cli.devcluster import free_port

        port = port or free_port()
        self.port = port
        self.endpoint = f"http://127.0.0.1:{port}"
        self.proc: Any = None

    def start(self, timeout: float = 30.0) -> MotoS3Process:
        import shutil
        import socket
        import subprocess
        import sys
        import time

        binary = shutil.which("moto_server") or str(
            __import__("pathlib").Path(sys.executable).with_name("moto_server")
        )
        self.proc = subprocess.Popen(
            [binary, "-H", "127.0.0.1", "-p", str(self.port)],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"moto_server exited with {self.proc.returncode}")
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.5):
                    return self
            except OSError:
                time.sleep(0.05)
        self.stop()
        raise RuntimeError(f"moto_server did not listen on {self.endpoint} within {timeout} s")

    def stop(self) -> None:
        import subprocess

        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(10)
        self.proc = None

    def env(self, bucket: str) -> dict[str, str]:
        return MotoS3.env(self, bucket)  # type: ignore[arg-type]

    def create_bucket(self, bucket: str) -> None:
        MotoS3.create_bucket(self, bucket)  # type: ignore[arg-type]

    def __enter__(self) -> MotoS3Process:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
