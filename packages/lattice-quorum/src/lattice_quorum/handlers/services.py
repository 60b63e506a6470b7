"""The service registry: where the named ports of running service allocations answer.

An allocation that declares ``expose`` ports (``connectivity.expose``) has one endpoint
per (name, assigned node) while it runs: the node's hostname and the declared port.
Entries are kept in ``GlobalState.services`` (name -> endpoints) and follow the
allocation in the same apply that changes it, so the registry has the consistency of
node ownership (spec: Failure Modes, Service Registry Failure):

* Running or Checkpointing: its endpoints are (re)registered from its assigned nodes,
  so a scale or a move to other nodes after a requeue replaces the old ones;
* any other state (Staging, Pending after a requeue, Suspended, ended): removed;
* a name left without endpoints is dropped.

It is a hook on ``common.touch_alloc`` (every allocation change goes through it) rather
than code in each handler; installed when this module is imported, which ``state``
does for every handler module. Deterministic: reads only the state.
"""

from __future__ import annotations

from lattice_common.types import Allocation, AllocationState, ServiceEndpoint

from lattice_quorum.global_state import GlobalState
from lattice_quorum.handlers import common

#: States in which an allocation's endpoints are registered.
SERVING_STATES = frozenset({AllocationState.RUNNING, AllocationState.CHECKPOINTING})


def endpoints_of(state: GlobalState, a: Allocation) -> dict[str, list[ServiceEndpoint]]:
    """The endpoints ``a`` should have now, by service name (none unless it serves)."""
    if a.state not in SERVING_STATES or not a.spec.expose:
        return {}
    out: dict[str, list[ServiceEndpoint]] = {}
    for exposed in a.spec.expose:
        eps = out.setdefault(exposed.name, [])
        for nid in a.assigned_nodes:
            n = state.nodes.get(nid)
            eps.append(
                ServiceEndpoint(
                    allocation_id=a.id,
                    node_id=nid,
                    address=(n.hostname if n is not None and n.hostname else nid),
                    port=exposed.port,
                    tenant=a.spec.tenant,
                )
            )
    return out


def sync(state: GlobalState, a: Allocation) -> None:
    """Make the registry hold exactly ``a``'s current endpoints."""
    if not a.spec.expose:
        return
    wanted = endpoints_of(state, a)
    for name in {e.name for e in a.spec.expose}:
        kept = [e for e in state.services.get(name, ()) if e.allocation_id != a.id]
        kept.extend(wanted.get(name, ()))
        if kept:
            kept.sort(key=lambda e: (e.allocation_id, e.node_id, e.port))
            state.services[name] = kept
        else:
            state.services.pop(name, None)


def _on_touched(state: GlobalState, a: Allocation) -> None:
    sync(state, a)


common.on_touched = _on_touched
