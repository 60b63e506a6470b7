"""The agent's task launches: LaunchProcesses, WatchLaunch and Abort behind NodeAgentService.

One :class:`AgentLaunch` per launch on this node runs a
:class:`~lattice_agent.pmi.server.LocalLaunch` for the node's ranks and keeps its
events (rank output, rank exits, this node's end) from the start, so a watcher that
connects late misses nothing; a finished launch is kept ``retain_seconds``.

Multi-node launches:

* the fence goes through :class:`~lattice_agent.pmi.fence.LaunchFence` (star, or a
  two-level tree above ``tree_fanout`` nodes) over PmiFence calls between agents;
* an abort that starts here (MPI_Abort, a failed rank, a fence timeout) is sent to
  every peer with Abort, carrying the status, rank, node and reason, so that every
  node ends with the same status;
* the head (rank 0's node) follows every peer's WatchLaunch and every peer follows
  the head: a stream that breaks before that node's end means its agent is gone,
  and the launch is aborted everywhere, naming the node;
* ranks die with their agent (``PR_SET_PDEATHSIG``), since the PMI server does.

Ranks run as the allocation's user (``identities``), with its scratch directory
(``LATTICE_SCRATCH``/``TMPDIR``, made here when this node has none yet).

Ranks of an allocation that leaves this node's desired state are killed
(:meth:`LaunchManager.end_allocations`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import time
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from grpclib.const import Status
from grpclib.exceptions import GRPCError, StreamTerminatedError
from lattice_common.agents import AgentChannels
from lattice_common.errors import (
    AlreadyExists,
    InvalidTransition,
    NotFound,
    Unimplemented,
    ValidationError,
)
from lattice_common.proto.lattice import v1
from lattice_common.types import Allocation

from lattice_agent.identity import IdentityError, IdentityPolicy, RunAs
from lattice_agent.pmi.fence import FenceRegistry, LaunchFence
from lattice_agent.pmi.server import (
    FENCE_TIMEOUT_REASON,
    LaunchResult,
    LocalLaunch,
    OutputLine,
    local_fence,
)
from lattice_agent.pmi.tree import fence_topology
from lattice_agent.pmi.wire import PmiProtocolError, decode_kvs, encode_kvs
from lattice_agent.scratch import Scratch, ScratchError, default_root
from lattice_agent.spawn import AllocPaths, environment, working_dir

log = logging.getLogger("lattice.agent.launch")

__all__ = ["PMI_MODES", "AgentLaunch", "LaunchManager"]

#: LaunchProcessesRequest.mpi values: "" / pmi1 / pmi2 = the agent's PMI server
#: (the flavour is detected from the first message), none = no PMI, pmix = sidecar
PMI_MODES = ("", "pmi1", "pmi2", "pmix", "none")
#: Events kept per launch for late watchers (older output is dropped first)
MAX_EVENTS = 100_000
#: A peer whose launch stream stays broken this long is declared lost
PEER_LOST_AFTER = 5.0
_TASK_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")


@dataclass
class AgentLaunch:
    """One launch's ranks on this node and what happened to them."""

    request: v1.LaunchProcessesRequest
    node_ids: list[str]
    addresses: dict[str, str]
    local: LocalLaunch | None = None
    fence: LaunchFence | None = None
    events: list[v1.LaunchEvent] = field(default_factory=list)
    dropped: int = 0
    changed: asyncio.Event = field(default_factory=asyncio.Event)
    finished: bool = False
    #: set when an abort arrived from another node (it is not sent on again)
    origin_node: str = ""
    result: v1.LaunchDone | None = None
    #: peer followers, cancelled when the launch ends here
    tasks: list[asyncio.Task[None]] = field(default_factory=list)
    #: aborts on their way to peers, left to finish
    sends: list[asyncio.Task[None]] = field(default_factory=list)

    @property
    def key(self) -> tuple[str, str]:
        return (self.request.allocation_id, self.request.task_id)

    def emit(self, event: v1.LaunchEvent) -> None:
        self.events.append(event)
        if len(self.events) > MAX_EVENTS:
            drop = len(self.events) - MAX_EVENTS
            del self.events[:drop]
            self.dropped += drop
        changed, self.changed = self.changed, asyncio.Event()
        changed.set()


