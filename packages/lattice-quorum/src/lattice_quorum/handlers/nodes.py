"""Command handlers that change nodes: registration, health, drain/undrain,
disable/enable and conformance (fingerprint baseline and drift).

A node going Down or disabled fails or requeues the allocation on it (per its
requeue policy) through the shared lifecycle steps in ``handlers.common``.
"""

from __future__ import annotations

from lattice_common import commands as c
from lattice_common.errors import InvalidTransition, ValidationError
from lattice_common.state_machine import check_node_transition
from lattice_common.types import AllocationState, Node, NodeState, RequeuePolicy

from lattice_quorum.global_state import Changes, GlobalState
from lattice_quorum.handlers.common import (
    bump,
    find_node,
    finish,
    free,
    requeue,
    resume_from_hint_checkpoint,
    touch_node,
)


def register_node(state: GlobalState, cmd: c.RegisterNode, ch: Changes) -> c.CommandResult:
    bump(state)
    n = state.nodes.get(cmd.node_id)
    if n is None:
        n = Node(id=cmd.node_id, registered_at=cmd.now, home_vcluster=cmd.home_vcluster)
        state.nodes[n.id] = n
    n.hostname = cmd.hostname
    n.capabilities = cmd.capabilities
    n.group = cmd.group
    if cmd.conformance_group:  # "" = not reported: keep what we know
        n.conformance_group = cmd.conformance_group
    n.agent_address = cmd.agent_address
    if cmd.home_vcluster:
        n.home_vcluster = cmd.home_vcluster
    # A (re-)registering agent is healthy; admin states (drain, disable) are kept.
    if n.state in (NodeState.UNKNOWN, NodeState.BOOTING, NodeState.DEGRADED) or (
        n.state == NodeState.DOWN and not n.disabled
    ):
        # an operator's drain survives the node going down and coming back
        n.state = NodeState.DRAINED if n.drain_requested else NodeState.READY
        n.state_reason = ""
    _check_conformance(n)
    touch_node(state, n, ch)
    return c.CommandResult(revision=state.revision, node=n)


CONFORMANCE_DRIFT = "conformance_drift"


def _check_conformance(n: Node) -> None:
    """Compare the node's reported fingerprint (conformance_group) with its baseline.

    The first fingerprint a node reports becomes its baseline (expected_conformance).
    A different one later is drift: recorded on the node (conformance_drift and a
    state_reason "conformance_drift: expected=<a>, actual=<b>", unless another reason
    is already there), nothing else changes: running work continues, and the node
    scores lower on f9 because it now sits in a smaller conformance group. A report
    matching the baseline again (remediated) clears it."""
    actual = n.conformance_group
    if not actual:
        return
    if not n.expected_conformance:
        n.expected_conformance = actual
    drifted = actual != n.expected_conformance
    was_reason = n.state_reason.startswith(CONFORMANCE_DRIFT)
    n.conformance_drift = drifted
    if drifted and (not n.state_reason or was_reason):
        n.state_reason = f"{CONFORMANCE_DRIFT}: expected={n.expected_conformance}, actual={actual}"
    elif not drifted and was_reason:
        n.state_reason = ""
    if drifted and n.claimed_by and n.state == NodeState.READY:
        # a sensitive node must not take new claims until remediated and verified; an
        # operator undrains it afterwards (Drained -> Ready)
        n.drain_requested = True
        n.state = NodeState.DRAINING if n.owner else NodeState.DRAINED
        n.state_reason = f"{CONFORMANCE_DRIFT}: expected={n.expected_conformance}, actual={actual}"


def report_conformance(
    state: GlobalState, cmd: c.ReportConformance, ch: Changes
) -> c.CommandResult:
    n = find_node(state, cmd.node_id)
    if not cmd.fingerprint or cmd.fingerprint == n.conformance_group:
        return c.CommandResult(revision=state.revision, node=n)
    bump(state)
    n.conformance_group = cmd.fingerprint
    _check_conformance(n)
    touch_node(state, n, ch)
    return c.CommandResult(revision=state.revision, node=n)


