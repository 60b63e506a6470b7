"""pytest plugin: fixtures that start real Lattice clusters and builders for test data.

``lattice_cluster`` (module scope) is a 1-member cluster with 2 agents and fast
heartbeats; ``cluster_factory`` builds custom ones (3 members, N agents, timeouts)
and tears every one down at the end of the test.
"""

from __future__ import annotations

from collections.abc import Iterator
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
}


def make_cluster(base: Path, **kw: Any) -> ClusterHandle:
    opts = {**FAST, **kw}
    c = LocalCluster(base, **opts)
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
