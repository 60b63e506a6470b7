"""The replicated data: ``GlobalState`` and ``Changes``.

Kept apart from ``state.apply`` and its handlers so that every handler module can name
these types without importing the dispatcher that imports the handlers (no import
cycle). Import them from ``lattice_quorum.state`` as before; both paths name the same
classes.
"""

from __future__ import annotations

import msgspec
from lattice_common.audit import AuditEntry, AuditEvent
from lattice_common.types import (
    Allocation,
    Dag,
    Node,
    ServiceEndpoint,
    Session,
    Tenant,
    VCluster,
)


class GlobalState(msgspec.Struct, kw_only=True):
    revision: int = 0
    alloc_seq: int = 0
    id_salt: int = 0  # set from the first submission's timestamp: ids differ per cluster
    nodes: dict[str, Node] = msgspec.field(default_factory=dict)
    allocations: dict[str, Allocation] = msgspec.field(default_factory=dict)
    tenants: dict[str, Tenant] = msgspec.field(default_factory=dict)
    vclusters: dict[str, VCluster] = msgspec.field(default_factory=dict)
    request_ids: dict[str, str] = msgspec.field(
        default_factory=dict
    )  # request_id -> alloc/group id
    task_groups: dict[str, list[str]] = msgspec.field(default_factory=dict)  # group id -> task ids
    dags: dict[str, Dag] = msgspec.field(default_factory=dict)  # DAG id -> its record
    sessions: dict[str, Session] = msgspec.field(default_factory=dict)  # session id -> record
    # Allocations submitted alone with dependencies (submit --dependency), by predecessor:
    # the successors to look at when the predecessor ends.
    dependents: dict[str, list[str]] = msgspec.field(default_factory=dict)
    # Index of allocations holding nodes (Staging/Running/Checkpointing), for quotas.
    active: dict[str, None] = msgspec.field(default_factory=dict)
    # System-wide hard limit on nodes claimed for sensitive use (None = no limit)
    sensitive_pool_size: int | None = None
    # The service registry: service name -> endpoints of running allocations that
    # expose it (kept by handlers.services on every allocation change)
    services: dict[str, list[ServiceEndpoint]] = msgspec.field(default_factory=dict)
    # The audit log (lattice_common.audit; handlers.audit): signed, hash-chained entries,
    # append-only, seq = index + 1; the PEM of every key that signed one, by key id
    audit_log: list[AuditEntry] = msgspec.field(default_factory=list)
    audit_keys: dict[str, str] = msgspec.field(default_factory=dict)
    # Events the state machine itself produced (sensitive claims and ends), waiting for
    # the leader's API to sign them into the log; numbered by audit_outbox_seq
    audit_outbox: list[AuditEvent] = msgspec.field(default_factory=list)
    audit_outbox_seq: int = 0
    # The internal CA (handlers.pki): PEM certificate and key that sign node agents'
    # certificates; CAs rotated out stay trusted until what they signed expires. Never
    # in a watch delta (lattice_quorum.quorum.encode_snapshot lists what is).
    ca_cert_pem: str = ""
    ca_key_pem: str = ""
    ca_previous: list[str] = msgspec.field(default_factory=list)


class Changes(msgspec.Struct, kw_only=True):
    """Keys touched by one apply; the shell turns them into watch deltas."""

    allocations: set[str] = msgspec.field(default_factory=set)
    nodes: set[str] = msgspec.field(default_factory=set)
    tenants: set[str] = msgspec.field(default_factory=set)
    vclusters: set[str] = msgspec.field(default_factory=set)
    # allocations that left the state (RemoveAllocations): mirrors drop them
    removed_allocations: set[str] = msgspec.field(default_factory=set)

    def __bool__(self) -> bool:
        return bool(
            self.allocations
            or self.nodes
            or self.tenants
            or self.vclusters
            or self.removed_allocations
        )


def allocation_id_for(seq: int, salt: int = 0) -> str:
    """Short, unique, deterministic id: a bijection of (sequence + salt) on 32 bits."""
    return f"{((seq + salt) * 0x9E3779B1 + 0x7F4A7C15) & 0xFFFFFFFF:08x}"
