"""gRPC adapter of AllocationService: proto messages in, AllocationOps (task launches:
LaunchOps; DAGs: DagOps; attach: AttachOps; StreamMetrics and Update's telemetry mode:
TelemetryOps), proto out."""

from __future__ import annotations

import asyncio
import contextlib
import math
from collections.abc import AsyncIterator
from typing import Any

import grpclib
import msgspec
from grpclib.const import Status
from lattice_common.errors import ValidationError
from lattice_common.proto.lattice import v1
from lattice_common.wire import to_message

from lattice_api.grpc.context import to_body, who
from lattice_api.ops import checkpoint as ops_checkpoint
from lattice_api.ops import suspend as ops_suspend
from lattice_api.ops.allocations import AllocationOps
from lattice_api.ops.attach import AttachOps
from lattice_api.ops.compare import CompareOps
from lattice_api.ops.dags import DagOps
from lattice_api.ops.diag import DiagOps, diagnostics_message
from lattice_api.ops.launches import LaunchOps
from lattice_api.ops.metrics import MetricsOps
from lattice_api.ops.sessions import SessionOps, SessionView
from lattice_api.ops.telemetry import TelemetryOps


def dag_body(spec: v1.DagSpec) -> dict[str, Any]:
    """A DagSpec as the API form of a DAG body (what ``POST /api/v1/dags`` takes).
    proto3 cannot send an unset condition: an empty one is ``success``, the default."""
    members = []
    for m in spec.allocations:
        body = to_body(m.spec) if m.spec is not None else {}
        if "depends_on" in body:
            body["depends_on"] = [
                {"ref": d.get("ref", ""), "condition": d.get("condition") or "success"}
                for d in body["depends_on"]
            ]
        members.append({**body, "id": m.id})
    return {"name": spec.name, "allocations": members, "request_id": spec.request_id}


def _as_committed(allocations: list[Any], ids_only: bool) -> list[v1.Allocation]:
    """SubmitResponse.allocations: none when the caller asked for the ids alone (the
    conversion and the encoding of each record are most of a bulk submitter's answer)."""
    return [] if ids_only else [to_message(a, v1.Allocation) for a in allocations]


