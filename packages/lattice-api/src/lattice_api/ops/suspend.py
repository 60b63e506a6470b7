"""Suspend and resume an allocation on demand (AllocationService.Suspend/Resume,
``POST /api/v1/allocations/{id}/suspend|resume``, ``lattice suspend|resume ID``).

* suspend: its owner (or a tenant/system admin) asks a Running allocation that declared
  a checkpoint protocol to checkpoint; it goes Checkpointing, the head node's agent runs
  the protocol, and it ends Suspended with the checkpoint recorded and its nodes
  released (or Failed when the checkpoint fails). The vCluster must allow it
  (``allow_user_suspend``); sensitive allocations are never suspended. The quorum
  (``handlers.allocations.suspend_allocation``) enforces the rules.
* resume: a Suspended allocation (suspended by its owner, or preempted and not yet
  requeued) goes back to Pending at once with its original submit time and the resume
  flag; its next run gets LATTICE_RESUME=1 and LATTICE_CHECKPOINT_PATH.

Who may: the same rule as cancel (``access.check_cancel``).
"""

from __future__ import annotations

import time

from lattice_common import commands as c
from lattice_common.types import Allocation

from lattice_api import access
from lattice_api.auth import Identity
from lattice_api.ops.allocations import AllocationOps
from lattice_api.ops.base import raise_if_error


async def suspend(ops: AllocationOps, who: Identity, alloc_id: str) -> Allocation:
    access.check_cancel(who, ops.get(who, alloc_id))
    res = raise_if_error(
        await ops.quorum.propose(
            c.SuspendAllocation(allocation_id=alloc_id, requested_by=who.user, now=time.time())
        )
    )
    assert res.allocation is not None
    return res.allocation


async def resume(ops: AllocationOps, who: Identity, alloc_id: str) -> Allocation:
    access.check_cancel(who, ops.get(who, alloc_id))
    res = raise_if_error(
        await ops.quorum.propose(
            c.ResumeAllocation(allocation_id=alloc_id, requested_by=who.user, now=time.time())
        )
    )
    assert res.allocation is not None
    return res.allocation