def set_node_health(state: GlobalState, cmd: c.SetNodeHealth, ch: Changes) -> c.CommandResult:
    n = find_node(state, cmd.node_id)
    if cmd.state not in (NodeState.READY, NodeState.DEGRADED, NodeState.DOWN):
        raise ValidationError(f"health can only set Ready, Degraded or Down, not {cmd.state}")
    if n.state == cmd.state:
        return c.CommandResult(revision=state.revision, node=n)
    if cmd.state == NodeState.READY and n.state != NodeState.DEGRADED:
        # Recovery from Down happens by re-registration, from drains by undrain.
        return c.CommandResult(revision=state.revision, node=n)
    if cmd.state == NodeState.DEGRADED and n.state not in (NodeState.READY,):
        # Admin states (Draining/Drained) keep their meaning; Down stays Down.
        return c.CommandResult(revision=state.revision, node=n)
    check_node_transition(n.id, n.state, cmd.state)
    bump(state)
    n.state = cmd.state
    n.state_reason = cmd.reason
    _check_conformance(n)  # a drifted node that recovers keeps saying so
    if cmd.state == NodeState.DOWN:
        _fail_node_allocations(state, n, cmd.now, "node_failure", ch)
    touch_node(state, n, ch)
    return c.CommandResult(revision=state.revision, node=n)


def _fail_node_allocations(
    state: GlobalState, n: Node, now: float, reason: str, ch: Changes
) -> None:
    if not n.owner:
        return
    a = state.allocations.get(n.owner)
    if a is None or a.terminal:
        free(n)
        return
    if (
        a.spec.requeue_policy in (RequeuePolicy.ON_NODE_FAILURE, RequeuePolicy.ALWAYS)
        and a.requeue_count < a.spec.max_requeue
    ):
        requeue(state, a, reason, ch)
        resume_from_hint_checkpoint(a)
    else:
        finish(state, a, AllocationState.FAILED, now, reason, None, ch)


def drain_node(state: GlobalState, cmd: c.DrainNode, ch: Changes) -> c.CommandResult:
    n = find_node(state, cmd.node_id)
    if n.state in (NodeState.DRAINING, NodeState.DRAINED):
        return c.CommandResult(revision=state.revision, node=n)
    target = NodeState.DRAINING if n.owner else NodeState.DRAINED
    check_node_transition(n.id, n.state, target)
    bump(state)
    n.drain_requested = True
    n.state = target
    n.state_reason = cmd.reason
    touch_node(state, n, ch)
    return c.CommandResult(revision=state.revision, node=n)


def undrain_node(state: GlobalState, cmd: c.UndrainNode, ch: Changes) -> c.CommandResult:
    n = find_node(state, cmd.node_id)
    if n.state != NodeState.DRAINED:
        raise InvalidTransition(
            f"node {n.id} is {n.state.value}; undrain only works from Drained",
            details={"node": n.id, "state": n.state.value},
            hint="Wait for its allocations to finish (or cancel them), then undrain."
            if n.state == NodeState.DRAINING
            else "Only a drained node can be undrained.",
        )
    bump(state)
    n.drain_requested = False
    n.state = NodeState.READY
    n.state_reason = ""
    if n.conformance_drift:
        # undrain after maintenance is the operator's approval of the node as it is
        # now (spec: rolling upgrades, drift remediation): its fingerprint becomes
        # the baseline
        n.expected_conformance = n.conformance_group
        n.conformance_drift = False
    touch_node(state, n, ch)
    return c.CommandResult(revision=state.revision, node=n)


def disable_node(state: GlobalState, cmd: c.DisableNode, ch: Changes) -> c.CommandResult:
    n = find_node(state, cmd.node_id)
    bump(state)
    n.disabled = True
    n.state = NodeState.DOWN
    n.state_reason = cmd.reason or "disabled"
    _fail_node_allocations(state, n, cmd.now, "node_disabled", ch)
    touch_node(state, n, ch)
    return c.CommandResult(revision=state.revision, node=n)


def enable_node(state: GlobalState, cmd: c.EnableNode, ch: Changes) -> c.CommandResult:
    n = find_node(state, cmd.node_id)
    if not n.disabled and n.state != NodeState.DOWN:
        return c.CommandResult(revision=state.revision, node=n)
    bump(state)
    n.disabled = False
    n.state = NodeState.DRAINED if n.drain_requested else NodeState.READY
    n.state_reason = ""
    _check_conformance(n)
    touch_node(state, n, ch)
    return c.CommandResult(revision=state.revision, node=n)