class AllocationService(v1.AllocationServiceBase):
    def __init__(
        self,
        ops: AllocationOps,
        launches: LaunchOps,
        dags: DagOps,
        attach: AttachOps | None = None,
        sessions: SessionOps | None = None,
        metrics: MetricsOps | None = None,
        telemetry: TelemetryOps | None = None,
    ) -> None:
        self.ops = ops
        self.metrics = metrics or MetricsOps(ops.quorum)
        self.telemetry = telemetry or TelemetryOps(ops.quorum, launches.agents)
        self.sessions = sessions or SessionOps(ops.quorum, ops)
        self.launches = launches
        self.dags = dags
        self.attaches = attach or AttachOps(launches.quorum, launches.agents)

    async def submit(self, message: v1.SubmitRequest) -> v1.SubmitResponse:
        if message.test_only:
            if message.allocation is None:
                raise ValidationError("a test-only submission takes a single allocation")
            est = self.ops.test_submit(who(), to_body(message.allocation))
            return v1.SubmitResponse(estimate=to_message(est, v1.StartEstimate))
        if message.task_group is not None and message.task_group.template is not None:
            tg = message.task_group
            body = to_body(tg.template)
            body["task_group"] = {
                "start": tg.range_start,
                "end": tg.range_end,
                "step": tg.step or 1,
                "concurrency": tg.concurrency,
            }
            res = await self.ops.submit_task_group(who(), body)
            tasks = res.allocations or []
            return v1.SubmitResponse(
                allocation_ids=[a.id for a in tasks], task_group_id=res.task_group_id
            )
        if message.dag is not None:
            res = await self.dags.submit(who(), dag_body(message.dag))
            return v1.SubmitResponse(
                dag_id=res.dag.id,
                allocation_ids=[a.id for a in res.allocations],
                allocations=_as_committed(res.allocations, message.ids_only),
            )
        if message.allocation is None:
            raise ValidationError(
                "Submit needs an allocation, a dag or a task_group",
                hint="Set one of SubmitRequest's allocation, dag or task_group.",
            )
        a = await self.ops.submit(who(), to_body(message.allocation))
        return v1.SubmitResponse(
            allocation_ids=[a.id], allocations=_as_committed([a], message.ids_only)
        )

    async def get(self, message: v1.GetAllocationRequest) -> v1.Allocation:
        # from the history store once it left the quorum (lattice_common.history)
        return to_message(await self.ops.find(who(), message.id), v1.Allocation)

    async def list(self, message: v1.ListAllocationsRequest) -> v1.ListAllocationsResponse:
        # the same listing rule as REST's ?all (lattice_api.access.listing_user)
        allocs = await self.ops.list_with_history(
            who(),
            state=message.state or None,
            tenant=message.tenant or None,
            vcluster=message.vcluster or None,
            user=message.user or None,
            all_users=message.all_users,
            limit=message.limit or None,
            task_group=message.task_group_id or None,
            ended_since=message.ended_since or None,
            ended_until=message.ended_until or None,
        )
        return v1.ListAllocationsResponse(
            allocations=[to_message(a, v1.Allocation) for a in allocs]
        )

    async def cancel(self, message: v1.CancelAllocationRequest) -> v1.Allocation:
        return to_message(await self.ops.cancel(who(), message.id), v1.Allocation)

    async def suspend(self, message: v1.SuspendAllocationRequest) -> v1.Allocation:
        # suspend / resume on demand (lattice_api.ops.suspend)
        return to_message(await ops_suspend.suspend(self.ops, who(), message.id), v1.Allocation)

    async def resume(self, message: v1.ResumeAllocationRequest) -> v1.Allocation:
        return to_message(await ops_suspend.resume(self.ops, who(), message.id), v1.Allocation)

    async def checkpoint(self, message: v1.CheckpointRequest) -> v1.CheckpointResponse:
        # checkpoint now and run on (lattice_api.ops.checkpoint); refusals raise
        a = await ops_checkpoint.checkpoint(self.ops, who(), message.id)
        hint = a.checkpoint_hint.id if a.checkpoint_hint is not None else ""
        return v1.CheckpointResponse(
            accepted=True,
            message=f"checkpoint {hint} asked of allocation {a.id}; it keeps running and "
            "the checkpoint becomes its last_checkpoint",
        )

    async def watch(self, message: v1.WatchAllocationsRequest) -> AsyncIterator[v1.AllocationEvent]:
        if not message.id:
            raise grpclib.GRPCError(
                Status.UNIMPLEMENTED,
                "AllocationService.Watch: watching all allocations is not implemented yet",
            )
        async for rev, a in self.ops.watch(who(), message.id):
            yield v1.AllocationEvent(revision=rev, allocation=to_message(a, v1.Allocation))

    async def get_logs(self, message: v1.GetLogsRequest) -> v1.GetLogsResponse:
        # the REST route's filters and paging (limit 0: no limit); one line more than
        # the limit is asked for to say whether more follow
        limit = message.limit if message.limit > 0 else None
        lines = await self.ops.logs(
            who(),
            message.allocation_id,
            tail=message.tail or None,
            stream=message.stream or "both",
            node=message.node_id or None,
            since=message.since,
            until=message.until,
            offset=message.offset or None,
            limit=None if limit is None else limit + 1,
        )
        truncated = limit is not None and len(lines) > limit
        return v1.GetLogsResponse(
            lines=[v1.LogLine(**ln) for ln in lines[:limit]], truncated=truncated
        )

    async def stream_logs(self, message: v1.StreamLogsRequest) -> AsyncIterator[v1.LogLine]:
        lines = self.ops.follow_logs(
            who(),
            message.allocation_id,
            tail=message.tail or None,
            stream=message.stream or "both",
            node=message.node_id or None,
        )
        async for ln in lines:
            yield v1.LogLine(**ln)

    async def query_metrics(self, message: v1.QueryMetricsRequest) -> v1.MetricsSnapshot:
        snap = await self.metrics.query(
            who(),
            message.allocation_id,
            mode=message.mode or None,
            duration=message.duration_seconds or None,
            metrics=list(message.metrics),
            node_id=message.node_id,
        )
        return metrics_snapshot(snap)

    async def compare_metrics(self, message: v1.CompareMetricsRequest) -> v1.CompareMetricsResponse:
        # `lattice compare`: the TSDB settings of QueryMetrics, several allocations
        answer = await CompareOps(self.metrics).compare(
            who(),
            list(message.allocation_ids),
            metrics=list(message.metrics),
            duration=message.duration_seconds or None,
            step=message.step_seconds or None,
            align=message.align or None,
        )
        return compare_response(answer)

    async def get_diagnostics(self, message: v1.GetDiagnosticsRequest) -> v1.Diagnostics:
        # `lattice diag`: QueryMetrics' TSDB settings and the allocation's agents
        answer = await DiagOps(self.metrics, self.launches.agents).diagnose(
            who(), message.allocation_id, message.scope or None
        )
        return diagnostics_message(answer)

    async def stream_metrics(
        self, message: v1.StreamMetricsRequest
    ) -> AsyncIterator[v1.MetricsSnapshot]:
        """The agents' live metrics and alerts, merged (ops.telemetry); refusals come
        before the first message."""
        records = self.telemetry.open_stream(
            who(),
            message.allocation_id,
            metrics=list(message.metrics),
            node_id=message.node_id,
            alerts_only=message.alerts_only,
            interval=message.interval_seconds,
        )
        async for rec in records:
            yield stream_message(rec)

    async def update(self, message: v1.UpdateAllocationRequest) -> v1.Allocation:
        """Only the telemetry mode can be changed so far (``lattice telemetry``;
        ops.telemetry.update: the other fields answer UNIMPLEMENTED)."""
        body: dict[str, Any] = {
            "telemetry_mode": message.telemetry_mode,
            "duration": message.telemetry_duration_seconds or None,
            "walltime_seconds": message.walltime_seconds,
            "walltime": message.walltime,
            "tags": dict(message.tags),
            "preemption_class": message.preemption_class,
        }
        await self.telemetry.update(who(), message.id, body)
        return to_message(self.ops.get(who(), message.id), v1.Allocation)

    async def get_dag(self, message: v1.GetDagRequest) -> v1.Dag:
        return to_message(self.dags.get(who(), message.id), v1.Dag)

    async def list_dags(self, message: v1.ListDagsRequest) -> v1.ListDagsResponse:
        # the listing rule of allocations: the caller's own unless a user is named
        dags = self.dags.list(
            who(),
            tenant=message.tenant or None,
            user=message.user or None,
            state=message.state or None,
            limit=message.limit if message.limit > 0 else None,
        )
        return v1.ListDagsResponse(dags=[to_message(d, v1.Dag) for d in dags])

    async def cancel_dag(self, message: v1.CancelDagRequest) -> v1.CancelDagResponse:
        dag, cancelled = await self.dags.cancel(who(), message.id, message.reason)
        return v1.CancelDagResponse(dag=to_message(dag, v1.Dag), cancelled_allocation_ids=cancelled)

    async def launch_tasks(self, message: v1.LaunchTasksRequest) -> v1.LaunchTasksResponse:
        body = to_body(message)
        res = await self.launches.launch_tasks(who(), message.allocation_id, body)
        return v1.LaunchTasksResponse(**res)

    async def watch_launch(self, message: v1.WatchLaunchRequest) -> AsyncIterator[v1.LaunchEvent]:
        events = await self.launches.watch(who(), message.allocation_id, message.task_id)
        async for ev in events:
            yield launch_event(ev)

    async def attach(
        self, messages: AsyncIterator[v1.AttachInput]
    ) -> AsyncIterator[v1.AttachOutput]:
        """Proxy to the node's agent (ops.attach): the client's messages after AttachStart
        go to the agent as they are (keepalives included: the agent times out silence)."""
        first = await anext(messages, None)
        if first is None or first.start is None:
            raise ValidationError("an attach stream starts with AttachStart")
        st = first.start
        size = st.size
        call = await self.attaches.open(
            who(),
            st.allocation_id,
            node_id=st.node_id,
            command=list(st.command),
            tty=st.tty,
            rows=size.rows if size else 0,
            cols=size.cols if size else 0,
        )

        async def forward() -> None:
            async for msg in messages:
                await call.send(msg)
            await call.end_input()

        pump = asyncio.create_task(forward(), name="attach-forward")
        try:
            yield v1.AttachOutput(stdout=b"")
            while (out := await call.recv()) is not None:
                yield out
        finally:
            pump.cancel()
            with contextlib.suppress(BaseException):
                await pump
            await call.close()

    async def create_session(self, message: v1.CreateSessionRequest) -> v1.Session:
        body = to_body(message.spec) if message.spec is not None else {}
        return _session(await self.sessions.create(who(), body))

    async def get_session(self, message: v1.GetSessionRequest) -> v1.Session:
        return _session(self.sessions.get(who(), message.id))

    async def delete_session(self, message: v1.DeleteSessionRequest) -> v1.DeleteSessionResponse:
        return v1.DeleteSessionResponse(
            session=_session(await self.sessions.delete(who(), message.id))
        )


