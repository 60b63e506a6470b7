"""NodeService operations: list and get nodes, the admin actions (drain, undrain,
disable, enable, release a sensitive claim), and the agents' side (register,
heartbeat, the level-triggered desired state)."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Coroutine, Mapping
from typing import Any

import msgspec
from lattice_common import audit
from lattice_common import commands as c
from lattice_common.errors import LatticeError, NotFound, NotLeader, ValidationError
from lattice_common.types import AllocationReport, Node, NodeCapabilities, NodeState
from lattice_quorum import queries
from lattice_quorum.quorum import Quorum

from lattice_api import access
from lattice_api.audit import AuditRecorder
from lattice_api.auth import Identity
from lattice_api.desired_fanout import DesiredFanout
from lattice_api.node_monitor import NodeMonitor
from lattice_api.ops.base import raise_if_error
from lattice_api.ops.pki import require_node_identity

log = logging.getLogger("lattice.api.nodes")

# one BatchHeartbeat: a whole 10,000-node machine at most
MAX_HEARTBEAT_BATCH = 10_000


class Beat(msgspec.Struct):
    """One node's heartbeat in a batch (the fields of HeartbeatRequest the quorum uses)."""

    node_id: str
    sequence: int
    reports: list[AllocationReport] = msgspec.field(default_factory=list)
    # named as in the REST heartbeat's body
    fingerprint: str = msgspec.field(default="", name="conformance_fingerprint")
    telemetry_sources: list[str] | None = None


def describe_identity(who: Identity) -> str:
    """How an agent authenticated, for `lattice nodes ID`: the identity cascade's step
    (spiffe, quorum-ca, site-ca, bootstrap), the shared token, or none (dev mode)."""
    cert = who.cert
    if cert is not None:
        expires = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(cert.not_after))
        return f"{cert.mode} (serial {cert.serial[:16]}, expires {expires})"
    return "none" if who.method == "none" else "token"


