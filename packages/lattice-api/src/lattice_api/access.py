"""Object-level access: the checks that depend on the record, not only on the RPC.

The permission table (lattice_api.permissions) decides whether a role may call an RPC
at all; the operations call these helpers for what depends on the data: whose
allocation it is, whose usage is asked for, whether a listing spans every user. Both
transports reach them through the same operations, so REST and gRPC cannot disagree.
"""

from __future__ import annotations

from lattice_common.errors import PermissionDenied
from lattice_common.types import Allocation, Dag

from lattice_api.auth import Identity, Role
from lattice_api.permissions import authorize

LIST_ALL = "allocation.list_all"

_CANCEL_OTHERS = frozenset({Role.SYSTEM_ADMIN, Role.TENANT_ADMIN})


# roles that read every allocation (system-wide); a tenant admin reads its tenant's
_READ_ALL = frozenset({Role.SYSTEM_ADMIN, Role.OPERATOR, Role.READ_ONLY, Role.AGENT, Role.SERVICE})


def listing_user(who: Identity, user: str | None, all_users: bool) -> str | None:
    """Whose allocations a listing shows (None = every user's).

    The caller's own unless ``all_users`` is asked for or another ``user`` is named:
    both need ``allocation.list_all`` (``all_users`` wins over ``user``)."""
    if all_users:
        authorize(who, LIST_ALL)
        return None
    if user and user != who.user:
        authorize(who, LIST_ALL)
        return user
    return who.user


def listing_tenant(who: Identity, tenant: str | None) -> str | None:
    """The tenant a listing is confined to: a tenant admin sees only its own tenant."""
    if who.role == Role.TENANT_ADMIN:
        return who.tenant
    return tenant


def can_read(who: Identity, a: Allocation) -> bool:
    """Whether ``who`` may see ``a`` at all: its owner, a tenant admin of its tenant, and
    the roles that read everything. Callers answer NotFound otherwise, exactly as for an
    id that does not exist, so ids cannot be probed."""
    if a.spec.user == who.user or who.role in _READ_ALL:
        return True
    return who.role == Role.TENANT_ADMIN and bool(who.tenant) and a.spec.tenant == who.tenant


def usage_user(who: Identity, user: str | None) -> str:
    """Whose usage is asked for (default: the caller's); another user's needs
    ``allocation.list_all``."""
    target = (user or "").strip() or who.user
    if target != who.user:
        authorize(who, LIST_ALL)
    return target


def check_cancel(who: Identity, a: Allocation) -> None:
    """Users cancel their own allocations; system and tenant admins anyone's."""
    if a.spec.user != who.user and who.role not in _CANCEL_OTHERS:
        raise PermissionDenied(
            f"allocation {a.id} belongs to {a.spec.user}",
            hint="You can only cancel your own allocations.",
        )


def check_update(who: Identity, a: Allocation) -> None:
    """Changing a running allocation (its telemetry mode: ``PATCH /api/v1/allocations/
    {id}``): its owner, a tenant admin of its tenant (``can_read`` already confined them),
    or a system admin; others who may read it (operators, read-only) may not."""
    if a.spec.user != who.user and who.role not in _CANCEL_OTHERS:
        raise PermissionDenied(
            f"allocation {a.id} belongs to {a.spec.user}",
            hint="Only its owner, a tenant admin of its tenant or a system admin may change it.",
        )


def check_dag_cancel(who: Identity, d: Dag) -> None:
    """As :func:`check_cancel`, for a whole DAG: its submitter, or a system or tenant
    admin."""
    if d.user != who.user and who.role not in _CANCEL_OTHERS:
        raise PermissionDenied(
            f"DAG {d.id} belongs to {d.user}",
            hint="You can only cancel your own DAGs.",
        )


def sees_others_sessions(who: Identity) -> bool:
    """System and tenant admins may read and end anyone's session; users their own."""
    return who.role in _CANCEL_OTHERS


#: roles that see every tenant's services (spec: "without the header, all services are
#: visible (admin/operator access)")
_SERVICES_ALL = frozenset({Role.SYSTEM_ADMIN, Role.OPERATOR, Role.READ_ONLY})


def service_tenants(who: Identity, tenant: str | None) -> set[str] | None:
    """Whose services a discovery request shows (None = every tenant's).

    The caller's tenant (token claim, or the x-lattice-tenant header in dev mode) limits
    it; operators and system admins without one see every tenant, or the ``tenant``
    they name. Anyone else sees only their own tenant and may not name another."""
    requested = (tenant or "").strip()
    own = who.tenant
    if who.role in _SERVICES_ALL:
        narrowed = requested or own
        return {narrowed} if narrowed else None
    if not own:
        raise PermissionDenied(
            f"{who.user} has no tenant: service discovery is tenant-filtered",
            hint="Your token must name your tenant; ask your administrator.",
        )
    if requested and requested != own:
        raise PermissionDenied(
            f'{who.user} may not list the services of tenant "{requested}"',
            hint=f'You see the services of your tenant "{own}".',
        )
    return {own}


def releases_any_claim(who: Identity) -> bool:
    """A system admin may end any user's sensitive claim; others only their own (the
    state machine checks the claimant)."""
    return who.role == Role.SYSTEM_ADMIN


__all__ = [
    "check_cancel",
    "check_dag_cancel",
    "check_update",
    "listing_user",
    "releases_any_claim",
    "sees_others_sessions",
    "service_tenants",
    "usage_user",
]