def metrics_snapshot(snap: dict[str, Any]) -> v1.MetricsSnapshot:
    """``MetricsOps.query``'s record as the proto message (no data: timestamp 0)."""
    return v1.MetricsSnapshot(
        allocation_id=snap["allocation_id"],
        timestamp=snap["timestamp"] or 0.0,
        samples=[v1.MetricSample(**s) for s in snap["samples"]],
        alerts=list(snap["alerts"]),
        mode=snap["mode"],
        duration_seconds=snap["duration_seconds"],
        resolution_seconds=snap["resolution_seconds"],
        telemetry_mode=snap["telemetry_mode"],
        state=snap["state"],
        node_ids=list(snap["node_ids"]),
    )


def compare_response(answer: dict[str, Any]) -> v1.CompareMetricsResponse:
    """``CompareOps.compare``'s record as the proto message (points as ComparePoint;
    a missing statistic unset; a running allocation's finished_at 0)."""
    return v1.CompareMetricsResponse(
        comparisons=[
            v1.MetricComparison(
                metric=c["metric"],
                unit=c["unit"],
                combine=c["combine"],
                values=dict(c["values"]),
                series=[
                    v1.CompareSeries(
                        allocation_id=s["allocation_id"],
                        points=[
                            v1.ComparePoint(t_offset_seconds=t, value=v) for t, v in s["points"]
                        ],
                        mean=s["mean"],
                        max=s["max"],
                        final=s["final"],
                        delta=s["delta"],
                        ratio=s["ratio"],
                    )
                    for s in c["series"]
                ],
            )
            for c in answer["comparisons"]
        ],
        allocations=[
            v1.CompareAllocation(
                allocation_id=a["allocation_id"],
                state=a["state"],
                started_at=a["started_at"] or 0.0,
                finished_at=a["finished_at"] or 0.0,
            )
            for a in answer["allocations"]
        ],
        duration_seconds=answer["duration_seconds"],
        step_seconds=answer["step_seconds"],
        align=answer["align"],
        resolution_seconds=answer["resolution_seconds"],
    )