class NodeOps:
    def __init__(
        self,
        quorum: Quorum,
        monitor: NodeMonitor,
        *,
        api_addresses: Mapping[str, str],
        audit: AuditRecorder | None = None,
    ) -> None:
        self.quorum = quorum
        self.monitor = monitor
        self.api_addresses = dict(api_addresses)
        # drain/undrain/disable/enable are recorded; claims and releases by the quorum
        self.audit = audit
        # node id -> how its agent authenticated at its last call here (describe_identity)
        self.agent_identities: dict[str, str] = {}
        # node id -> the telemetry collectors its agent reported at its last heartbeat
        self.telemetry_sources: dict[str, str] = {}
        # the agents' desired-state streams share one quorum subscription
        self.fanout = DesiredFanout(quorum)

    # --- reads ----------------------------------------------------------------------

    def list(self, who: Identity, *, state: str | None = None) -> list[Node]:
        self.quorum.require_caught_up()
        wanted: set[NodeState] | None = None
        if state:
            try:
                wanted = {NodeState.parse(s) for s in state.split(",") if s.strip()}
            except ValueError:
                raise ValidationError(
                    f"unknown node state {state!r}",
                    details={"available": ", ".join(s.value for s in NodeState)},
                ) from None
        found = self.quorum.read(queries.nodes, wanted)
        for n in found:  # copies: filling them in changes no state
            self._fill(n)
        return found

    def get(self, who: Identity, node_id: str) -> Node:
        n = self.quorum.read(queries.node, node_id)
        if n is None:
            raise NotFound(f"node {node_id} not found", hint="List nodes with `lattice nodes`.")
        self._fill(n)
        return n

    def _fill(self, n: Node) -> None:
        """What this member knows of the node's agent (never committed state)."""
        n.agent_identity = self.agent_identities.get(n.id, "")
        n.telemetry = self.telemetry_sources.get(n.id, "")

    def note_telemetry(self, node_id: str, sources: list[str]) -> None:
        """The collectors a heartbeat says the agent uses (shown by `lattice nodes ID`)."""
        self.telemetry_sources[node_id] = ", ".join(sorted(sources)) or "none"

    def bind_agent(self, who: Identity, node_id: str) -> None:
        """Refuse a node certificate used for another node; note how the agent
        authenticated."""
        require_node_identity(who, node_id, self.audit)
        self.agent_identities[node_id] = describe_identity(who)

    # --- admin actions --------------------------------------------------------------

    async def _act(
        self, who: Identity, node_id: str, cmd: c.Command, action: str = "", reason: str = ""
    ) -> Node:
        self.get(who, node_id)
        res = raise_if_error(await self.quorum.propose(cmd))
        assert res.node is not None
        if action and self.audit is not None:
            details = {"reason": reason, "state": res.node.state.value}
            self.audit.record(who.user, action, f"node:{node_id}", details=details)
        return res.node

    async def drain(self, who: Identity, node_id: str, reason: str = "") -> Node:
        cmd = c.DrainNode(node_id=node_id, reason=reason, now=time.time())
        return await self._act(who, node_id, cmd, audit.NODE_DRAIN, reason)

    async def undrain(self, who: Identity, node_id: str, reason: str = "") -> Node:
        cmd = c.UndrainNode(node_id=node_id, now=time.time())
        return await self._act(who, node_id, cmd, audit.NODE_UNDRAIN, reason)

    async def disable(self, who: Identity, node_id: str, reason: str = "") -> Node:
        cmd = c.DisableNode(node_id=node_id, reason=reason, now=time.time())
        return await self._act(who, node_id, cmd, audit.NODE_DISABLE, reason)

    async def enable(self, who: Identity, node_id: str, reason: str = "") -> Node:
        cmd = c.EnableNode(node_id=node_id, now=time.time())
        return await self._act(who, node_id, cmd, audit.NODE_ENABLE, reason)

    async def release(self, who: Identity, node_id: str, reason: str = "") -> Node:
        cmd = c.ReleaseNodeClaim(
            node_id=node_id,
            user=who.user,
            admin=access.releases_any_claim(who),
            now=time.time(),
        )
        return await self._act(who, node_id, cmd)

    # --- agents ---------------------------------------------------------------------

    async def register(self, who: Identity, body: dict[str, Any]) -> Node:
        node_id = str(body.get("node_id") or "").strip()
        if not node_id:
            raise ValidationError("node_id is required")
        self.bind_agent(who, node_id)
        try:
            caps = msgspec.convert(body.get("capabilities") or {}, NodeCapabilities)
        except msgspec.ValidationError as e:
            raise ValidationError(f"invalid capabilities: {e}") from None
        res = raise_if_error(
            await self.quorum.propose(
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
        self.monitor.registered(res.node.id)
        return res.node

    async def heartbeat(
        self,
        who: Identity,
        node_id: str,
        sequence: int,
        reports: list[AllocationReport],
        fingerprint: str = "",
        *,
        telemetry_sources: list[str] | None = None,
    ) -> dict[str, object]:
        """What the agent should know (accepted? re-register?); NotLeader on a follower.
        ``telemetry_sources``: the collectors the agent reported (None: not reported)."""
        self.bind_agent(who, node_id)
        if telemetry_sources is not None:
            self.note_telemetry(node_id, telemetry_sources)
        return await self.monitor.heartbeat(node_id, sequence, reports, fingerprint)

    async def heartbeats(self, who: Identity, beats: list[Beat]) -> list[dict[str, Any]]:
        """A batch of heartbeats (spec: heartbeat coalescing), each handled as
        :meth:`heartbeat` would be and answered on its own: ``node_id``,
        ``reregister``, ``generation`` and ``error`` (a refused one: a replayed
        sequence, over the node's rate, another node's certificate). The steady state
        (Ready nodes, nothing new) commits nothing; the commits the others call for
        (back to Ready, drift, exits) run together, not one after another. NotLeader
        on a follower, for the whole batch."""
        if len(beats) > MAX_HEARTBEAT_BATCH:
            raise ValidationError(
                f"{len(beats)} heartbeats in one batch; at most {MAX_HEARTBEAT_BATCH}",
                details={"heartbeats": len(beats), "max": MAX_HEARTBEAT_BATCH},
                hint="Split the batch.",
            )
        if not self.quorum.is_leader:
            raise NotLeader(
                "this quorum member is not the leader", hint="Retry against the leader."
            )
        out: list[dict[str, Any]] = []
        waiting: list[tuple[dict[str, Any], Coroutine[Any, Any, None]]] = []
        for b in beats:
            res: dict[str, Any] = {"node_id": b.node_id, "reregister": False, "error": None}
            out.append(res)
            try:
                self.bind_agent(who, b.node_id)
                if b.telemetry_sources is not None:
                    self.note_telemetry(b.node_id, b.telemetry_sources)
                answer, follow_up = self.monitor.accept(
                    b.node_id, b.sequence, b.reports, b.fingerprint
                )
            except LatticeError as e:
                res["error"] = e.to_dict()
                continue
            res["reregister"] = bool(answer.get("reregister"))
            if follow_up is not None:
                waiting.append((res, follow_up))
        if waiting:
            done = await asyncio.gather(*(f for _, f in waiting), return_exceptions=True)
            for (res, _), d in zip(waiting, done, strict=True):
                if isinstance(d, LatticeError):
                    res["error"] = d.to_dict()
                elif isinstance(d, BaseException):
                    log.error("heartbeat of %s not handled", res["node_id"], exc_info=d)
                    res["error"] = LatticeError(f"heartbeat not handled: {d}").to_dict()
        read = self.desired_generation
        for res in out:
            res["generation"] = 0 if res["error"] else read(res["node_id"])
        return out

    def leader_hint(self) -> str | None:
        """None on the leader; elsewhere the leader's API address ("" when unknown)."""
        if self.quorum.is_leader:
            return None
        return self.api_addresses.get(self.quorum.leader_raft_address or "", "")

    def desired_for(self, node_id: str) -> queries.DesiredSet:
        """The allocations a node should be running now, the revision they reflect and
        the node's sensitive claim."""
        return self.quorum.read(queries.desired_for, node_id)

    def desired_generation(self, node_id: str) -> int:
        """The revision of the node's desired set (what a heartbeat answers), no copy."""
        return self.quorum.read(queries.desired_generation, node_id)

    async def desired_state(
        self, who: Identity, node_id: str, known_generation: int = 0
    ) -> AsyncIterator[queries.DesiredSet]:
        """Level-triggered dispatch: the node's desired set now and after every change
        that touches the node. An agent that already has ``known_generation`` gets its
        set only once it changes (nothing at once when it is still current)."""
        self.bind_agent(who, node_id)
        # one quorum subscription serves every node's stream (desired_fanout)
        async for desired in self.fanout.watch(
            node_id,
            self.desired_for,
            known_generation=known_generation,
            generation=self.desired_generation,
        ):
            yield desired


__all__ = ["MAX_HEARTBEAT_BATCH", "Beat", "NodeOps"]
