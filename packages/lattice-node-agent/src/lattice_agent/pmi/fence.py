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
from collections.abc import Collection, Mapping

from lattice_agent.pmi.server import FENCE_TIMEOUT_REASON

__all__ = [
    "DuplicateContribution",
    "EpochMismatch",
    "FenceAborted",
    "FenceCoordinator",
    "FenceError",
    "FenceRegistry",
    "FenceTimeout",
    "UnknownNode",
]


class FenceError(Exception):
    """Base class of every fence failure."""


class UnknownNode(FenceError):
    """A contribution from a node that is not part of the launch."""


class DuplicateContribution(FenceError):
    """A node contributed twice to the same epoch."""


class EpochMismatch(FenceError):
    """A contribution to an epoch other than the current one."""


class FenceTimeout(FenceError):
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
    (``kvs.Launch`` counts from 0).
    """

    def __init__(
        self, nodes: Collection[str], timeout: float = 60.0, *, first_epoch: int = 0
    ) -> None:
        if not nodes:
            raise ValueError("a fence needs at least one node")
        self.nodes: frozenset[str] = frozenset(nodes)
        self.timeout = float(timeout)
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
        merged = await asyncio.shield(future)
        return dict(merged)

    def abort(self, reason: str) -> None:
        """Fail every current waiter and every later contribution with FenceAborted."""
        if self._failed is None:
            self._fail(FenceAborted(reason))

    def _complete(self) -> None:
        future = self._future
        self._cancel_timer()
        self._future = None
        self._arrived = set()
        self._epoch += 1
        published = self._pending
        self._kvs.update(published)
        self._pending = {}
        if future is not None and not future.done():
            future.set_result(published)

    def _on_timeout(self) -> None:
        self._timer = None
        if self._failed is None:
            missing = self.nodes - self._arrived
            self._fail(FenceTimeout(self._epoch, missing, self.timeout))

    def _fail(self, error: FenceError) -> None:
        self._failed = error
        self._cancel_timer()
        future, self._future = self._future, None
        if future is not None and not future.done():
            future.set_exception(error)
            # every waiter retrieves it; mark it retrieved for the no-waiter case
            future.exception()

    def _cancel_timer(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None


class FenceRegistry:
    """The fences this agent heads, by (allocation id, launch id)."""

    def __init__(self) -> None:
        self._fences: dict[tuple[str, str], FenceCoordinator] = {}

    def register(self, allocation_id: str, task_id: str, coordinator: FenceCoordinator) -> None:
        key = (allocation_id, task_id)
        if key in self._fences:
            raise ValueError(f"a fence for launch {task_id!r} of {allocation_id!r} is registered")
        self._fences[key] = coordinator

    def get(self, allocation_id: str, task_id: str) -> FenceCoordinator | None:
        return self._fences.get((allocation_id, task_id))

    def remove(self, allocation_id: str, task_id: str) -> FenceCoordinator | None:
        return self._fences.pop((allocation_id, task_id), None)

    def __len__(self) -> int:
        return len(self._fences)
