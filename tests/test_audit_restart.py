"""The audit log across a quorum restart, on a real 1-member cluster: entries recorded
before the restart come back from the member's Raft journal, new ones continue the
same chain (seq and prev_hash), the development signing key kept in the data dir
signs both, and the exported log verifies offline with its public key."""

from __future__ import annotations

import signal
import urllib.request

import pytest
from lattice_common import audit

pytestmark = pytest.mark.cluster


def _entries(h, url: str | None = None) -> list[dict]:
    return h.request("GET", "/api/v1/admin/audit?limit=1000", url=url)["entries"]


def test_the_chain_continues_and_verifies_after_a_restart(cluster_factory) -> None:
    h = cluster_factory(members=1, agents=0)
    cl = h.cluster
    m = cl.members[0]
    node = "nid001"  # registered as an agent would (no agent process: the test stays fast)
    h.request("POST", "/api/v1/nodes/register", {"node_id": node, "hostname": node})
    h.user = "ops-admin"
    h.request("POST", f"/api/v1/nodes/{node}/drain", {"reason": "before the restart"})
    h.request("PATCH", f"/api/v1/tenants/{cl.tenant}", {"max_nodes": 3})
    before = _entries(h)
    mine = [(e["actor"], e["action"]) for e in before if e["actor"] == "ops-admin"]
    assert mine == [("ops-admin", "node.drain"), ("ops-admin", "tenant.update")]

    key_file = m.dir / "raft" / "audit_signing_key.pem"  # development: no configured key
    public_key = audit.load_public_key(key_file.read_bytes())

    cl.stop_member(m, signal.SIGTERM)
    cl.start_member(m)
    leader = cl.leader(timeout=30)
    restored = h.wait_for(
        "the audit log restored",
        lambda: len(_entries(h, leader.rest_url)) >= len(before) and _entries(h, leader.rest_url),
    )
    assert restored[: len(before)] == before

    h.request("POST", f"/api/v1/nodes/{node}/undrain", url=leader.rest_url)
    after = _entries(h, leader.rest_url)
    new = after[len(before)]
    assert (new["actor"], new["action"], new["target"]) == (
        "ops-admin",
        "node.undrain",
        f"node:{node}",
    )
    assert new["seq"] == before[-1]["seq"] + 1 and new["prev_hash"] == before[-1]["hash"]
    assert new["key_id"] == before[-1]["key_id"] == audit.key_id(public_key)

    verdict = h.request("POST", "/api/v1/admin/audit/verify", url=leader.rest_url)
    assert verdict["valid"] and verdict["count"] == len(after), verdict
    req = urllib.request.Request(
        leader.rest_url + "/api/v1/admin/audit/export", headers={"x-lattice-user": "ops-admin"}
    )
    with urllib.request.urlopen(req, timeout=15) as r:
        data = r.read()
    result = audit.verify_export(data, [public_key])
    assert result.ok and result.count == len(after), result.message
    # and one edited byte in the archive is named
    lines = data.splitlines(keepends=True)
    k = len(before)  # the line of the last entry before the restart
    assert b'"max_nodes":"3"' in lines[k]  # the tenant update
    lines[k] = lines[k].replace(b'"max_nodes":"3"', b'"max_nodes":"4"')
    bad = audit.verify_export(b"".join(lines), [public_key])
    assert not bad.ok and bad.first_bad == before[-1]["seq"], bad.message
