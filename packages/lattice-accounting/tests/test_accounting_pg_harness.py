"""The throwaway PostgreSQL of lattice_test_harness: it serves, runs unprivileged, and
leaves nothing behind."""

from __future__ import annotations

import os
from pathlib import Path

import asyncpg
import pytest
from lattice_test_harness.postgres import PostgresServer, available

pytestmark = pytest.mark.skipif(not available(), reason="PostgreSQL binaries not installed")


async def test_server_serves_and_is_gone_after_stop() -> None:
    with PostgresServer(database="harness") as pg:
        conn = await asyncpg.connect(pg.dsn)
        try:
            assert await conn.fetchval("SELECT current_database()") == "harness"
        finally:
            await conn.close()
        pid = int((pg.data_dir / "postmaster.pid").read_text().split()[0])
        owner = Path(f"/proc/{pid}").stat().st_uid
        if os.geteuid() == 0:
            assert owner != 0  # postgres refuses root: it runs as an unprivileged account
        base = pg.base
    assert not base.exists()
    status = Path(f"/proc/{pid}/status")
    assert not status.exists() or "State:\tZ" in status.read_text()


def test_a_failed_start_cleans_up() -> None:
    pg = PostgresServer()
    pg.port = 1  # a privileged port the unprivileged server cannot bind
    with pytest.raises(RuntimeError):
        pg.start(timeout=20)
    assert not pg.base.exists()
