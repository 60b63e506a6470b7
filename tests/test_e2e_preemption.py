"""Preemption on a real cluster: a higher class takes nodes from lower classes, and
the victims come back (original submit time kept) and finish."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.cluster


def test_class_8_preempts_class_2_jobs_which_requeue_and_complete(cluster_factory) -> None:
    h = cluster_factory(members=1, agents=2)
    low = [h.submit("sleep 4; echo low-done", preemption_class=2, walltime="10m") for _ in range(2)]
    for a in low:
        h.wait_state(a["id"], "Running")
    urgent = h.submit("echo urgent-done", preemption_class=8, nodes=2, walltime="10m")

    done = h.wait_state(urgent["id"], ("Completed", "Failed"), timeout=30)
    assert done["state"] == "Completed"
    assert h.logs(urgent["id"]) == ["urgent-done"]

    for before in low:
        after = h.wait_state(before["id"], ("Completed", "Failed"), timeout=40)
        assert after["state"] == "Completed", after
        assert after["preempted_count"] == 1
        assert after["resume_from_checkpoint"] is True
        assert after["requeue_count"] == 0  # preemption is not a failure requeue
        assert after["submitted_at"] == before["submitted_at"]
        # the victim ran again after the urgent job, on the freed nodes
        assert after["started_at"] >= done["finished_at"] - 0.5
        assert "low-done" in h.logs(before["id"])


def test_equal_class_is_never_preempted(cluster_factory) -> None:
    h = cluster_factory(members=1, agents=1)
    first = h.submit("sleep 3", preemption_class=5, walltime="10m")
    h.wait_state(first["id"], "Running")
    second = h.submit("true", preemption_class=5, walltime="10m")
    # the equal-class job waits for the first to finish instead of preempting it
    end = h.wait_state(first["id"], ("Completed", "Failed", "Pending"), timeout=20)
    assert end["state"] == "Completed" and end["preempted_count"] == 0
    assert h.wait_state(second["id"], "Completed", timeout=20)["state"] == "Completed"
