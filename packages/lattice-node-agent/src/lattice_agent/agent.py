"""The node agent's shell: register, heartbeat, follow the desired state, reconcile.

All decisions are in ``reconcile`` (pure) and the process work in ``ProcessRuntime``;
this module moves messages and time. Heartbeats go to the Raft leader (a follower
answers with a leader hint) every ``heartbeat_interval`` and immediately whenever an
allocation starts or exits, so completions reach the quorum without waiting.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from grpclib.exceptions import GRPCError
from grpclib.server import Server
from lattice_common.agents import AgentChannels
from lattice_common.config import CheckpointConfig, StorageConfig, TelemetryConfig
from lattice_common.errors import LatticeError
from lattice_common.proto.lattice import v1
from lattice_common.rpc import TRANSPORT_ERRORS, Endpoints, auth_metadata, decode_grpc_error
from lattice_common.types import (
    Allocation,
    AllocationReport,
    AllocationState,
    Node,
    NodeCapabilities,
)
from lattice_common.wire import from_message, to_message
from prometheus_client import Gauge, Histogram

from lattice_agent.attach import AttachManager
from lattice_agent.backoff import MAX_DELAY, Backoff
from lattice_agent.cgroups import CgroupManager
from lattice_agent.checkpoint import CheckpointManager
from lattice_agent.checkpoint.remote import STAGING_DIR as CHECKPOINT_STAGING_DIR
from lattice_agent.checkpoint.remote import RemoteCheckpoints
from lattice_agent.checkpoint.remote import is_remote as is_remote_checkpoint_root
from lattice_agent.checkpoint.remote import open_store as open_checkpoint_store
from lattice_agent.hydra import HydraSockets
from lattice_agent.identity import IdentityPolicy
from lattice_agent.lifecycle import REASON_PREEMPTED
from lattice_agent.logship import LogPools  # log store: ordinary / sensitive pool
from lattice_agent.membership import Membership
from lattice_agent.pmi.fence import FenceRegistry
from lattice_agent.pmi.launches import LaunchManager
from lattice_agent.probes import REASON_LIVENESS_PROBE_FAILED, ProbeManager
from lattice_agent.prologue import PrologueManager
from lattice_agent.reconcile import Checkpoint, Forget, Start, Stop, attempt, reconcile
from lattice_agent.runtime import ProcessRuntime
from lattice_agent.scratch import Scratch, ScratchError, default_root
from lattice_agent.service import NodeAgentService, require_token
from lattice_agent.telemetry import running_targets, telemetry_loop
from lattice_agent.telemetry.fileaudit import FileAudit, node_service_report
from lattice_agent.telemetry.samples import MODE_AUDIT
from lattice_agent.telemetry.traces import TraceWriter  # debug traces
from lattice_agent.tls_identity import AgentTls
from lattice_agent.uenv import UenvCache

if TYPE_CHECKING:
    from lattice_common.logstore import LogStore  # log store (lattice_agent.logship)

    from lattice_agent.oci import OciStore

log = logging.getLogger("lattice.agent")

HEARTBEAT_LATENCY = Histogram(
    "lattice_agent_heartbeat_latency_seconds", "Heartbeat round-trip time", ["node_id"]
)
LAST_HEARTBEAT = Gauge(
    "lattice_agent_last_heartbeat_timestamp",
    "Unix time of the last heartbeat the quorum answered",
    ["node_id"],
)
STARTUP = Histogram(
    "lattice_agent_allocation_startup_seconds",
    "Time from allocation assignment to process start",
    ["node_id"],
    buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10),
)


class Agent:
    def __init__(
        self,
        *,
        node_id: str,
        endpoints: Endpoints,
        capabilities: NodeCapabilities,
        hostname: str,
        group: int = 0,
        conformance_group: str = "",
        home_vcluster: str = "",
        work_dir: Path,
        log_dir: Path,
        state_file: Path,
        listen_host: str = "127.0.0.1",
        listen_port: int = 0,
        advertise_host: str = "",
        heartbeat_interval: float = 10.0,
        walltime_grace: float = 30.0,
        ring_buffer_lines: int = 10000,
        token: str | None = None,
        fingerprint_source: Callable[[], str] | None = None,
        conformance_interval: float = 6 * 3600.0,
        pmi_fence_timeout: float = 60.0,
        pmi_tree_fanout: int = 128,
        slurm_env: bool = True,
        cgroups: CgroupManager | None = None,
        uenv: UenvCache | None = None,
        oci: OciStore | None = None,
        prologue_script: str = "",
        epilogue_script: str = "",
        prologue_timeout: float = 300.0,
        identities: IdentityPolicy | None = None,
        scratch: Scratch | None = None,
        tls: AgentTls | None = None,
        telemetry: TelemetryConfig | None = None,
        log_store: LogStore | None = None,  # log store: where output is flushed
        log_flush_interval: float = 10.0,  # log store: storage.log_flush_interval_seconds
        sensitive_log_store: LogStore | None = None,  # log store: the encrypted pool
        checkpoint: CheckpointConfig | None = None,  # checkpoints: root, timeout, deferral
        checkpoint_storage: StorageConfig | None = None,  # checkpoints: an s3:// root's endpoint
    ) -> None:
        self.node_id = node_id
        # mTLS identity (lattice_agent.tls_identity); None = plaintext with the token
        self.tls = tls
        # who allocations run as (None: the agent itself) and their scratch directories;
        # the runtime, task launches and attach share both
        identities = identities if identities is not None else IdentityPolicy(node_id=node_id)
        self.scratch = scratch if scratch is not None else Scratch(default_root(work_dir))
        self.endpoints = endpoints
        self.capabilities = capabilities
        self.hostname = hostname
        self.group = group
        # the conformance fingerprint this node reports (its conformance group);
        # fingerprint_source recomputes it every conformance_interval seconds
        self.conformance_group = conformance_group
        self.fingerprint_source = fingerprint_source
        self.conformance_interval = conformance_interval
        self.home_vcluster = home_vcluster
        self.listen_host = listen_host
        self.listen_port = listen_port
        self.advertise_host = advertise_host or (
            listen_host if listen_host not in ("0.0.0.0", "") else hostname
        )
        self.heartbeat_interval = heartbeat_interval
        self.metadata = auth_metadata(token)
        self.token = token
        self.log_dir = log_dir
        # liveness probes of the service allocations this node heads
        self.probes = ProbeManager(node_id, on_failed=self._on_probe_failed)
        # log store: which pool each allocation's output goes to (sensitive: encrypted)
        log_pools = (
            LogPools(
                log_store,
                sensitive_log_store,
                node_id=node_id,
                classify=self._classify_sensitive,
            )
            if log_store is not None or sensitive_log_store is not None
            else None
        )
        self.runtime = ProcessRuntime(
            node_id=node_id,
            work_dir=work_dir,
            log_dir=log_dir,
            state_file=state_file,
            walltime_grace_seconds=walltime_grace,
            ring_buffer_lines=ring_buffer_lines,
            log_store=log_store,  # log store
            log_flush_interval=log_flush_interval,  # log store
            log_pools=log_pools,  # log store: ordinary / sensitive per allocation
            on_change=self._on_runtime_change,
            slurm_env=slurm_env,
            cgroups=cgroups,
            uenv=uenv,
            oci=oci,
            identities=identities,
            scratch=self.scratch,
            checkpoint_env=lambda a, d: self.checkpoints.environment(a, d),  # checkpoints
        )
        # checkpoints of the allocations this node heads (lattice_agent.checkpoint)
        ck = checkpoint if checkpoint is not None else CheckpointConfig()
        remote = (  # checkpoints: an s3:// root, written through staging on this node
            RemoteCheckpoints(
                open_checkpoint_store(ck.checkpoint_root, checkpoint_storage),
                Path(work_dir).absolute() / CHECKPOINT_STAGING_DIR,
            )
            if is_remote_checkpoint_root(ck.checkpoint_root)
            else None
        )
        self.checkpoints = CheckpointManager(
            self.runtime,
            node_id=node_id,
            work_dir=work_dir,
            remote=remote,
            root=Path(ck.checkpoint_root),
            timeout=ck.checkpoint_timeout_seconds,
            max_deferral=ck.max_deferral_seconds,
            identities=identities,
            on_result=self._beat_now_set,
        )
        # the uenv image cache (also served to `lattice cache` by NodeAgentService)
        self.uenv = uenv
        # prologues of Staging allocations (uenv/image fetch, site hook), epilogues
        self.prologues = PrologueManager(
            node_id,
            uenv=uenv,
            oci=oci,
            script=prologue_script,
            epilogue_script=epilogue_script,
            timeout=prologue_timeout,
            on_result=self._beat_now_set,
        )
        #: the allocations the desired state assigns to this node, by id
        self.assigned: dict[str, Allocation] = {}
        self.agents = AgentChannels(token, ssl=tls.peer if tls is not None else None)
        if tls is not None:  # after a renewal, new connections present the new certificate
            tls.on_renewed += [endpoints.renewed, self.agents.renewed]
        self.fences = FenceRegistry()
        self.launches = LaunchManager(
            node_id,
            allocation=self.assigned.get,
            work_dir=work_dir,
            log_dir=log_dir,
            channels=self.agents,
            fences=self.fences,
            fence_timeout=pmi_fence_timeout,
            tree_fanout=pmi_tree_fanout,
            slurm_env=slurm_env,
            identities=identities,
            scratch=self.scratch,
        )
        # per-allocation sockets for lattice-mpi-launcher (mpirun without ssh)
        self.hydra = HydraSockets(
            node_id,
            work_dir=work_dir,
            launches=self.launches,
            channels=self.agents,
            address_of=self._agent_address,
            allocation=self.assigned.get,
            identities=identities,
        )
        # membership changes (reactive scaling): $LATTICE_NODES_FILE and SIGUSR2
        self.membership = Membership(node_id, work_dir)
        # interactive terminals (lattice attach) in the allocations of this node
        self.attaches = AttachManager(
            node_id,
            allocation=self.assigned.get,
            work_dir=work_dir,
            log_dir=log_dir,
            identities=identities,
            scratch=self.scratch,
        )
        # --- telemetry (lattice_agent.telemetry): per-allocation /proc + cgroup collection
        # every second, prod/debug aggregation, push to telemetry.tsdb_endpoint if set
        self.telemetry = telemetry_loop(
            telemetry if telemetry is not None else TelemetryConfig(),
            targets=lambda: running_targets(
                node_id, self.assigned, self.runtime.reports(), cgroups, self._task_groups()
            ),
            cgroups=cgroups,
            # modes survive an agent restart
            modes_file=state_file.with_name(state_file.stem + ".telemetry.json"),
        )
        # debug traces: debug-mode raw samples into the log store beside the logs
        self.traces = (
            TraceWriter(
                log_pools,
                node_id=node_id,
                allocation=self.assigned.get,
                interval=log_flush_interval,
            )
            if log_pools is not None
            else None
        )
        if self.traces is not None:
            self.telemetry.on_raw = self.traces.offer
        # audit mode's file-access events (eBPF), shipped to the audit log
        self.fileaudit = FileAudit(
            node_id,
            mode_of=self.telemetry.mode,
            set_audit=lambda aid: self.telemetry.set_mode(aid, MODE_AUDIT),
            assigned=lambda: list(self.assigned),
            targets=lambda: running_targets(
                node_id, self.assigned, self.runtime.reports(), cgroups, self._task_groups()
            ),
            report=node_service_report(
                self._stub, node_id, ready=lambda: self._registered.is_set()
            ),
        )
        self.attempts: dict[str, int] = {}
        self._checkpointing: set[str] = set()
        self.generation = 0
        # allocation -> whether the node was claimed (sensitive) while it was assigned
        # here, from the desired-state stream; the log pools ask the quorum otherwise
        self._claimed_while: dict[str, bool] = {}
        # heartbeat sequence: +1 per heartbeat, starting from the wall clock in ms, so that
        # a restarted agent continues above its previous process. A registration resets
        # the sequence only on the member that served it; the leader refuses anything at
        # or below the last sequence it accepted ("replayed") when the agent registered
        # again through a follower.
        self.sequence = time.time_ns() // 1_000_000
        self._beat_now = asyncio.Event()
        self._stopping: set[str] = set()
        self._tasks: set[asyncio.Task[None]] = set()
        self._registered = asyncio.Event()
        self._server: Server | None = None
        self.address = ""

    # --- lifecycle ------------------------------------------------------------------

    def _task_groups(self) -> dict[str, list[int]]:
        """Process groups of allocations beside their batch script: launched ranks and
        attach sessions (telemetry counts them too)."""
        groups = self.launches.process_groups()
        for aid, pgids in self.attaches.process_groups().items():
            groups.setdefault(aid, []).extend(pgids)
        return groups

    async def run(self) -> None:
        reattached = await self.runtime.recover()
        if reattached:
            log.info("reattached to running allocations: %s", ", ".join(reattached))
        self._server = Server(
            [
                NodeAgentService(
                    self.node_id,
                    self.runtime,
                    self.log_dir,
                    fences=self.fences,
                    launches=self.launches,
                    attaches=self.attaches,
                    uenv=self.uenv,
                    telemetry=self.telemetry,  # lattice watch, lattice telemetry
                    allocation=self.assigned.get,
                )
            ]
        )
        tls = self.tls
        require_token(self._server, self.token, tls.tls.site if tls is not None else "")
        server_ssl = tls.server if tls is not None else None
        await self._server.start(self.listen_host, self.listen_port, ssl=server_ssl)
        port = self._server._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        self.address = f"{self.advertise_host}:{port}"
        tasks = [
            asyncio.create_task(self._register_loop(), name="register"),
            asyncio.create_task(self._heartbeat_loop(), name="heartbeat"),
            asyncio.create_task(self._desired_loop(), name="desired-state"),
            asyncio.create_task(self.telemetry.run(), name="telemetry"),  # telemetry
            asyncio.create_task(self.fileaudit.run(), name="file-audit"),
        ]
        if self.traces is not None:  # debug traces
            tasks.append(asyncio.create_task(self.traces.run(), name="debug-traces"))
        if self.fingerprint_source is not None:
            tasks.append(asyncio.create_task(self._conformance_loop(), name="conformance"))
        if tls is not None and tls.renewable:
            renew = tls.renew_loop(self.endpoints, self.metadata)
            tasks.append(asyncio.create_task(renew, name="certificate-renewal"))
        try:
            await asyncio.gather(*tasks)
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            self._server.close()
            await self.hydra.close()
            await self.attaches.close()
            await self.probes.close()
            await self.prologues.close()
            await self.checkpoints.close()  # checkpoints: coordinators, sockets
            await self.launches.close()  # ranks cannot outlive their PMI server
            await self.runtime.close()  # workloads keep running (KillMode=process)
            self.endpoints.close()
            self.agents.close()

    def _stub(self) -> v1.NodeServiceStub:
        return v1.NodeServiceStub(self.endpoints.channel(), metadata=self.metadata)

    async def _classify_sensitive(self, alloc_id: str) -> bool:
        """Whether an allocation here is sensitive (its logs go to the encrypted pool):
        sensitive work claims the nodes it is assigned, and the claim outlives it."""
        known = self._claimed_while.get(alloc_id)
        if known is not None:
            return known
        node = await self._stub().get_node(v1.GetNodeRequest(id=self.node_id), timeout=10)
        return bool(node.claimed_by)

    async def _agent_address(self, node_id: str) -> str:
        node = await self._stub().get_node(v1.GetNodeRequest(id=node_id), timeout=10)
        return node.agent_address

    def _on_runtime_change(self, report: AllocationReport) -> None:
        # an exit must reach the quorum at once; a start is already known there
        if report.phase != "running":
            self._beat_now.set()
        self._sync_probes()

    def _beat_now_set(self) -> None:
        self._beat_now.set()

    def _sync_probes(self) -> None:
        with contextlib.suppress(RuntimeError):  # no running loop: nothing to probe yet
            asyncio.get_running_loop()
            self.probes.sync(self.assigned, self.runtime.running_ids())

    def _on_probe_failed(self, alloc_id: str) -> None:
        # failure_threshold consecutive failures: the exit report carries the reason
        self._spawn_stop(alloc_id, REASON_LIVENESS_PROBE_FAILED)

    # --- registration -----------------------------------------------------------------

    async def register(self) -> None:
        node = Node(
            id=self.node_id,
            hostname=self.hostname,
            capabilities=self.capabilities,
            group=self.group,
            conformance_group=self.conformance_group,
            agent_address=self.address,
            home_vcluster=self.home_vcluster,
        )
        await self._stub().register_node(
            v1.RegisterNodeRequest(node=to_message(node, v1.Node)), timeout=10
        )
        self._registered.set()
        log.info("registered node %s (agent at %s)", self.node_id, self.address)

    async def _register_loop(self) -> None:
        delay = 0.2
        while not self._registered.is_set():
            try:
                await self.register()
                return
            except (GRPCError, *TRANSPORT_ERRORS) as e:
                log.warning(
                    "registration via %s failed (%s); retrying", self.endpoints.current, _why(e)
                )
                self.endpoints.rotate()
                await asyncio.sleep(delay)
                delay = min(delay * 2, 5.0)

    # --- heartbeats -----------------------------------------------------------------

    async def heartbeat(self) -> None:
        self.sequence += 1
        # checkpoints: an exit explained by a checkpoint outcome is reported as that
        reports = self.checkpoints.reports(self.runtime.reports()) + self.prologues.reports()
        t0 = time.perf_counter()
        resp = await self._stub().heartbeat(
            v1.HeartbeatRequest(
                node_id=self.node_id,
                sequence=self.sequence,
                allocations=[to_message(r, v1.AllocationReport) for r in reports],
                generation=self.generation,
                timestamp=time.time(),
                health=v1.HealthSummary(
                    conformance_fingerprint=self.conformance_group,
                    telemetry_sources=[s.name for s in self.telemetry.sources]
                    + self.fileaudit.notes(),
                ),
            ),
            timeout=10,
        )
        HEARTBEAT_LATENCY.labels(self.node_id).observe(time.perf_counter() - t0)
        LAST_HEARTBEAT.labels(self.node_id).set(time.time())
        if resp.leader_hint:
            log.info("not the leader; switching to %s", resp.leader_hint)
            self.endpoints.rotate(prefer=resp.leader_hint)
            self._beat_now.set()
        elif resp.reregister:
            await self.register()

    async def _heartbeat_loop(self) -> None:
        await self._registered.wait()
        # jittered and growing (all agents fail over at once), but never later than the
        # next heartbeat would have been: silence past the timeout costs the node's work
        backoff = Backoff(limit=min(MAX_DELAY, self.heartbeat_interval / 1.5))
        while True:
            try:
                await self.heartbeat()
            except (GRPCError, *TRANSPORT_ERRORS) as e:
                log.warning("heartbeat via %s failed (%s)", self.endpoints.current, _why(e))
                if not isinstance(e, GRPCError):
                    self.endpoints.rotate()
                await asyncio.sleep(backoff.next())
                continue
            backoff.reset()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._beat_now.wait(), self.heartbeat_interval)
            self._beat_now.clear()

    # --- conformance ------------------------------------------------------------------

    async def refresh_conformance(self) -> bool:
        """Recompute the fingerprint; True (and a heartbeat at once) when it changed."""
        if self.fingerprint_source is None:
            return False
        try:
            fp = await asyncio.to_thread(self.fingerprint_source)
        except Exception:
            log.exception("conformance fingerprint failed; keeping %s", self.conformance_group)
            return False
        if not fp or fp == self.conformance_group:
            return False
        log.warning(
            "conformance fingerprint changed: %s -> %s", self.conformance_group or "(none)", fp
        )
        self.conformance_group = fp
        self._beat_now.set()
        return True

    async def _conformance_loop(self) -> None:
        while True:
            await asyncio.sleep(self.conformance_interval)
            await self.refresh_conformance()

    # --- desired state ------------------------------------------------------------------

    async def _desired_loop(self) -> None:
        await self._registered.wait()
        # jittered and growing (all agents fail over at once), within a heartbeat interval
        backoff = Backoff(limit=min(MAX_DELAY, self.heartbeat_interval))
        while True:
            # the stream keeps its connection across certificate renewals (Endpoints.hold)
            channel = self.endpoints.hold()
            stub = v1.NodeServiceStub(channel, metadata=self.metadata)
            try:
                async for ds in stub.watch_desired_state(
                    v1.WatchDesiredStateRequest(
                        node_id=self.node_id, known_generation=self.generation
                    )
                ):
                    backoff.reset()
                    await self.apply_desired(
                        ds.generation,
                        [from_message(a, Allocation) for a in ds.allocations],
                        claimed_by=ds.claimed_by,
                    )
            except asyncio.CancelledError:
                raise
            except (GRPCError, *TRANSPORT_ERRORS, LatticeError) as e:
                log.warning(
                    "desired-state stream via %s lost (%s)", self.endpoints.current, _why(e)
                )
            finally:
                self.endpoints.release(channel)
            await asyncio.sleep(backoff.next())

    async def apply_desired(
        self, generation: int, desired: list[Allocation], *, claimed_by: str | None = None
    ) -> None:
        """Act on the node's desired set. ``claimed_by``: the node's sensitive claim in
        the same read (None from a member that does not send it)."""
        if generation < self.generation:
            # older than what we already acted on (e.g. a member that is behind):
            # never stop or restart work because of it
            log.info("ignoring desired state generation %s < %s", generation, self.generation)
            return
        self.generation = generation
        self._note_claim(desired, claimed_by)
        # an allocation that leaves after Checkpointing was preempted: its terminals are
        # told so (they stay connected while it checkpoints)
        gone = set(self.assigned) - {a.id for a in desired}
        preempted = {aid: REASON_PREEMPTED for aid in gone & self._checkpointing}
        self._checkpointing = {a.id for a in desired if a.state == AllocationState.CHECKPOINTING}
        self.assigned.clear()
        self.assigned.update((a.id, a) for a in desired)
        self.launches.end_allocations(set(self.assigned))
        self.attaches.end_allocations(set(self.assigned), preempted)
        self._wipe_scratch_of(gone)
        await self.hydra.sync(self.assigned)
        self.membership.sync(self.assigned, self.runtime.reports())
        self.prologues.sync(self.assigned)
        await self.checkpoints.sync(self.assigned)  # checkpoints: registry sockets
        actions = reconcile(self.node_id, desired, self.runtime.reports(), self.attempts)
        for act in actions:
            if isinstance(act, Stop):
                if act.keep:  # its end must reach the quorum: stop in the background
                    self._spawn_stop(act.allocation_id, act.reason)
                    continue
                await self.runtime.stop(act.allocation_id, reason=act.reason)
                self.runtime.forget(act.allocation_id)
                self.attempts.pop(act.allocation_id, None)
            elif isinstance(act, Forget):
                self.runtime.forget(act.allocation_id)
                self.attempts.pop(act.allocation_id, None)
            elif isinstance(act, Checkpoint) and act.hint_id:  # the broker's: and continue
                self.checkpoints.begin_hint(act.allocation, act.hint_id)
            elif isinstance(act, Checkpoint):  # checkpoints: through its protocol
                self.checkpoints.begin(act.allocation)
            elif isinstance(act, Start):
                a = act.allocation
                self.attempts[a.id] = attempt(a)
                await self.checkpoints.prepare(a)  # checkpoints: a stored one to resume from
                await self.runtime.start(a, nodelist=list(a.assigned_nodes))
                if a.started_at:
                    STARTUP.labels(self.node_id).observe(max(0.0, time.time() - a.started_at))
        self._sync_probes()

    def _note_claim(self, desired: list[Allocation], claimed_by: str | None) -> None:
        """Remember whether each allocation here is sensitive: the claim is taken in the
        same command that assigns sensitive work, and it outlives the allocation."""
        held = {r.allocation_id for r in self.runtime.reports()}
        for alloc_id in set(self._claimed_while) - held - {a.id for a in desired}:
            del self._claimed_while[alloc_id]
        if claimed_by is None:
            return
        for a in desired:
            # once sensitive, always: a released claim never makes earlier output ordinary
            self._claimed_while[a.id] = self._claimed_while.get(a.id, False) or bool(claimed_by)

    def _wipe_scratch_of(self, gone: set[str]) -> None:
        """Scratch that task launches or attach made for allocations that left this node;
        the runtime wipes that of the allocations it runs itself at their reap."""
        held = {r.allocation_id for r in self.runtime.reports()}
        for alloc_id in gone - held:

            def wipe(alloc_id: str = alloc_id) -> None:
                try:
                    self.scratch.wipe(alloc_id)
                except (ScratchError, ValueError) as e:
                    log.warning("allocation %s: %s", alloc_id, e)

            task = asyncio.create_task(asyncio.to_thread(wipe), name=f"wipe-{alloc_id}")
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    def _spawn_stop(self, alloc_id: str, reason: str) -> None:
        if alloc_id in self._stopping:
            return
        self._stopping.add(alloc_id)

        async def stop() -> None:
            try:
                await self.runtime.stop(alloc_id, reason=reason)
            finally:
                self._stopping.discard(alloc_id)

        task = asyncio.create_task(stop(), name=f"stop-{alloc_id}")
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)


def _why(e: BaseException) -> str:
    if isinstance(e, GRPCError):
        return decode_grpc_error(e).message
    return str(e) or type(e).__name__
