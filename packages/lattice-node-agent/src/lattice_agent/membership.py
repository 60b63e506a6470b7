"""Membership changes told to the application: the nodes file and SIGUSR2.

A reactive allocation grows and shrinks while it runs (the autoscaler's
``ScaleAllocation``). The agent of its head node (the first assigned node, where the
entrypoint runs) keeps ``$LATTICE_NODES_FILE`` (``<work_dir>/<alloc>/nodes``, one node
per line, replaced atomically) equal to the allocation's current node list, and when
that list changes while the job runs it sends ``SIGUSR2`` to the processes of the job's
process group that handle it (``SigCgt`` in ``/proc/<pid>/status``), so the application
re-reads the file (an MPI/elastic framework adds or drops ranks). Processes that do not
handle SIGUSR2 are not sent it: its default action would end them, and an application
that reads the file on its own terms must not be killed by a scale event. ``SIGUSR1``
stays the checkpoint protocol's signal.

The file is written before the job starts (the agent applies the desired state before
starting it), so the first read never misses; a restarted agent compares with the
file on disk, so a change made while it was away is still signalled. Pure decision
(:func:`plan`) plus a thin shell (:class:`Membership`).

Prepare to release: a scale-down of a checkpointable allocation first records the nodes
it will release (``ScalingStatus.releasing``) and asks the application to checkpoint
(a checkpoint hint, run by ``lattice_agent.checkpoint``). While that is pending the
agent keeps ``$LATTICE_RELEASING_FILE`` (``<work_dir>/<alloc>/releasing``) listing
those nodes, written before the checkpoint request goes out, so the application's
checkpoint handler can tell that these nodes are going (and, e.g., move their shards
first); the file is removed once the release is done or called off. The change itself
is then told as any other (nodes file + SIGUSR2).
"""

from __future__ import annotations

import logging
import os
import signal
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

from lattice_common.types import Allocation, AllocationReport, AllocationState

from lattice_agent.procgroup import signal_disposition, signal_members
from lattice_agent.spawn import NODES_FILE, RELEASING_FILE, agent_shell

log = logging.getLogger("lattice.agent.membership")

MEMBERSHIP_SIGNAL = signal.SIGUSR2
#: states in which the node list is the allocation's own (not a preemption leftover)
_LIVE = (AllocationState.RUNNING, AllocationState.STAGING)


@dataclass(frozen=True)
class Update:
    """Write ``nodes`` for ``allocation_id``; ``notify``: signal its job afterwards."""

    allocation_id: str
    nodes: tuple[str, ...]
    notify: bool


def plan(
    node_id: str,
    assigned: Mapping[str, Allocation],
    known: Mapping[str, tuple[str, ...] | None],
    running: Iterable[str],
) -> list[Update]:
    """What to write and whom to tell. ``known``: allocation id -> the node list last
    written (None: the file is missing or unreadable); ``running``: allocations whose
    job runs here. Only this node's head allocations; a job is told only of a change
    (a list different from one already written), never of the first write."""
    runs = set(running)
    out: list[Update] = []
    for aid, a in assigned.items():
        if a.state not in _LIVE or not a.assigned_nodes or a.assigned_nodes[0] != node_id:
            continue
        nodes = tuple(a.assigned_nodes)
        before = known.get(aid)
        if before == nodes:
            continue
        out.append(Update(aid, nodes, notify=before is not None and aid in runs))
    return out


def releasing(node_id: str, assigned: Mapping[str, Allocation]) -> dict[str, tuple[str, ...]]:
    """allocation id -> the nodes its pending scale-down will release, for the live
    allocations this node heads (empty tuple: none pending)."""
    out: dict[str, tuple[str, ...]] = {}
    for aid, a in assigned.items():
        if a.state not in _LIVE or not a.assigned_nodes or a.assigned_nodes[0] != node_id:
            continue
        st = a.scaling_status
        out[aid] = tuple(st.releasing) if st is not None else ()
    return out


def notify_group(pgid: int, signum: int = MEMBERSHIP_SIGNAL) -> int:
    """Send ``signum`` to the members of process group ``pgid`` that handle it (the
    agent's wrapper and entrypoint shell aside); how many were sent it."""
    d = signal_disposition(pgid, signum, agent_shell)
    return signal_members(pgid, d.catching, signum)


def read_nodes(path: Path) -> tuple[str, ...] | None:
    try:
        return tuple(line for line in path.read_text().splitlines() if line)
    except (OSError, UnicodeDecodeError):
        return None


def write_nodes(path: Path, nodes: Iterable[str]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("".join(f"{n}\n" for n in nodes))
    os.replace(tmp, path)


class Membership:
    """``sync(assigned, reports)`` after every desired state: nodes files written, jobs
    signalled. ``notify`` (process group -> processes signalled) is injectable."""

    def __init__(
        self,
        node_id: str,
        work_dir: Path,
        *,
        notify: Callable[[int], int] = notify_group,
    ) -> None:
        self.node_id = node_id
        self.work_dir = Path(work_dir)
        self.notify = notify
        self._known: dict[str, tuple[str, ...] | None] = {}
        self.signalled = 0  # jobs told of a change (for tests and logs)

    def path(self, alloc_id: str) -> Path:
        return self.work_dir / alloc_id / NODES_FILE

    def sync(self, assigned: Mapping[str, Allocation], reports: Iterable[AllocationReport]) -> None:
        for gone in set(self._known) - set(assigned):
            del self._known[gone]
        pids = {r.allocation_id: r.pid for r in reports if r.phase == "running" and r.pid > 0}
        known = {
            aid: self._known[aid] if aid in self._known else read_nodes(self.path(aid))
            for aid in assigned
        }
        for u in plan(self.node_id, assigned, known, pids):
            try:
                write_nodes(self.path(u.allocation_id), u.nodes)
            except OSError as e:
                log.warning("allocation %s: cannot write its nodes file: %s", u.allocation_id, e)
                continue
            self._known[u.allocation_id] = u.nodes
            if not u.notify:
                continue
            sent = self.notify(pids[u.allocation_id])
            self.signalled += sent
            log.info(
                "allocation %s: nodes now %s; SIGUSR2 to %d of its processes",
                u.allocation_id,
                ",".join(u.nodes),
                sent,
            )
        for aid in assigned:
            self._known.setdefault(aid, known.get(aid))
        self._sync_releasing(assigned)

    def _sync_releasing(self, assigned: Mapping[str, Allocation]) -> None:
        for aid, nodes in releasing(self.node_id, assigned).items():
            path = self.work_dir / aid / RELEASING_FILE
            try:
                if nodes:
                    if read_nodes(path) != nodes:
                        write_nodes(path, nodes)
                        log.info("allocation %s: preparing to release %s", aid, ",".join(nodes))
                else:
                    path.unlink(missing_ok=True)
            except OSError as e:
                log.warning("allocation %s: cannot update its releasing file: %s", aid, e)
