"""The API's operations, independent of transport.

REST (aiohttp) and gRPC (grpclib) handlers authenticate, then call these methods with
an Identity and plain data. Writes become quorum commands; reads run on the member's
state under its lock and copy what they return.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import Any

import msgspec
from lattice_common import commands as c
from lattice_common.errors import LatticeError, NotFound, PermissionDenied, ValidationError
from lattice_common.taskgroup import parse_task_group
from lattice_common.types import (
    HOLDING_STATES,
    Allocation,
    AllocationState,
    CostWeights,
    Node,
    NodeCapabilities,
    NodeState,
    SchedulerType,
    Tenant,
    VCluster,
)
from lattice_common.watch import decode_delta
from lattice_quorum.member import QuorumMember

from lattice_api.auth import Identity, Role, authorize
from lattice_api.validation import validate_submission


def raise_if_error(res: c.CommandResult) -> c.CommandResult:
    if res.error is not None:
        raise LatticeError.from_dict(res.error)
    return res


class LatticeService:
    def __init__(
        self, member: QuorumMember, *, api_addresses: dict[str, str] | None = None
    ) -> None:
        self.member = member
        self.budget_period_days = 90  # internal budget ledger window (scheduling config)
        # raft address -> API gRPC address of that member, to point clients at the leader
        self.api_addresses = dict(api_addresses or {})

    # --- allocations ----------------------------------------------------------------

    async def submit(self, who: Identity, body: dict[str, Any]) -> Allocation:
        authorize(who, "allocation.submit")
        tenants, vclusters = self.member.read(lambda s: (set(s.tenants), set(s.vclusters)))
        spec = validate_submission(
            body,
            user=who.user,
            tenants=tenants,
            vclusters=vclusters,
            default_tenant=who.tenant,
            # a follower may not have applied a just-created tenant yet: the state
            # machine checks names again at commit, with the same error
            check_names=self.member.is_leader,
        )
        res = raise_if_error(
            await self.member.propose(c.SubmitAllocation(spec=spec, now=time.time()))
        )
        assert res.allocation is not None
        return res.allocation

    async def submit_task_group(self, who: Identity, body: dict[str, Any]) -> c.CommandResult:
        """One allocation per index of ``body["task_group"]`` (``"0-99%20"`` or an object
        with start/end/step/concurrency); returns the group id and its tasks."""
        authorize(who, "allocation.submit")
        tg = body.get("task_group")
        if isinstance(tg, dict):
            try:
                start, end = int(tg.get("start", 0)), int(tg["end"])
                step, conc = int(tg.get("step") or 1), int(tg.get("concurrency") or 0)
            except (KeyError, TypeError, ValueError):
                raise ValidationError(
                    "task_group needs whole numbers start, end, step and concurrency",
                    hint='e.g. {"start": 0, "end": 99, "concurrency": 20}',
                ) from None
            parse_task_group(f"{start}-{end}:{step}" + (f"%{conc}" if conc else ""))
        else:
            start, end, step, conc = parse_task_group(str(tg))
        tenants, vclusters = self.member.read(lambda s: (set(s.tenants), set(s.vclusters)))
        spec = validate_submission(
            {k: v for k, v in body.items() if k != "task_group"},
            user=who.user,
            tenants=tenants,
            vclusters=vclusters,
            default_tenant=who.tenant,
            check_names=self.member.is_leader,
        )
        cmd = c.SubmitTaskGroup(
            spec=spec, start=start, end=end, step=step, concurrency=conc, now=time.time()
        )
        return raise_if_error(await self.member.propose(cmd))

    def get_allocation(self, who: Identity, alloc_id: str) -> Allocation:
        authorize(who, "allocation.read")
        self.member.require_caught_up()
        a = self.member.read(lambda s: s.allocations.get(alloc_id))
        if a is None:
            raise NotFound(
                f"allocation {alloc_id} not found",
                hint="List your allocations with `lattice status`.",
            )
        return msgspec.structs.replace(a)

    def list_allocations(
        self,
        who: Identity,
        *,
        state: str | None = None,
        tenant: str | None = None,
        vcluster: str | None = None,
        user: str | None = None,
        all_users: bool = False,
        limit: int | None = None,
        task_group: str | None = None,
    ) -> list[Allocation]:
        authorize(who, "allocation.read")
        self.member.require_caught_up()
        states: set[AllocationState] | None = None
        if state:
            try:
                states = {AllocationState.parse(s) for s in state.split(",") if s.strip()}
            except ValueError:
                raise ValidationError(
                    f"unknown state {state!r}",
                    details={"available": ", ".join(s.value for s in AllocationState)},
                ) from None
        if all_users:
            authorize(who, "allocation.list_all")
        elif (user is None and who.role != Role.SYSTEM_ADMIN) or user is None:
            user = who.user

        def pick(s: Any) -> list[Allocation]:
            out = []
            for a in s.allocations.values():
                if states is not None and a.state not in states:
                    continue
                if tenant and a.spec.tenant != tenant:
                    continue
                if vcluster and a.spec.vcluster != vcluster:
                    continue
                if not all_users and user and a.spec.user != user:
                    continue
                if task_group and a.task_group_id != task_group:
                    continue
                out.append(a)
            out.sort(key=lambda a: a.submitted_at)
            if limit:
                out = out[-limit:]
            return [msgspec.structs.replace(a) for a in out]

        return self.member.read(pick)

    async def cancel(self, who: Identity, alloc_id: str) -> Allocation:
        authorize(who, "allocation.cancel")
        a = self.get_allocation(who, alloc_id)
        if a.spec.user != who.user and who.role not in (Role.SYSTEM_ADMIN, Role.TENANT_ADMIN):
            raise PermissionDenied(
                f"allocation {alloc_id} belongs to {a.spec.user}",
                hint="You can only cancel your own allocations.",
            )
        res = raise_if_error(
            await self.member.propose(
                c.CancelAllocation(allocation_id=alloc_id, requested_by=who.user, now=time.time())
            )
        )
        assert res.allocation is not None
        return res.allocation

    async def watch(self, who: Identity, alloc_id: str) -> AsyncIterator[tuple[int, Allocation]]:
        """Current state first, then every change, until the allocation is terminal."""
        authorize(who, "allocation.read")
        q = self.member.subscribe()
        try:
            last = -1
            while True:
                raw = await q.get()
                if raw is None:  # state replaced: re-read
                    a = self.get_allocation(who, alloc_id)
                    rev = a.revision
                else:
                    d = decode_delta(raw)
                    found = [x for x in d.allocations if x.id == alloc_id]
                    if d.snapshot and not found:
                        raise NotFound(f"allocation {alloc_id} not found")
                    if not found:
                        continue
                    a, rev = found[0], d.revision
                if a.revision != last:
                    last = a.revision
                    yield rev, a
                if a.terminal:
                    return
        finally:
            self.member.unsubscribe(q)

    # --- nodes ----------------------------------------------------------------------

    def list_nodes(self, who: Identity, *, state: str | None = None) -> list[Node]:
        authorize(who, "node.read")
        self.member.require_caught_up()
        wanted: set[NodeState] | None = None
        if state:
            try:
                wanted = {NodeState.parse(s) for s in state.split(",") if s.strip()}
            except ValueError:
                raise ValidationError(
                    f"unknown node state {state!r}",
                    details={"available": ", ".join(s.value for s in NodeState)},
                ) from None
        return self.member.read(
            lambda s: [
                msgspec.structs.replace(n)
                for n in sorted(s.nodes.values(), key=lambda n: n.id)
                if wanted is None or n.state in wanted
            ]
        )

    def get_node(self, who: Identity, node_id: str) -> Node:
        authorize(who, "node.read")
        n = self.member.read(lambda s: s.nodes.get(node_id))
        if n is None:
            raise NotFound(f"node {node_id} not found", hint="List nodes with `lattice nodes`.")
        return msgspec.structs.replace(n)

    async def node_action(self, who: Identity, node_id: str, action: str, reason: str = "") -> Node:
        authorize(who, "node.release" if action == "release" else "node.admin")
        self.get_node(who, node_id)
        now = time.time()
        cmd: c.Command
        if action == "release":
            cmd = c.ReleaseNodeClaim(
                node_id=node_id, user=who.user, admin=who.role == Role.SYSTEM_ADMIN, now=now
            )
        elif action == "drain":
            cmd = c.DrainNode(node_id=node_id, reason=reason, now=now)
        elif action == "undrain":
            cmd = c.UndrainNode(node_id=node_id, now=now)
        elif action == "disable":
            cmd = c.DisableNode(node_id=node_id, reason=reason, now=now)
        elif action == "enable":
            cmd = c.EnableNode(node_id=node_id, now=now)
        else:
            raise ValidationError(f"unknown node action {action!r}")
        res = raise_if_error(await self.member.propose(cmd))
        assert res.node is not None
        return res.node

    async def register_node(self, who: Identity, body: dict[str, Any]) -> Node:
        authorize(who, "node.agent")
        node_id = str(body.get("node_id") or "").strip()
        if not node_id:
            raise ValidationError("node_id is required")
        try:
            caps = msgspec.convert(body.get("capabilities") or {}, NodeCapabilities)
        except msgspec.ValidationError as e:
            raise ValidationError(f"invalid capabilities: {e}") from None
        res = raise_if_error(
            await self.member.propose(
                c.RegisterNode(
                    node_id=node_id,
                    hostname=str(body.get("hostname") or ""),
                    capabilities=caps,
                    group=int(body.get("group") or 0),
                    conformance_group=str(body.get("conformance_group") or ""),
                    agent_address=str(body.get("agent_address") or ""),
                    home_vcluster=str(body.get("home_vcluster") or ""),
                    now=time.time(),
                )
            )
        )
        assert res.node is not None
        return res.node

    def desired_for(self, node_id: str) -> tuple[int, list[Allocation]]:
        """The allocations a node should be running now, and the revision they reflect."""

        def pick(s: Any) -> tuple[int, list[Allocation]]:
            n = s.nodes.get(node_id)
            if n is None or not n.owner:
                return (n.revision if n else s.revision), []
            a = s.allocations.get(n.owner)
            if a is None or a.state not in HOLDING_STATES:
                return n.revision, []
            return max(n.revision, a.revision), [msgspec.structs.replace(a)]

        return self.member.read(pick)

    async def desired_state(
        self, who: Identity, node_id: str
    ) -> AsyncIterator[tuple[int, list[Allocation]]]:
        """Level-triggered dispatch: the node's desired set now and after every change
        that touches the node."""
        authorize(who, "node.agent")
        q = self.member.subscribe()
        try:
            last: tuple[int, tuple[str, ...]] | None = None
            while True:
                raw = await q.get()
                if raw is not None:
                    d = decode_delta(raw)
                    if (
                        not d.snapshot
                        and not any(n.id == node_id for n in d.nodes)
                        and not any(node_id in a.assigned_nodes for a in d.allocations)
                    ):
                        continue
                gen, allocs = self.desired_for(node_id)
                key = (gen, tuple(a.id + a.state for a in allocs))
                if key != last:
                    last = key
                    yield gen, allocs
        finally:
            self.member.unsubscribe(q)

    # --- tenants and vClusters --------------------------------------------------------

    def list_tenants(self, who: Identity) -> list[Tenant]:
        authorize(who, "tenant.read")
        return self.member.read(
            lambda s: [
                msgspec.structs.replace(t) for t in sorted(s.tenants.values(), key=lambda t: t.name)
            ]
        )

    def get_tenant(self, who: Identity, name: str) -> Tenant:
        authorize(who, "tenant.read")
        t = self.member.read(lambda s: s.tenants.get(name))
        if t is None:
            raise NotFound(
                f'tenant "{name}" not found', hint="List tenants with `lattice admin tenant list`."
            )
        return msgspec.structs.replace(t)

    async def create_tenant(self, who: Identity, body: dict[str, Any]) -> Tenant:
        authorize(who, "tenant.admin")
        name = str(body.get("name") or "").strip()
        if not name:
            raise ValidationError("tenant name is required", hint="Pass --name.")
        try:
            t = msgspec.convert({**body, "name": name}, Tenant)
        except msgspec.ValidationError as e:
            raise ValidationError(f"invalid tenant: {e}") from None
        _check_quota_values(t.max_nodes, t.max_concurrent_allocations)
        res = raise_if_error(await self.member.propose(c.CreateTenant(tenant=t, now=time.time())))
        assert res.tenant is not None
        return res.tenant

    async def update_tenant(self, who: Identity, name: str, fields: dict[str, Any]) -> Tenant:
        authorize(who, "tenant.admin")
        fields = {k: v for k, v in fields.items() if k != "name"}
        _check_quota_values(fields.get("max_nodes"), fields.get("max_concurrent_allocations"))
        res = raise_if_error(
            await self.member.propose(c.UpdateTenant(name=name, fields=fields, now=time.time()))
        )
        assert res.tenant is not None
        return res.tenant

    def list_vclusters(self, who: Identity) -> list[VCluster]:
        authorize(who, "vcluster.read")
        return self.member.read(
            lambda s: [
                msgspec.structs.replace(v)
                for v in sorted(s.vclusters.values(), key=lambda v: v.name)
            ]
        )

    def get_vcluster(self, who: Identity, name: str) -> VCluster:
        authorize(who, "vcluster.read")
        v = self.member.read(lambda s: s.vclusters.get(name))
        if v is None:
            raise NotFound(
                f'vCluster "{name}" not found',
                hint="List vClusters with `lattice admin vcluster list`.",
            )
        return msgspec.structs.replace(v)

    async def create_vcluster(self, who: Identity, body: dict[str, Any]) -> VCluster:
        authorize(who, "vcluster.admin")
        name = str(body.get("name") or "").strip()
        if not name:
            raise ValidationError("vCluster name is required", hint="Pass --name.")
        st = str(body.get("scheduler_type") or "hpc-backfill")
        if st not in {s.value for s in SchedulerType}:
            raise ValidationError(
                f"unknown scheduler type {st!r}",
                details={"available": ", ".join(s.value for s in SchedulerType)},
            )
        try:
            v = msgspec.convert({**body, "name": name, "scheduler_type": st}, VCluster)
        except msgspec.ValidationError as e:
            raise ValidationError(f"invalid vCluster: {e}") from None
        if v.cycle_interval_seconds <= 0:
            raise ValidationError("cycle_interval_seconds must be greater than zero")
        res = raise_if_error(
            await self.member.propose(c.CreateVCluster(vcluster=v, now=time.time()))
        )
        assert res.vcluster is not None
        return res.vcluster

    async def update_vcluster(self, who: Identity, name: str, fields: dict[str, Any]) -> VCluster:
        authorize(who, "vcluster.admin")
        fields = {k: v for k, v in fields.items() if k != "name"}
        if "weights" in fields:
            try:
                msgspec.convert(fields["weights"], CostWeights)
            except msgspec.ValidationError as e:
                raise ValidationError(f"invalid weights: {e}") from None
        res = raise_if_error(
            await self.member.propose(c.UpdateVCluster(name=name, fields=fields, now=time.time()))
        )
        assert res.vcluster is not None
        return res.vcluster

    # --- raft -------------------------------------------------------------------------

    def raft_status(self, who: Identity) -> dict[str, Any]:
        authorize(who, "raft.read")
        st = self.member.status()
        leader = st.get("leader_address") or ""
        st["leader_api_address"] = self.api_addresses.get(leader, "")
        return st

    def leader_api_address(self) -> str:
        return self.api_addresses.get(self.member.leader_raft_address or "", "")


def _check_quota_values(*vals: Any) -> None:
    for v in vals:
        if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 0):
            raise ValidationError(f"quota values must be whole numbers >= 0 (got {v!r})")


__all__ = ["LatticeService", "raise_if_error"]
