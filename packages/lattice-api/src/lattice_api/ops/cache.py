"""The nodes' uenv image caches (``lattice cache status|warm|evict``; NodeService.CacheStatus,
WarmCache, EvictCache; ``/api/v1/cache``): asked of each node's agent
(NodeAgentService.CacheStatus/CacheWarm/CacheEvict at its ``agent_address``).

Not quorum state: each agent owns its cache. A status or a warm goes to its nodes at once
(at most ``STATUS_PARALLEL``/``WARM_PARALLEL`` calls in flight: a warm copies whole images
from the registry) and answers one entry per node, sorted by node id:
``{node, ok, ...}``, with ``error`` (the agent's typed error, or ``unavailable`` when the
agent did not answer within the timeout) when ``ok`` is false, so one node failing never
fails the whole call. An evict names one node; its refusal (in use, not cached, agent
unreachable) is the call's error.

Permissions (lattice_api.permissions): ``cache.read`` for status (every role but the
agents'), ``cache.admin`` (system administrators) for warm and evict.
"""

from __future__ import annotations

import asyncio
import logging
import re
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from grpclib.exceptions import GRPCError
from lattice_common.agents import AgentChannels
from lattice_common.errors import LatticeError, NotFound, Unavailable, ValidationError
from lattice_common.proto.lattice import v1
from lattice_common.rpc import TRANSPORT_ERRORS, decode_grpc_error
from lattice_common.types import Node
from lattice_common.uenv_registry import UenvError, parse_ref
from lattice_quorum import queries
from lattice_quorum.quorum import Quorum

from lattice_api.auth import Identity

log = logging.getLogger("lattice.api.cache")

__all__ = ["CacheOps", "image_dict"]

T = TypeVar("T")

#: seconds an agent has to answer a status, a warm (a copy of a whole image from the
#: registry) and an evict
STATUS_TIMEOUT = 5.0
WARM_TIMEOUT = 600.0
EVICT_TIMEOUT = 30.0
#: agent calls in flight at once for one status (cheap), and for one warm (each copies a
#: whole image from the registry)
STATUS_PARALLEL = 256
WARM_PARALLEL = 64
_SHA256 = re.compile(r"[0-9a-f]{64}")
_IMAGE_HINT = "An image is a uenv NAME/VERSION[:TAG], e.g. --image=prgenv-gnu/24.11:v1."
_AGENT_HINT = "Check the node with `lattice nodes`; its agent may be down."


def image_dict(m: v1.CachedImage) -> dict[str, Any]:
    """A cached image as REST sends it: ``{ref, sha256, size, last_access, in_use}``."""
    return {
        "ref": m.ref,
        "sha256": m.sha256,
        "size": m.size,
        "last_access": m.last_access,
        "in_use": m.in_use,
    }


def _failed(node: str, err: LatticeError) -> dict[str, Any]:
    return {"node": node, "ok": False, "error": err.to_dict()}


