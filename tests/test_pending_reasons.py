"""Users can see why an allocation waits (`lattice status ID`), in the troubleshooting
chapter's words."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.cluster


def _reason(h, alloc_id: str) -> str:
    return h.wait_for(
        f"a pending reason for {alloc_id}",
        lambda: h.get(alloc_id).get("pending_reason"),
        timeout=15,
    )


def test_impossible_constraints_are_explained(lattice_cluster) -> None:
    h = lattice_cluster
    a = h.submit("true", constraints={"gpu_type": "H100", "gpu_count": 4})
    assert _reason(h, a["id"]) == "no nodes matching constraints"
    out = h.cli("status", a["id"])
    assert out.returncode == 0, out.stderr
    assert "no nodes matching constraints" in out.stdout
    h.cancel(a["id"])


def test_quota_and_occupancy_are_explained(lattice_cluster) -> None:
    h = lattice_cluster
    h.request("POST", "/api/v1/tenants", {"name": "capped", "max_nodes": 1})
    first = h.submit("sleep 30", tenant="capped")
    h.wait_state(first["id"], "Running")
    second = h.submit("true", tenant="capped")
    assert _reason(h, second["id"]) == "waiting for quota headroom"
    big = h.submit("true", nodes=2)  # one node is busy: it must wait
    assert _reason(h, big["id"]) == "all suitable nodes occupied"
    for a in (first, second, big):
        h.cancel(a["id"])


def test_status_verbose_lists_the_reason(lattice_cluster) -> None:
    h = lattice_cluster
    a = h.submit("true", constraints={"gpu_type": "MI300X"})
    _reason(h, a["id"])
    out = h.cli("status", "--verbose")
    assert out.returncode == 0, out.stderr
    row = next(line for line in out.stdout.splitlines() if line.startswith(a["id"]))
    assert "no nodes matching constraints" in row
    detail = h.cli("status", a["id"], "--verbose")
    assert "Pending reason:" in detail.stdout and "no nodes matching constraints" in detail.stdout
    h.cancel(a["id"])