def pmix_refusal(node_id: str) -> Unimplemented:
    """Why a ``--pmi=pmix`` launch cannot run here, naming what is missing."""
    import ctypes.util
    import shutil

    library = ctypes.util.find_library("pmix")
    server = shutil.which("pmix_server") or shutil.which("prte")
    if library is None:
        return Unimplemented(
            f"node {node_id} cannot serve PMIx launches: OpenPMIx (libpmix) is not installed",
            hint="Install OpenPMIx on the nodes (Debian: libpmix-dev libpmix-bin), or launch "
            "with --pmi=pmi2 (MPICH, Cray MPICH; OpenMPI with OMPI_MCA_pmix=pmi2).",
        )
    return Unimplemented(
        f"node {node_id} has OpenPMIx ({library}"
        + (f", {server}" if server else "")
        + ") but this agent has no PMIx sidecar to serve it",
        hint="Launch with --pmi=pmi2: MPICH and Cray MPICH speak it natively, OpenMPI "
        "with OMPI_MCA_pmix=pmi2.",
    )


class LaunchManager:
    """Every launch this agent runs ranks for, by (allocation id, launch id)."""

    def __init__(
        self,
        node_id: str,
        *,
        allocation: Callable[[str], Allocation | None],
        work_dir: Path,
        log_dir: Path,
        channels: AgentChannels,
        fences: FenceRegistry,
        fence_timeout: float = 60.0,
        tree_fanout: int = 128,
        slurm_env: bool = True,
        retain_seconds: float = 600.0,
        peer_lost_after: float = PEER_LOST_AFTER,
        identities: IdentityPolicy | None = None,
        scratch: Scratch | None = None,
    ) -> None:
        self.node_id = node_id
        # who ranks run as: the allocation's user (None: the agent itself)
        self.identities = identities if identities is not None else IdentityPolicy()
        self.scratch = scratch if scratch is not None else Scratch(default_root(work_dir))
        self._allocation = allocation
        self.work_dir = work_dir
        self.log_dir = log_dir
        self.channels = channels
        self.fences = fences
        self.fence_timeout = fence_timeout
        self.tree_fanout = tree_fanout
        self.slurm_env = slurm_env
        self.retain_seconds = retain_seconds
        self.peer_lost_after = peer_lost_after
        self._launches: dict[tuple[str, str], AgentLaunch] = {}
        #: aborts that arrived before their LaunchProcesses (the fan-out is parallel)
        self._early_aborts: dict[tuple[str, str], v1.AbortRequest] = {}
        self._closing = False

    # ------------------------------------------------------------------ LaunchProcesses

    async def launch(self, req: v1.LaunchProcessesRequest) -> list[int]:
        """Start this node's ranks of a launch; the pids in rank order."""
        node_ids, addresses, ranks_per_node = self._check(req)
        key = (req.allocation_id, req.task_id)
        if key in self._launches:
            raise AlreadyExists(f"launch {req.task_id} of {req.allocation_id} exists on this node")
        early = self._early_aborts.pop(key, None)
        if early is not None:
            raise InvalidTransition(
                f"launch {req.task_id} was aborted before it started here: {early.reason}"
            )
        alloc = self._allocation(req.allocation_id)
        if alloc is None:
            raise NotFound(
                f"allocation {req.allocation_id} is not running on node {self.node_id}",
                hint="Tasks launch only inside a Running allocation, on its nodes.",
            )
        try:
            run_as = self.identities.run_as(alloc)
            scratch = self.scratch.ensure(alloc.id, run_as)
            cwd = self._cwd(req, alloc, run_as, scratch)
        except IdentityError as e:
            raise ValidationError(e.message, hint=e.hint) from None
        except ScratchError as e:
            raise ValidationError(f"launch {req.task_id} of {alloc.id}: {e}") from None
        al = AgentLaunch(request=req, node_ids=node_ids, addresses=addresses)
        use_pmi = req.mpi != "none"
        fence = local_fence
        timeout = req.fence_timeout_seconds or self.fence_timeout
        if use_pmi and len(node_ids) > 1:
            topology = fence_topology(node_ids, req.tree_fanout or self.tree_fanout)
            al.fence = LaunchFence(topology, self.node_id, timeout, self._sender(al, timeout))
            fence = al.fence.fence
            if al.fence.collects:
                self.fences.register(req.allocation_id, req.task_id, al.fence)
        first = req.first_rank
        al.local = LocalLaunch(
            list(req.argv),
            range(first, first + req.local_tasks),
            req.world_size,
            launch_id=req.task_id,
            env=self._environment(req, alloc, node_ids, run_as, scratch),
            cwd=cwd,
            fence=fence,
            fence_timeout=timeout,
            ranks_per_node=ranks_per_node,
            on_output=lambda line: self._on_output(al, line),
            on_rank_exit=lambda rank, code: al.emit(
                v1.LaunchEvent(
                    node_id=self.node_id, rank_exit=v1.RankExit(rank=rank, exit_code=code)
                )
            ),
            on_abort=lambda rank, status, reason: self._on_abort(al, rank, status, reason),
            pmi=use_pmi,
            slurm_env=self.slurm_env,
            run_as=run_as,
        )
        al.emit(
            v1.LaunchEvent(
                node_id=self.node_id,
                start=v1.LaunchStart(
                    task_id=req.task_id,
                    node_ids=node_ids,
                    ranks_per_node=ranks_per_node,
                    world_size=req.world_size,
                ),
            )
        )
        self._launches[key] = al
        run = asyncio.create_task(self._run(al), name=f"launch-{req.task_id}")
        al.tasks.append(run)
        await al.local.spawned.wait()
        if len(node_ids) > 1:
            peers = node_ids[1:] if self.node_id == node_ids[0] else [node_ids[0]]
            for peer in peers:
                if peer != self.node_id:
                    al.tasks.append(asyncio.create_task(self._follow_peer(al, peer)))
        log.info(
            "launch %s of %s: ranks %d..%d of %d started on %s",
            req.task_id,
            req.allocation_id,
            first,
            first + req.local_tasks - 1,
            req.world_size,
            self.node_id,
        )
        return [al.local.pids[r] for r in sorted(al.local.pids)]

    def _check(self, req: v1.LaunchProcessesRequest) -> tuple[list[str], dict[str, str], list[int]]:
        if not _TASK_ID.match(req.task_id):
            raise ValidationError(f"invalid launch id {req.task_id!r}")
        if not req.argv or not req.argv[0]:
            raise ValidationError("a launch needs a command")
        if req.mpi not in PMI_MODES:
            raise ValidationError(
                f"unknown PMI mode {req.mpi!r}", hint="Use pmi1, pmi2, pmix or none."
            )
        if req.mpi == "pmix":
            raise pmix_refusal(self.node_id)
        if req.world_size < 1 or req.local_tasks < 1 or req.first_rank < 0:
            raise ValidationError("world_size and local_tasks must be >= 1, first_rank >= 0")
        if req.first_rank + req.local_tasks > req.world_size:
            raise ValidationError(
                f"ranks {req.first_rank}..{req.first_rank + req.local_tasks - 1} "
                f"exceed world size {req.world_size}"
            )
        node_ids = list(req.node_ids) or [self.node_id]
        ranks_per_node = list(req.ranks_per_node) or [req.local_tasks]
        peers = list(req.peer_agents)
        if self.node_id not in node_ids:
            raise ValidationError(f"node {self.node_id} is not one of the launch's nodes")
        if len(set(node_ids)) != len(node_ids) or len(ranks_per_node) != len(node_ids):
            raise ValidationError("node_ids must be distinct, one ranks_per_node entry each")
        if len(node_ids) > 1 and len(peers) != len(node_ids):
            raise ValidationError("a multi-node launch needs one peer agent address per node")
        if sum(ranks_per_node) != req.world_size or min(ranks_per_node) < 1:
            raise ValidationError("ranks_per_node must be >= 1 each and add up to world_size")
        idx = node_ids.index(self.node_id)
        if ranks_per_node[idx] != req.local_tasks or sum(ranks_per_node[:idx]) != req.first_rank:
            raise ValidationError(
                f"node {self.node_id}'s ranks do not match the layout "
                f"(first_rank {req.first_rank}, local_tasks {req.local_tasks})"
            )
        return node_ids, dict(zip(node_ids, peers, strict=False)), ranks_per_node

    def _environment(
        self,
        req: v1.LaunchProcessesRequest,
        alloc: Allocation,
        node_ids: list[str],
        run_as: RunAs,
        scratch: Path,
    ) -> dict[str, str]:
        paths = AllocPaths.of(alloc.id, self.work_dir, self.log_dir)
        submit_dir = alloc.spec.submit_dir or str(paths.work_dir)
        env = environment(
            alloc,
            list(alloc.assigned_nodes),
            self.node_id,
            submit_dir,
            paths.work_dir,
            slurm_env=self.slurm_env,
            run_as=run_as,
            scratch=scratch,
        )
        nodelist = ",".join(node_ids)
        env.update(
            {
                "LATTICE_NODELIST": nodelist,
                "LATTICE_NNODES": str(len(node_ids)),
                "LATTICE_NPROCS": str(req.world_size),
            }
        )
        if self.slurm_env:
            env.update(
                {
                    "SLURM_NODELIST": nodelist,
                    "SLURM_STEP_NODELIST": nodelist,
                    "SLURM_STEP_NUM_NODES": str(len(node_ids)),
                    "SLURM_STEP_ID": req.task_id,
                }
            )
        if req.cxi is not None and req.cxi.auth_key:
            env.update(
                {
                    "FI_PROVIDER": "cxi",
                    "FI_CXI_DEFAULT_VNI": str(req.cxi.vni),
                    "FI_CXI_AUTH_KEY": req.cxi.auth_key,
                }
            )
        env.update(req.env)
        return env

    def _cwd(
        self, req: v1.LaunchProcessesRequest, alloc: Allocation, run_as: RunAs, scratch: Path
    ) -> str:
        """The launch's directory, else the submit directory, else the work directory
        (another user's: the scratch directory); one the user cannot enter is refused."""
        paths = AllocPaths.of(alloc.id, self.work_dir, self.log_dir)
        for candidate in (req.working_dir, alloc.spec.submit_dir):
            if candidate and Path(candidate).is_dir():
                return working_dir(candidate, paths, run_as, scratch)
        if req.working_dir:
            raise ValidationError(f"working directory {req.working_dir} does not exist")
        return working_dir("", paths, run_as, scratch)

    # ------------------------------------------------------------------ running

    async def _run(self, al: AgentLaunch) -> None:
        assert al.local is not None
        try:
            result = await al.local.run()
        finally:
            if al.fence is not None:
                al.fence.abort("the launch ended on node " + self.node_id)
                self.fences.remove(*al.key)
        al.result = self._node_done(al, result)
        al.finished = True
        al.emit(v1.LaunchEvent(node_id=self.node_id, node_done=al.result))
        for t in al.tasks:
            if t is not asyncio.current_task():
                t.cancel()
        log.info(
            "launch %s of %s ended on %s: status %d%s",
            al.request.task_id,
            al.request.allocation_id,
            self.node_id,
            result.exit_status,
            f" ({result.reason})" if result.reason else "",
        )
        if not self._closing:
            await asyncio.sleep(self.retain_seconds)
        self._launches.pop(al.key, None)

    def _node_done(self, al: AgentLaunch, result: LaunchResult) -> v1.LaunchDone:
        failed_node = ""
        if result.aborted:
            failed_node = al.origin_node or self.node_id
        elif result.exit_status != 0:
            failed_node = self.node_id
        failed_rank = result.abort_rank
        if failed_rank is None and not result.aborted and result.exit_status != 0:
            failed_rank = next(r for r, c in sorted(result.rank_exit_codes.items()) if c != 0)
        return v1.LaunchDone(
            exit_status=result.exit_status,
            aborted=result.aborted,
            reason=result.reason,
            failed_rank=-1 if failed_rank is None else failed_rank,
            failed_node=failed_node,
            rank_exit_codes=dict(result.rank_exit_codes),
            aborted_at=result.aborted_at,
        )

    def _on_output(self, al: AgentLaunch, line: OutputLine) -> None:
        al.emit(
            v1.LaunchEvent(
                node_id=self.node_id,
                output=v1.LaunchOutput(rank=line.rank, stream=line.stream, line=line.text),
            )
        )

    def _on_abort(self, al: AgentLaunch, rank: int | None, status: int, reason: str) -> None:
        """The first abort of this node's ranks; one that started here goes to every peer."""
        if al.origin_node or len(al.node_ids) < 2:
            return
        al.origin_node = self.node_id
        req = v1.AbortRequest(
            allocation_id=al.request.allocation_id,
            task_id=al.request.task_id,
            reason=reason,
            exit_status=status,
            failed_rank=-1 if rank is None else rank,
            failed_node=self.node_id,
        )
        for node in al.node_ids:
            if node != self.node_id:
                al.sends.append(asyncio.create_task(self._send_abort(al, node, req)))

    async def _send_abort(self, al: AgentLaunch, node: str, req: v1.AbortRequest) -> None:
        try:
            await self.channels.stub(al.addresses[node]).abort(req, timeout=10)
        except (GRPCError, StreamTerminatedError, OSError, TimeoutError, ValueError) as e:
            # that node notices on its own: its watch of the head breaks or its fence fails
            log.warning("could not send the abort of %s to %s: %s", req.task_id, node, e)

    def _sender(self, al: AgentLaunch, timeout: float):  # type: ignore[no-untyped-def]
        async def send(parent: str, epoch: int, puts: dict[str, str]) -> Mapping[str, str]:
            req = v1.PmiFenceRequest(
                allocation_id=al.request.allocation_id,
                task_id=al.request.task_id,
                epoch=epoch,
                node_id=self.node_id,
                kvs_json=encode_kvs(puts),
            )
            try:
                resp = await self.channels.stub(al.addresses[parent]).pmi_fence(
                    req, timeout=timeout
                )
            except GRPCError as e:
                if e.status == Status.DEADLINE_EXCEEDED:  # the coordinator names who is missing
                    raise TimeoutError(e.message or FENCE_TIMEOUT_REASON) from None
                raise RuntimeError(f"node {parent}: {e.message or e.status.name}") from None
            except (StreamTerminatedError, OSError) as e:
                raise RuntimeError(f"node {parent} unreachable: {e}") from None
            try:
                return decode_kvs(resp.kvs_json)
            except PmiProtocolError as e:
                raise RuntimeError(f"node {parent}: {e}") from None

        return send

    async def _follow_peer(self, al: AgentLaunch, peer: str) -> None:
        """Watch ``peer``'s side of the launch; its agent going away aborts the launch."""
        req = v1.WatchLaunchRequest(
            allocation_id=al.request.allocation_id, task_id=al.request.task_id
        )
        last_contact = time.monotonic()
        why = ""
        while not al.finished:
            try:
                async for ev in self.channels.stub(al.addresses[peer]).watch_launch(req):
                    last_contact = time.monotonic()
                    if ev.node_done is not None:
                        if ev.node_done.aborted and al.local is not None:
                            self._abort_from(al, ev.node_done)
                        return
                why = "its launch stream ended"
            except asyncio.CancelledError:
                raise
            except GRPCError as e:
                why = e.message or e.status.name
                if e.status == Status.NOT_FOUND:
                    # its LaunchProcesses may still be on the way (parallel fan-out)
                    why = "it does not know the launch"
            except (StreamTerminatedError, OSError, ValueError) as e:
                why = str(e) or type(e).__name__
            if time.monotonic() - last_contact > self.peer_lost_after:
                break
            await asyncio.sleep(0.2)
        if al.finished or al.local is None:
            return
        reason = f"node {peer} lost: its agent stopped answering ({why})"
        log.warning("launch %s: %s", al.request.task_id, reason)
        al.origin_node = al.origin_node or peer
        al.local.abort(1, reason)
        # tell the others (the head reaches every node; a peer reaches the head)
        self._spread(al, peer, reason)

    def _spread(self, al: AgentLaunch, lost: str, reason: str) -> None:
        req = v1.AbortRequest(
            allocation_id=al.request.allocation_id,
            task_id=al.request.task_id,
            reason=reason,
            exit_status=1,
            failed_rank=-1,
            failed_node=lost,
        )
        for node in al.node_ids:
            if node not in (self.node_id, lost):
                al.sends.append(asyncio.create_task(self._send_abort(al, node, req)))

    def _abort_from(self, al: AgentLaunch, done: v1.LaunchDone) -> None:
        assert al.local is not None
        if al.local.aborted:
            return
        al.origin_node = done.failed_node or al.origin_node or "?"
        rank = done.failed_rank if done.failed_rank >= 0 else None
        al.local.abort(done.exit_status or 1, done.reason, rank)

    # ------------------------------------------------------------------ WatchLaunch, Abort

    def process_groups(self) -> dict[str, list[int]]:
        """Allocation id -> the process groups of its ranks running here (each rank is
        started in a session of its own: pgid = pid), for telemetry attribution."""
        out: dict[str, list[int]] = {}
        for al in self._launches.values():
            if al.local is not None and not al.finished:
                out.setdefault(al.request.allocation_id, []).extend(al.local.pids.values())
        return out

    def get(self, allocation_id: str, task_id: str) -> AgentLaunch:
        al = self._launches.get((allocation_id, task_id))
        if al is None:
            raise NotFound(f"node {self.node_id} has no launch {task_id} of {allocation_id}")
        return al

    async def watch(self, allocation_id: str, task_id: str) -> AsyncIterator[v1.LaunchEvent]:
        """Every event of the launch on this node from its start, ending with node_done."""
        al = self.get(allocation_id, task_id)
        seen = 0
        while True:
            changed = al.changed
            start = max(seen, al.dropped)
            batch = al.events[start - al.dropped :]
            for ev in batch:
                yield ev
            seen = start + len(batch)
            if al.finished and seen >= al.dropped + len(al.events):
                return
            await changed.wait()

    def abort(self, req: v1.AbortRequest) -> int:
        """Kill a launch's ranks here (``task_id`` "" = every launch of the allocation)."""
        killed = 0
        status = req.exit_status if 1 <= req.exit_status <= 255 else 1
        reason = req.reason or "aborted"
        matched = False
        for (alloc_id, task_id), al in list(self._launches.items()):
            if alloc_id != req.allocation_id or (req.task_id and task_id != req.task_id):
                continue
            matched = True
            if al.local is None or al.finished or al.local.aborted:
                continue
            killed += len(al.local.pids)
            al.origin_node = req.failed_node or al.origin_node or "?"
            al.local.abort(status, reason, req.failed_rank if req.failed_rank >= 0 else None)
        if not matched and req.task_id:
            self._early_aborts[(req.allocation_id, req.task_id)] = req
        return killed

    def end_allocations(self, keep: set[str]) -> None:
        """Kill the ranks of allocations that no longer run on this node."""
        for (alloc_id, _), al in list(self._launches.items()):
            if alloc_id in keep or al.finished or al.local is None:
                continue
            al.origin_node = al.origin_node or self.node_id
            al.local.abort(1, f"allocation {alloc_id} ended on node {self.node_id}")
        self._early_aborts = {k: v for k, v in self._early_aborts.items() if k[0] in keep}

    async def close(self) -> None:
        """Kill every launch's ranks and wait for them (agent shutdown)."""
        self._closing = True
        runs = []
        for al in self._launches.values():
            if al.local is not None and not al.finished:
                al.local.abort(1, f"the agent on node {self.node_id} is stopping")
            runs.extend((*al.tasks, *al.sends))
        for t in runs:
            t.cancel()
        with contextlib.suppress(Exception):
            await asyncio.gather(*runs, return_exceptions=True)
        self._launches.clear()
