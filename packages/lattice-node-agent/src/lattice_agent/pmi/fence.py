"""The head agent's side of a launch's cross-node PMI fence (a star).

Every agent that serves ranks of a multi-node launch sends the puts of its
ranks for one fence (``epoch``) to the head agent
(``NodeAgentService.PmiFence``).  The head keeps one
:class:`FenceCoordinator` per launch: :meth:`FenceCoordinator.contribute`
waits until every expected node has contributed to the current epoch,
then every waiter gets the keys every node put for that epoch.  Only the
epoch's keys travel: each agent's :class:`~lattice_agent.pmi.kvs.Launch`
keeps the launch's whole key space and ``fence_done`` merges into it, so
sending the cumulative space back to every node on every fence would only
grow each answer (N nodes x all keys so far, measured at 1.4 s per fence for
128 nodes after 20 fences).  :meth:`FenceCoordinator.snapshot` still has
the cumulative space.

Failures are typed so the gRPC layer can map them to status codes:

* :class:`UnknownNode`           -- the node is not part of the launch
* :class:`DuplicateContribution` -- the node already contributed to this epoch
* :class:`EpochMismatch`         -- an epoch other than the current one
* :class:`FenceTimeout`          -- not every node arrived in ``timeout`` seconds
  (counted from the first contribution of the epoch); names the missing nodes
* :class:`FenceAborted`          -- :meth:`FenceCoordinator.abort` was called

A timeout or an abort is final: the launch is dead, every current waiter
and every later contribution fails with the same error.

Plain asyncio, no gRPC; all methods must be called from the loop thread.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Collection, Mapping
from typing import Protocol

from lattice_agent.pmi.kvs import FenceReady
from lattice_agent.pmi.server import FENCE_TIMEOUT_REASON
from lattice_agent.pmi.tree import FenceTopology

__all__ = [
    "DuplicateContribution",
    "EpochMismatch",
    "FenceAborted",
    "FenceCoordinator",
    "FenceError",
    "FenceRegistry",
    "FenceServer",
    "FenceTimeout",
    "LaunchFence",
    "SendFn",
    "UnknownNode",
]


#: a tree leader's way up: (epoch, the group's puts) -> the keys every node put
Upstream = Callable[[int, dict[str, str]], Awaitable[Mapping[str, str]]]


class FenceError(Exception):
    """Base class of every fence failure."""


class UnknownNode(FenceError):
    """A contribution from a node that is not part of the launch."""


class DuplicateContribution(FenceError):
    """A node contributed twice to the same epoch."""


class EpochMismatch(FenceError):
    """A contribution to an epoch other than the current one."""


class FenceTimeout(FenceError, TimeoutError):
    """Not every node contributed in time; ``missing`` names the absent ones."""

    def __init__(self, epoch: int, missing: Collection[str], timeout: float) -> None:
        self.epoch = epoch
        self.missing = sorted(missing)
        super().__init__(
            f"{FENCE_TIMEOUT_REASON}: epoch {epoch} not complete after {timeout:g}s, "
            f"missing nodes: {', '.join(self.missing)}"
        )


class FenceAborted(FenceError):
    """The launch was aborted; every waiter fails with this."""

    def __init__(self, reason: str) -> None:
        self.reason = reason
        super().__init__(f"PMI fence aborted: {reason}")


class FenceCoordinator:
    """One launch's fence on the head agent: wait for every node, merge, answer all.

    ``nodes``: the node ids that serve ranks of the launch (each contributes
    once per epoch).  ``first_epoch``: the epoch of the launch's first fence
    (``kvs.Launch`` counts from 0).  ``upstream`` (a tree's group leader): the
    complete group's keys are sent up as one contribution and its answer is
    what every waiter gets; its failure fails the launch's fence.
    """

    def __init__(
        self,
        nodes: Collection[str],
        timeout: float = 60.0,
        *,
        first_epoch: int = 0,
        upstream: Upstream | None = None,
    ) -> None:
        if not nodes:
            raise ValueError("a fence needs at least one node")
        self.nodes: frozenset[str] = frozenset(nodes)
        self.timeout = float(timeout)
        self.upstream = upstream
        self._upstream_task: asyncio.Task[None] | None = None
        self._forwarding: asyncio.Future[dict[str, str]] | None = None
        self._epoch = first_epoch
        self._kvs: dict[str, str] = {}
        self._arrived: set[str] = set()
        self._pending: dict[str, str] = {}
        self._future: asyncio.Future[dict[str, str]] | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._failed: FenceError | None = None

    @property
    def epoch(self) -> int:
        """The epoch the coordinator is collecting (completed epochs are below it)."""
        return self._epoch

    @property
    def kvs(self) -> dict[str, str]:
        """A copy of the launch's merged key space so far (completed epochs only)."""
        return dict(self._kvs)

    @property
    def failed(self) -> FenceError | None:
        """The final error after a timeout or an abort, else None."""
        return self._failed

    async def contribute(self, epoch: int, node_id: str, kvs: Mapping[str, str]) -> dict[str, str]:
        """Add ``node_id``'s puts to ``epoch``; once every node has, the keys all of them
        put for this epoch (what the waiters' ``Launch.fence_done`` merges)."""
        if self._failed is not None:
            raise self._failed
        if node_id not in self.nodes:
            raise UnknownNode(f"node {node_id!r} is not part of this launch")
        if epoch != self._epoch:
            raise EpochMismatch(
                f"node {node_id!r} sent fence epoch {epoch}, current is {self._epoch}"
            )
        if node_id in self._arrived:
            raise DuplicateContribution(f"node {node_id!r} already contributed to epoch {epoch}")

        loop = asyncio.get_running_loop()
        if self._future is None:
            self._future = loop.create_future()
            self._timer = loop.call_later(self.timeout, self._on_timeout)
        future = self._future
        self._arrived.add(node_id)
        self._pending.update(kvs)
        if len(self._arrived) == len(self.nodes):
            self._complete()
        # shield: one cancelled waiter (a client that went away) must not
        # cancel the round for everybody else
        # every waiter gets the same (read-only) mapping: the service encodes it once
        return await asyncio.shield(future)

    def abort(self, reason: str) -> None:
        """Fail every current waiter and every later contribution with FenceAborted."""
        if self._failed is None:
            self._fail(FenceAborted(reason))

    def _complete(self) -> None:
        future = self._future
        self._cancel_timer()
        self._future = None
        self._arrived = set()
        epoch = self._epoch
        self._epoch += 1
        published = self._pending
        self._pending = {}
        if self.upstream is not None and future is not None:
            self._forwarding = future
            self._upstream_task = asyncio.get_running_loop().create_task(
                self._forward(epoch, published, future)
            )
            return
        self._kvs.update(published)
        if future is not None and not future.done():
            future.set_result(published)

    async def _forward(
        self, epoch: int, puts: dict[str, str], future: asyncio.Future[dict[str, str]]
    ) -> None:
        """A tree leader: the group's keys go up as one contribution; the answer comes down."""
        assert self.upstream is not None
        try:
            merged = dict(await self.upstream(epoch, puts))
        except asyncio.CancelledError:
            raise
        except FenceError as e:
            self._fail(e)
            return
        except Exception as e:  # the head is unreachable or refused: the launch cannot go on
            self._fail(FenceAborted(f"fence epoch {epoch} failed upstream: {e}"))
            return
        self._upstream_task = None
        self._forwarding = None
        if self._failed is not None:
            return
        self._kvs.update(merged)
        if not future.done():
            future.set_result(merged)

    def _on_timeout(self) -> None:
        self._timer = None
        if self._failed is None:
            missing = self.nodes - self._arrived
            self._fail(FenceTimeout(self._epoch, missing, self.timeout))

    def _fail(self, error: FenceError) -> None:
        self._failed = error
        self._cancel_timer()
        task, self._upstream_task = self._upstream_task, None
        if task is not None and task is not asyncio.current_task():
            task.cancel()
        futures = (self._future, self._forwarding)
        self._future = self._forwarding = None
        for future in futures:
            if future is not None and not future.done():
                future.set_exception(error)
                # every waiter retrieves it; mark it retrieved for the no-waiter case
                future.exception()

    def _cancel_timer(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None


class FenceServer(Protocol):
    """What a served PmiFence call reaches: a coordinator or a node's :class:`LaunchFence`."""

    async def contribute(
        self, epoch: int, node_id: str, kvs: Mapping[str, str]
    ) -> dict[str, str]: ...


#: (parent node id, epoch, puts) -> the epoch's keys: the PmiFence call to a parent's agent
SendFn = Callable[[str, int, dict[str, str]], Awaitable[Mapping[str, str]]]


class LaunchFence:
    """This node's part of one launch's fence (see ``pmi.tree``).

    A leader (the head of a star, or a group leader of a tree) collects its
    group with a :class:`FenceCoordinator`; a tree leader's coordinator sends
    the group's keys up in one call, and the head also collects the leaders.
    Every other node sends its keys to its parent with ``send``.
    """

    def __init__(self, topology: FenceTopology, node_id: str, timeout: float, send: SendFn) -> None:
        if node_id not in topology.parent:
            raise UnknownNode(f"node {node_id!r} is not part of this launch")
        self.node_id = node_id
        self.topology = topology
        self._send = send
        self.top: FenceCoordinator | None = None
        self.group: FenceCoordinator | None = None
        if node_id == topology.head and topology.is_tree:
            self.top = FenceCoordinator(topology.leaders, timeout)
        members = topology.groups.get(node_id)
        if members is not None:
            upstream: Upstream | None = None
            if self.top is not None:
                top = self.top
                upstream = lambda epoch, puts: top.contribute(epoch, node_id, puts)  # noqa: E731
            elif node_id != topology.head:
                parent = topology.parent[node_id]
                assert parent is not None
                upstream = lambda epoch, puts: send(parent, epoch, puts)  # noqa: E731
            self.group = FenceCoordinator(members, timeout, upstream=upstream)

    @property
    def collects(self) -> bool:
        """Whether other nodes send their fence keys here."""
        return self.group is not None

    async def fence(self, ready: FenceReady) -> Mapping[str, str]:
        """The local ranks are at the barrier: this node's keys in, the epoch's keys out."""
        if self.group is not None:
            return await self.group.contribute(ready.epoch, self.node_id, ready.puts)
        parent = self.topology.parent[self.node_id]
        assert parent is not None
        return await self._send(parent, ready.epoch, dict(ready.puts))

    async def contribute(self, epoch: int, node_id: str, kvs: Mapping[str, str]) -> dict[str, str]:
        """A child's PmiFence call."""
        if node_id != self.node_id:
            if self.group is not None and node_id in self.group.nodes:
                return await self.group.contribute(epoch, node_id, kvs)
            if self.top is not None and node_id in self.top.nodes:
                return await self.top.contribute(epoch, node_id, kvs)
        raise UnknownNode(f"node {node_id!r} does not send its fence keys to {self.node_id!r}")

    def abort(self, reason: str) -> None:
        for c in (self.group, self.top):
            if c is not None:
                c.abort(reason)


class FenceRegistry:
    """The fences this agent serves, by (allocation id, launch id)."""

    def __init__(self) -> None:
        self._fences: dict[tuple[str, str], FenceServer] = {}

    def register(self, allocation_id: str, task_id: str, fence: FenceServer) -> None:
        key = (allocation_id, task_id)
        if key in self._fences:
            raise ValueError(f"a fence for launch {task_id!r} of {allocation_id!r} is registered")
        self._fences[key] = fence

    def get(self, allocation_id: str, task_id: str) -> FenceServer | None:
        return self._fences.get((allocation_id, task_id))

    def remove(self, allocation_id: str, task_id: str) -> FenceServer | None:
        return self._fences.pop((allocation_id, task_id), None)

    def __len__(self) -> int:
        return len(self._fences)
