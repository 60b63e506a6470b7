"""A real S3-compatible HTTP server for tests: moto's server mode on a free loopback port.

The product code (``lattice_common.logstore.S3LogStore``) talks HTTP to it through
aiobotocore exactly as to a real S3 service; nothing is mocked in process. Fixture
``s3_server`` (plugin.py); ``MotoS3`` is the context manager behind it.
"""

from __future__ import annotations

import contextlib
import logging
from types import TracebackType
from typing import Any

__all__ = ["ACCESS_KEY_ID", "SECRET_ACCESS_KEY", "MotoS3"]

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
