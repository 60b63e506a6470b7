"""Scale-down checkpoints the nodes being released first, end to end on a dev cluster:
lattice-server, a scheduler, 3 real agents, a real VictoriaMetrics, and a reactive
allocation submitted with ``lattice submit --lifecycle reactive --checkpoint signal``.

The job is a small shell application of the signal protocol: on SIGUSR1 it reads
``$LATTICE_RELEASING_FILE`` (the nodes about to go), takes 3 seconds to write its
state into ``$LATTICE_CHECKPOINT_DIR`` and then creates the sentinel. The load is
pushed into the TSDB as in ``test_autoscaling_cluster.py``.

Shown: busy, it grows 2 -> 3; idle, the scale-down first asks the application to
checkpoint (``lattice status`` says which node is being released), the node stays
until the checkpoint is complete, then goes; the checkpoint is recorded on the
allocation, its files are on disk at the recorded path, the job read which node was
leaving during its checkpoint, and the last decision's reason names the checkpoint.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from lattice_test_harness.cluster import ClusterHandle
from lattice_test_harness.plugin import make_cluster
from lattice_test_harness.victoria import AGENT_WINDOWS_NEVER_CLOSE, available
from test_autoscaling_cluster import Load, Watch, n_nodes  # the load generator and watcher

pytestmark = [
    pytest.mark.cluster,
    pytest.mark.timeout(300),
    pytest.mark.skipif(not available(), reason="victoria-metrics not installed"),
]

JOB = r"""
on_checkpoint() {
  echo "checkpoint asked; releasing: $(tr "\n" " " < "$LATTICE_RELEASING_FILE")"
  sleep 3
  echo "state of the service" > "$LATTICE_CHECKPOINT_DIR/state"
  touch "$LATTICE_CHECKPOINT_SENTINEL"
  echo "checkpoint written"
}
trap on_checkpoint USR1
trap 'echo "membership: $(tr "\n" " " < "$LATTICE_NODES_FILE")"' USR2
echo "start"
while true; do sleep 0.2; done
"""


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ClusterHandle]:
    base = tmp_path_factory.mktemp("autoscale-release")
    env = {
        **AGENT_WINDOWS_NEVER_CLOSE,
        "LATTICE_CHECKPOINT__CHECKPOINT_ROOT": str(base / "checkpoints"),
        # the scheduler's deadline for the release; the app needs about 3 s
        "LATTICE_CHECKPOINT__CHECKPOINT_TIMEOUT_SECONDS": "60",
    }
    h = make_cluster(base, members=1, agents=3, tsdb=True, env=env)
    yield h
    h.cluster.stop()


def submit(h: ClusterHandle, tmp: Path) -> str:
    script = tmp / "serve.sh"
    script.write_text(JOB)
    r = h.cli(
        "-q",
        "submit",
        "--lifecycle",
        "reactive",
        "--min-nodes",
        "2",
        "--max-nodes",
        "3",
        "--checkpoint",
        "signal",
        "--scale-metric",
        "cpu_utilization",
        "--scale-target",
        "0.8",
        "--scale-down-threshold",
        "0.25",
        "--scale-interval",
        "1",
        "--scale-up-window",
        "2",
        "--scale-down-window",
        "2",
        "--scale-cooldown",
        "3",
        str(script),
        cwd=tmp,
    )
    assert r.returncode == 0, r.stderr
    return r.stdout.strip()


def test_scale_down_checkpoints_before_releasing_the_node(
    cluster: ClusterHandle, tmp_path: Path
) -> None:
    h = cluster
    alloc_id = submit(h, tmp_path)
    h.wait_state(alloc_id, "Running", timeout=60)
    load, w = Load(h, alloc_id), Watch(h, alloc_id)
    try:
        load.fraction = 0.9
        a = w.until("3 nodes", n_nodes(3), timeout=60)
        leaving = a["assigned_nodes"][-1]
        load.fraction = 0.05
        a = w.until(
            "the scale-down to wait for the checkpoint",
            lambda x: (x.get("scaling_status") or {}).get("releasing") == [leaving],
            timeout=60,
        )
        assert len(a["assigned_nodes"]) == 3  # the node stays while the app checkpoints
        status = h.cli("status", alloc_id).stdout
        line = next(ln for ln in status.splitlines() if ln.startswith("Releasing:"))
        assert f" {leaving} after its checkpoint, by " in line, status
        asked_at = float(a["scaling_status"]["release_at"])

        a = w.until("2 nodes", n_nodes(2), timeout=60)
        released_at = time.time()
        assert leaving not in a["assigned_nodes"]
        ck = a.get("last_checkpoint")
        assert ck, a
        # written after the release was asked, recorded before the node went
        assert asked_at <= float(ck["at"]) <= float(a["scaling_status"]["at"]) <= released_at
        assert (Path(ck["path"]) / "state").read_text() == "state of the service\n"
        st = a["scaling_status"]
        assert st["last_decision"] == "down" and st["releasing"] in (None, [])
        assert st["reason"].startswith("cpu_utilization 0.05 <= 0.20")
        assert st["reason"].endswith(f"checkpoint {ck['id']} written first"), st["reason"]
        assert w.sizes[-2:] == [3, 2]

        lines: Any = h.wait_for(
            "the job's checkpoint and membership lines",
            lambda: (
                (got := h.logs(alloc_id))
                and any(ln.startswith("membership:") and len(ln.split()) == 3 for ln in got)
                and got
            ),
            timeout=30,
        )
        asked = next(ln for ln in lines if ln.startswith("checkpoint asked"))
        assert asked.split("releasing:")[1].split() == [leaving]
        order = [ln.split(":")[0] for ln in lines if ln.startswith(("checkpoint", "membership"))]
        # told of the growth, asked to checkpoint, wrote it, then told of the release
        assert order[-3:] == ["checkpoint asked; releasing", "checkpoint written", "membership"]
    finally:
        load.stop()
        h.cancel(alloc_id)
