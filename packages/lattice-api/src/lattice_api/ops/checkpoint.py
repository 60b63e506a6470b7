"""Checkpoint a running allocation now, and let it run on (AllocationService.Checkpoint,
``POST /api/v1/allocations/{id}/checkpoint``, ``lattice checkpoint ID``).

Its owner (or a tenant/system admin: the same rule as cancel) asks for what the
checkpoint broker would decide on its own: a checkpoint hint recorded in the quorum
(``handlers.checkpoints.issue_checkpoint_hint``), which the head node's agent carries
out through the allocation's protocol without stopping it; the checkpoint is then the
allocation's ``last_checkpoint``. Refused for an allocation that is not Running, has no
checkpoint protocol, or already has a hint outstanding.
"""

from __future__ import annotations

import time

from lattice_common import commands as c
from lattice_common.errors import StaleRevision
from lattice_common.types import Allocation

from lattice_api import access
from lattice_api.auth import Identity
from lattice_api.ops.allocations import AllocationOps
from lattice_api.ops.base import raise_if_error


async def checkpoint(ops: AllocationOps, who: Identity, alloc_id: str) -> Allocation:
    a = ops.get(who, alloc_id)
    access.check_cancel(who, a)
    for attempt in range(2):
        res = await ops.quorum.propose(
            c.IssueCheckpointHint(
                allocation_id=alloc_id,
                epoch=a.checkpoint_hints,
                reason=f"requested by {who.user}",
                now=time.time(),
            )
        )
        # this member's copy was behind the leader's (another hint just landed): once more
        if res.error is not None and res.error.get("code") == StaleRevision.code and not attempt:
            a = ops.get(who, alloc_id)
            continue
        break
    res = raise_if_error(res)
    assert res.allocation is not None
    return res.allocation