def stream_message(rec: dict[str, Any]) -> v1.MetricsSnapshot:
    """A record of ``TelemetryOps``' merged stream as the proto message."""
    return v1.MetricsSnapshot(
        allocation_id=rec["allocation_id"],
        event=rec["event"],
        node_id=rec["node_id"],
        timestamp=rec["timestamp"] or 0.0,
        telemetry_mode=rec["telemetry_mode"],
        mode_until=rec["mode_until"] or 0.0,
        resolution_seconds=rec["resolution_seconds"],
        state=rec["state"],
        node_ids=[rec["node_id"]] if rec["node_id"] else [],
        samples=[v1.MetricSample(**s) for s in rec["samples"]],
        alerts=list(rec["alerts"]),
        alert_events=[
            v1.MetricAlert(**{**a, "value": math.nan if a["value"] is None else a["value"]})
            for a in rec["alert_events"]
        ],
    )


def _session(view: SessionView) -> v1.Session:
    return v1.Session(**msgspec.structs.asdict(view))


def launch_event(ev: dict) -> v1.LaunchEvent:  # type: ignore[type-arg]
    """``LaunchOps``' dict form back into the proto message."""
    kind = ev["type"]
    if kind == "output":
        return v1.LaunchEvent(
            node_id=ev["node_id"],
            output=v1.LaunchOutput(rank=ev["rank"], stream=ev["stream"], line=ev["line"]),
        )
    if kind == "rank_exit":
        return v1.LaunchEvent(
            node_id=ev["node_id"],
            rank_exit=v1.RankExit(rank=ev["rank"], exit_code=ev["exit_code"]),
        )
    if kind == "start":
        return v1.LaunchEvent(
            start=v1.LaunchStart(
                task_id=ev["task_id"],
                node_ids=ev["nodes"],
                ranks_per_node=ev["ranks_per_node"],
                world_size=ev["world_size"],
            )
        )
    done = v1.LaunchDone(
        exit_status=ev["exit_status"],
        aborted=ev["aborted"],
        reason=ev["reason"],
        failed_rank=ev["failed_rank"],
        failed_node=ev["failed_node"],
        rank_exit_codes={int(k): v for k, v in ev["rank_exit_codes"].items()},
    )
    if kind == "node_done":
        return v1.LaunchEvent(node_id=ev["node_id"], node_done=done)
    return v1.LaunchEvent(done=done)


__all__ = ["AllocationService", "launch_event", "metrics_snapshot", "stream_message"]
