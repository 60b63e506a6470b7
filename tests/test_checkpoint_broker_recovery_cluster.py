"""After a checkpoint storage outage the broker hints the allocation with the most
recompute to save first (spec: Checkpoint Broker, storage outage: "on recovery,
re-evaluate high recompute-value allocations first"). A real two-node dev cluster
(quorum member, scheduler, two agents and ``lattice-checkpoint`` as processes) with two
running applications of the signal protocol:

* ``older`` started first and is checkpointed on its owner's request a few seconds
  later, so less of its work is at risk than of ``newer``, which started in between;
* the checkpoint root then disappears (as an unmounted share): the broker's probe
  fails, ``lattice_checkpoint_storage_unavailable`` is 1 and no hint goes out;
* the root comes back: both are hinted in one pass, ``newer`` (more work at risk) first,
  though it was submitted and started later. The quorum's hint records say so.

The broker is eager (a tiny node MTBF: every second of work is at risk) and evaluates
every 2 s."""

from __future__ import annotations

import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from lattice_test_harness.cluster import ClusterHandle
from lattice_test_harness.plugin import make_cluster
from test_checkpoint_broker_cluster import broker_metric

pytestmark = pytest.mark.timeout(120)

APP = Path(__file__).parent.parent / "packages/lattice-node-agent/tests/apps/ckpt_signal.py"
INTERVAL = 2.0


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ClusterHandle]:
    base = tmp_path_factory.mktemp("broker-recovery")
    h = make_cluster(
        base,
        members=1,
        agents=2,
        checkpoint_broker=True,
        env={
            "LATTICE_CHECKPOINT__EVALUATION_INTERVAL_SECONDS": str(INTERVAL),
            "LATTICE_CHECKPOINT__NODE_MTBF_HOURS": "0.0001",
            "LATTICE_CHECKPOINT__DEFAULT_CHECKPOINT_GIB_PER_NODE": "0.001",
        },
    )
    h.cluster.stop_broker()  # started when the test says so
    yield h
    h.cluster.stop_broker()
    h.cluster.stop()


def test_on_recovery_the_most_recompute_to_save_is_hinted_first(cluster: ClusterHandle) -> None:
    h = cluster
    root = Path(h.cluster.env["LATTICE_CHECKPOINT__CHECKPOINT_ROOT"])
    entry = f"{sys.executable} {APP} 1000000 0.05"
    older = h.submit(entry, checkpoint="signal", project="climate", preemption_class=3)["id"]
    h.wait_state(older, "Running", timeout=30)
    newer = h.submit(entry, checkpoint="signal", project="climate", preemption_class=3)["id"]
    h.wait_state(newer, "Running", timeout=30)
    time.sleep(2.0)
    # the owner checkpoints the older one now: its work at risk starts over
    h.request("POST", f"/api/v1/allocations/{older}/checkpoint", {})
    h.wait_for(
        "the owner's checkpoint",
        lambda: (h.get(older).get("checkpoint_hint") or {}).get("outcome") == "ok",
        timeout=30,
        interval=0.2,
    )
    # the checkpoint storage goes away; the broker starts and holds its hints
    away = root.with_name(root.name + "-unmounted")
    root.rename(away)
    h.cluster.start_broker()
    h.wait_for(
        "the outage seen",
        lambda: broker_metric(h, "lattice_checkpoint_storage_unavailable") == 1,
        timeout=30,
        interval=0.2,
    )
    h.wait_for(
        "two evaluations in the outage",
        lambda: (broker_metric(h, "lattice_checkpoint_evaluations_total") or 0) >= 2,
        timeout=30,
        interval=0.2,
    )
    assert h.get(older)["checkpoint_hints"] == 1 and h.get(newer)["checkpoint_hints"] == 0
    # storage back: both hinted, the one with more to recompute first
    away.rename(root)
    hinted = h.wait_for(
        "both hinted",
        lambda: (
            (a := h.get(older))["checkpoint_hints"] == 2
            and (b := h.get(newer))["checkpoint_hints"] == 1
            and (a, b)
        ),
        timeout=30,
        interval=0.2,
    )
    a, b = hinted
    first, second = b["checkpoint_hint"], a["checkpoint_hint"]
    assert first["at"] < second["at"], (first, second)
    assert second["at"] - first["at"] < 0.01  # one pass, in order, not two passes
    assert broker_metric(h, "lattice_checkpoint_storage_unavailable") == 0
    # and both are carried out, the applications running on
    for aid, hint in ((newer, "hint-1"), (older, "hint-2")):
        done = h.wait_for(
            f"{hint} of {aid} recorded",
            lambda aid=aid: ((x := h.get(aid)).get("checkpoint_hint") or {}).get("outcome") and x,
            timeout=30,
            interval=0.2,
        )
        assert done["checkpoint_hint"]["id"] == hint and done["checkpoint_hint"]["outcome"] == "ok"
        assert done["state"] == "Running"
        assert Path(done["last_checkpoint"]["path"]).is_dir()
    h.cancel(older)
    h.cancel(newer)
