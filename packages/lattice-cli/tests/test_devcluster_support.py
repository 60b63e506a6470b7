"""What keeps a dev cluster's start reliable and its failures explained: ports that no
other process takes first, and timeout errors that carry why (CI keeps no log
directory, so the error itself holds the tails of processes that died and the last
warnings of the others)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from lattice_cli import devcluster
from lattice_cli.devcluster import ClusterError, LocalCluster, free_port, port_free


def _line(level: str, msg: str) -> str:
    return json.dumps({"level": level, "component": "lattice-server", "msg": msg}) + "\n"


def test_a_timeout_names_the_dead_process_and_the_warnings_of_the_live_ones(
    tmp_path: Path,
) -> None:
    c = LocalCluster(tmp_path, members=1, agents=1, tsdb=False, checkpoint_broker=False)
    (c.base / "logs").mkdir(parents=True, exist_ok=True)
    member, agent = c.members[0], c.agents[0]
    c.log_path("member-1").write_text(
        _line("info", "up")
        + "".join(_line("warning", f"registration refused {i}") for i in range(6))
        + _line("info", "still up")
    )
    c.log_path(f"agent-{agent.node_id}").write_text("Traceback (most recent call last):\nboom\n")
    agent.proc = subprocess.Popen([sys.executable, "-c", "raise SystemExit(3)"])
    agent.proc.wait()
    member.proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        with pytest.raises(ClusterError) as e:
            c.wait_for_nodes(1, timeout=0.3)
        text = str(e.value)
        assert "1 agents did not register within 0s (nodes: none)" in text
        assert f"--- agent-{agent.node_id} exited with 3:" in text and "boom" in text
        # the last four warnings of the live member, not the info lines
        assert "registration refused 5" in text and "registration refused 2" in text
        assert "registration refused 1" not in text and "still up" not in text
    finally:
        member.proc.kill()
        member.proc.wait()


def test_ports_are_never_handed_out_twice_nor_from_the_ephemeral_range(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    lo, hi = devcluster._ephemeral_range()
    ports = [free_port() for _ in range(300)]
    assert len(set(ports)) == len(ports)
    assert all(not lo <= p <= hi for p in ports)
    assert all(port_free(p) for p in ports[:20])
    # two pytest-xdist workers draw from slices of their own
    drawn = {}
    for worker in ("gw0", "gw1"):
        monkeypatch.setenv("PYTEST_XDIST_WORKER", worker)
        monkeypatch.setenv("PYTEST_XDIST_WORKER_COUNT", "2")
        drawn[worker] = [free_port() for _ in range(100)]
    assert max(drawn["gw0"]) < min(drawn["gw1"])


def test_the_checkpoint_root_is_made_only_when_it_is_a_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A dev cluster makes its checkpoint directory (the broker probes it), but an
    ``s3://`` root is a bucket: nothing named ``s3:`` appears where it was started."""
    started_in = tmp_path / "cwd"
    started_in.mkdir()
    monkeypatch.chdir(started_in)
    LocalCluster(
        tmp_path / "a",
        members=1,
        agents=1,
        tsdb=False,
        env={"LATTICE_CHECKPOINT__CHECKPOINT_ROOT": "s3://bucket/prefix"},
    )
    assert list(started_in.iterdir()) == []
    LocalCluster(tmp_path / "b", members=1, agents=1, tsdb=False)
    assert (tmp_path / "b" / "checkpoints").is_dir()
    shared = tmp_path / "shared" / "ckpt"
    LocalCluster(
        tmp_path / "c",
        members=1,
        agents=1,
        tsdb=False,
        env={"LATTICE_CHECKPOINT__CHECKPOINT_ROOT": str(shared)},
    )
    assert shared.is_dir()
