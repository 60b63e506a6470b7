"""The scheduler's budget penalty (cost.build_context over its StateMirror) is the same
before and after a budgeted tenant's ended allocations leave the quorum's state: the
removal keeps their runs as the tenant's ledger totals (Tenant.retired_usage)."""

from __future__ import annotations

from lattice_common import commands as c
from lattice_common.types import AllocationState, NodeCapabilities
from lattice_common.watch import StateMirror, decode_delta
from lattice_quorum.quorum import encode_changes, encode_snapshot
from lattice_quorum.state import Changes, GlobalState, apply
from lattice_scheduler import cost
from lattice_test_harness import builders as b

HOUR, DAY = 3600.0, 86400.0
T0 = 1_700_000_000.0


def ok(s: GlobalState, cmd: c.Command, ch: Changes | None = None) -> c.CommandResult:
    res = apply(s, cmd, ch)
    assert res.error is None, res.error
    return res


def test_the_budget_penalty_survives_the_removal() -> None:
    s = GlobalState()
    ok(s, c.CreateTenant(tenant=b.tenant("t", gpu_hours_budget=50.0), now=1.0))
    ok(s, c.CreateVCluster(vcluster=b.vcluster("v"), now=1.0))
    caps = NodeCapabilities(cpu_cores=64, memory_gb=256, gpu_count=4)
    for i in range(2):
        ok(s, c.RegisterNode(node_id=f"n{i}", capabilities=caps, now=2.0))
    ids = []
    for k in range(3):
        a = ok(s, c.SubmitAllocation(spec=b.spec(tenant="t", vcluster="v"), now=T0 + k)).allocation
        assert a is not None
        start = T0 + k * DAY + 5 * HOUR
        ok(s, c.AssignNodes(allocation_id=a.id, node_ids=[f"n{k % 2}"], now=start))
        ok(
            s,
            c.UpdateAllocationState(
                allocation_id=a.id, state=AllocationState.COMPLETED, now=start + 2 * HOUR
            ),
        )
        ids.append(a.id)
    m = StateMirror()
    m.apply(decode_delta(encode_snapshot(s)))
    now = T0 + 5 * DAY
    before = cost.build_context(m, now).budget_fraction_used["t"]
    assert before == 3 * 2 * 4 / 50.0  # 3 runs x 2 h x 4 GPUs of a 50 GPU-hour budget
    ch = Changes()
    res = ok(s, c.RemoveAllocations(ids=ids, retention_seconds=DAY, now=now), ch)
    assert sorted(res.removed_ids or []) == sorted(ids)
    m.apply(decode_delta(encode_changes(s, ch)))
    assert not set(ids) & set(m.allocations)
    after = cost.build_context(m, now).budget_fraction_used["t"]
    assert abs(after - before) < 1e-12