class CacheOps:
    """Status, warm and evict of the nodes' uenv caches, through their agents."""

    def __init__(
        self,
        quorum: Quorum,
        agents: AgentChannels,
        *,
        status_timeout: float = STATUS_TIMEOUT,
        warm_timeout: float = WARM_TIMEOUT,
        evict_timeout: float = EVICT_TIMEOUT,
        status_parallel: int = STATUS_PARALLEL,
        warm_parallel: int = WARM_PARALLEL,
    ) -> None:
        self.quorum = quorum
        self.agents = agents
        self.status_timeout = status_timeout
        self.warm_timeout = warm_timeout
        self.evict_timeout = evict_timeout
        self.status_parallel = max(1, status_parallel)
        self.warm_parallel = max(1, warm_parallel)

    # ------------------------------------------------------------------ operations

    async def status(self, who: Identity, node: str | None = None) -> dict[str, Any]:
        """``{"nodes": [{node, ok, enabled, cache_dir, max_bytes, used_bytes, images}]}``
        for ``node`` or every node; a node that does not answer is ``{node, ok: false,
        error}``."""
        targets = [self._node(node)] if node else self._all()
        answers = await self._fan_out(
            targets,
            lambda stub: stub.cache_status(v1.CacheStatusRequest(), timeout=self.status_timeout),
            self.status_timeout,
            self.status_parallel,
        )
        out = []
        for n, got in answers:
            if isinstance(got, LatticeError):
                out.append(_failed(n.id, got))
                continue
            out.append(
                {
                    "node": n.id,
                    "ok": True,
                    "enabled": got.enabled,
                    "cache_dir": got.cache_dir,
                    "max_bytes": got.max_bytes,
                    "used_bytes": got.used_bytes,
                    "images": [image_dict(i) for i in got.images],
                }
            )
        return {"nodes": out}

    async def warm(
        self,
        who: Identity,
        image: str,
        *,
        nodes: list[str] | None = None,
        group: int | None = None,
        all: bool = False,
    ) -> dict[str, Any]:
        """Fetch ``image`` into the caches of ``nodes``, of every node of ``group``, or of
        every node (exactly one): ``{"image", "results": [{node, ok, image | error}]}``."""
        ref = _check_image(image, sha256_ok=False)
        targets = self._targets(nodes, group, all)
        log.info("cache warm %s on %d node(s) by %s", ref, len(targets), who.user)
        answers = await self._fan_out(
            targets,
            lambda stub: stub.cache_warm(v1.CacheImageRequest(ref=ref), timeout=self.warm_timeout),
            self.warm_timeout,
            self.warm_parallel,
        )
        results = [
            _failed(n.id, got)
            if isinstance(got, LatticeError)
            else {"node": n.id, "ok": True, "image": image_dict(got)}
            for n, got in answers
        ]
        return {"image": ref, "results": results}

    async def evict(self, who: Identity, image: str, node: str) -> dict[str, Any]:
        """Remove ``image`` (a ref, or an image's sha256) from ``node``'s cache:
        ``{"image", "results": [{node, ok, image}]}``; the agent's refusal is raised
        (in use: InvalidTransition, not cached: NotFound, no answer: Unavailable)."""
        ref = _check_image(image, sha256_ok=True)
        if not (node or "").strip():
            raise ValidationError(
                "name the node to evict from",
                hint="lattice cache evict --image=REF --node=NODE (see `lattice cache status`).",
            )
        target = self._node(node)
        log.info("cache evict %s on %s by %s", ref, target.id, who.user)
        ((n, got),) = await self._fan_out(
            [target],
            lambda stub: stub.cache_evict(
                v1.CacheImageRequest(ref=ref), timeout=self.evict_timeout
            ),
            self.evict_timeout,
        )
        if isinstance(got, LatticeError):
            raise got
        removed = got.removed[0] if got.removed else v1.CachedImage(ref=ref)
        return {"image": ref, "results": [{"node": n.id, "ok": True, "image": image_dict(removed)}]}

    # ------------------------------------------------------------------ nodes

    def _all(self) -> list[Node]:
        self.quorum.require_caught_up()
        return list(self.quorum.read(queries.nodes, None))

    def _node(self, node_id: str) -> Node:
        n = self.quorum.read(queries.node, node_id.strip())
        if n is None:
            raise NotFound(f"node {node_id} not found", hint="List nodes with `lattice nodes`.")
        return n

    def _targets(self, nodes: list[str] | None, group: int | None, all: bool) -> list[Node]:
        wanted = [n.strip() for n in nodes or [] if n and n.strip()]
        chosen = sum((bool(wanted), group is not None, bool(all)))
        if chosen != 1:
            raise ValidationError(
                "name the nodes to warm: a list of nodes, a group, or all nodes"
                + (" (only one of them)" if chosen else ""),
                hint="lattice cache warm --image=REF --nodes=A,B | --group=G | --all",
            )
        everyone = self._all()
        if wanted:
            by_id = {n.id: n for n in everyone}
            unknown = [n for n in dict.fromkeys(wanted) if n not in by_id]
            if unknown:
                raise NotFound(
                    f"unknown node(s): {', '.join(unknown)}",
                    hint="List nodes with `lattice nodes`.",
                )
            return [by_id[n] for n in sorted(set(wanted))]
        if group is not None:
            found = [n for n in everyone if n.group == group]
            if not found:
                groups = sorted({n.group for n in everyone})
                raise NotFound(
                    f"no node is in group {group}",
                    details={"groups": ", ".join(map(str, groups)) or "none"},
                    hint="`lattice nodes` shows each node's GROUP.",
                )
            return found
        if not everyone:
            raise NotFound("no nodes are registered", hint="Start the node agents first.")
        return everyone

    # ------------------------------------------------------------------ agents

    async def _fan_out(
        self,
        targets: list[Node],
        call: Callable[[v1.NodeAgentServiceStub], Awaitable[T]],
        timeout: float,
        parallel: int = 1,
    ) -> list[tuple[Node, T | LatticeError]]:
        """``call`` on each node's agent at once (at most ``parallel`` in flight): its
        answer or its error, in node order."""
        gate = asyncio.Semaphore(parallel)

        async def one(n: Node) -> T | LatticeError:
            if not n.agent_address:
                return Unavailable(
                    f"node {n.id} has no agent address (its agent never registered)",
                    details={"node": n.id, "cause": "unreachable"},
                    hint=_AGENT_HINT,
                )
            async with gate:
                try:
                    # the deadline covers a connect that never completes, too
                    return await asyncio.wait_for(
                        call(self.agents.stub(n.agent_address)), timeout + 1.0
                    )
                except GRPCError as e:
                    err = decode_grpc_error(e)
                    err.details.setdefault("node", n.id)
                    return err
                except (*TRANSPORT_ERRORS, ValueError) as e:  # ValueError: a bad address
                    if isinstance(e, TimeoutError):
                        why = f"did not answer within {timeout:g}s"
                    else:
                        why = f"could not be reached ({e or type(e).__name__})"
                    return Unavailable(
                        f"node {n.id}: its agent at {n.agent_address} {why}",
                        details={"node": n.id, "cause": "unreachable"},
                        hint=_AGENT_HINT,
                    )

        answers = await asyncio.gather(*(one(n) for n in targets))
        return sorted(zip(targets, answers, strict=True), key=lambda p: p[0].id)


def _check_image(image: str, *, sha256_ok: bool) -> str:
    ref = (image or "").strip()
    if not ref:
        raise ValidationError("an image is required", hint=_IMAGE_HINT)
    if sha256_ok and _SHA256.fullmatch(ref):
        return ref
    try:
        parse_ref(ref)
    except UenvError as e:
        raise ValidationError(e.message, details={"image": ref[:80]}, hint=_IMAGE_HINT) from None
    return ref
