"""Import of the Standard Workload Format (SWF, the Parallel Workloads Archive's format).

A job line has 18 whitespace-separated numeric fields (``-1`` = unknown); lines
starting with ``;`` are comments, and ``; UnixStartTime: <epoch>`` in the header
gives the absolute time of submit time 0.

==  =====================  ==================================================================
#   SWF field              RM-Replay
==  =====================  ==================================================================
1   job number             allocation id (``<job number>``)
2   submit time            ``t`` = UnixStartTime (0 without the header) + submit time
3   wait time              ignored (the replay decides the wait)
4   run time               actual runtime; a job with run time < 0 is skipped
5   allocated processors   processor count when field 8 is unknown
6   average CPU time       ignored
7   used memory            ignored
8   requested processors   ``nodes = ceil(processors / cores_per_node)`` (at least 1);
                           a job with neither 8 nor 5 known is skipped
9   requested time         walltime; unknown (or <= 0) -> the run time
10  requested memory       ignored (node memory is the inventory's)
11  status                 1 = completed (exit 0); -1 (unknown) -> exit 0; 0 = failed and
                           2-4 (partial) -> exit 1; 5 = cancelled: exit 1, skipped when it
                           never ran (run time 0)
12  user id                ``user = "u<id>"``; tenant with ``tenant_by="user"``
13  group id               tenant ``"g<id>"`` with ``tenant_by="group"`` (the default);
                           unknown (-1) -> ``"unknown"``
14  executable number      ``name = "exe<N>"`` when known
15  queue number           vCluster through ``queue_map``; unmapped or -1 -> the default
16  partition number       ignored
17  preceding job number   ignored (dependencies are not replayed)
18  think time             ignored
==  =====================  ==================================================================

Every job gets preemption class 5 (SWF has no priority) and no GPU or feature
constraint. Malformed lines raise :class:`rm_replay.model.SwfError` naming the line;
valid jobs that cannot be replayed (no processor count, negative run time, cancelled
before starting) are skipped and counted in :class:`SwfParse`.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Mapping
from pathlib import Path

import msgspec

from rm_replay.model import SubmitEvent, SwfError
from rm_replay.trace import MAX_NODES, MAX_SECONDS, MAX_TS, check_trace

__all__ = ["SWF_FIELDS", "SwfParse", "load_swf", "parse_swf", "parse_swf_line"]

SWF_FIELDS = (
    "job_number",
    "submit_time",
    "wait_time",
    "run_time",
    "allocated_processors",
    "average_cpu_time",
    "used_memory",
    "requested_processors",
    "requested_time",
    "requested_memory",
    "status",
    "user_id",
    "group_id",
    "executable",
    "queue",
    "partition",
    "preceding_job",
    "think_time",
)
_HINT = (
    "An SWF job line has 18 whitespace-separated numbers (-1 for unknown); "
    "comment lines start with ';'."
)
_NUMBER = re.compile(r"^-?(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)(?:[eE][-+]?[0-9]+)?$")
_START = re.compile(r"^;\s*UnixStartTime\s*:\s*(-?[0-9]+)\s*$", re.IGNORECASE)


class SwfParse(msgspec.Struct, kw_only=True):
    """What :func:`parse_swf` read: the events, the jobs it skipped (line, job, why)
    and the header's ``UnixStartTime`` (0 when absent)."""

    events: list[SubmitEvent]
    skipped: list[tuple[int, str, str]]
    unix_start_time: float = 0.0


def _numbers(line: str) -> list[float]:
    parts = line.split()
    if len(parts) != len(SWF_FIELDS):
        raise SwfError(f"expected 18 fields, found {len(parts)}", hint=_HINT)
    out: list[float] = []
    for name, p in zip(SWF_FIELDS, parts, strict=True):
        if not _NUMBER.match(p):
            raise SwfError(f"field {name} is not a number: {p[:40]!r}", hint=_HINT)
        try:
            x = float(p)
        except (ValueError, OverflowError):  # pragma: no cover - the regex admits floats only
            x = math.inf
        if not math.isfinite(x) or abs(x) > 1e15:
            raise SwfError(f"field {name} out of range: {p[:40]!r}", hint=_HINT)
        out.append(x)
    return out


def _known(x: float) -> bool:
    return x >= 0


def parse_swf_line(
    line: str,
    *,
    cores_per_node: int,
    tenant_by: str = "group",
    queue_map: Mapping[int, str] | None = None,
    default_vcluster: str = "",
    start_time: float = 0.0,
    line_no: int = 0,
) -> SubmitEvent | str | None:
    """One SWF line -> a submit event; None for blank and comment lines; a string (the
    reason) for a valid job that cannot be replayed. Raises :class:`SwfError`."""
    try:
        return _parse_line(
            line, cores_per_node, tenant_by, queue_map or {}, default_vcluster, start_time
        )
    except SwfError as e:
        raise e.at(line=line_no or None) from None


def _parse_line(
    line: str,
    cores_per_node: int,
    tenant_by: str,
    queue_map: Mapping[int, str],
    default_vcluster: str,
    start_time: float,
) -> SubmitEvent | str | None:
    s = line.strip()
    if not s or s.startswith(";"):
        return None
    f = _numbers(s)
    job, submit, _wait, run, alloc_p, _cpu, _mem, req_p, req_t = f[:9]
    status, uid, gid, exe, queue = f[10], f[11], f[12], f[13], f[14]
    if not float(job).is_integer():
        raise SwfError(f"job number must be an integer, got {job:g}", hint=_HINT)
    if submit < 0:
        raise SwfError(f"submit time must be >= 0, got {submit:g}", hint=_HINT)
    t = start_time + submit
    if t > MAX_TS:
        raise SwfError(f"submit time out of range: {submit:g}", hint=_HINT)
    if run < 0:
        return "unknown run time"
    if run > MAX_SECONDS or req_t > MAX_SECONDS:
        raise SwfError("run or requested time longer than 100 years", hint=_HINT)
    procs = req_p if req_p > 0 else alloc_p
    if procs <= 0:
        return "no processor count"
    st = int(status) if status.is_integer() else -1
    if st == 5 and run <= 0:
        return "cancelled before it started"
    nodes = max(1, math.ceil(procs / cores_per_node))
    if nodes > MAX_NODES:
        raise SwfError(f"{procs:g} processors is more than {MAX_NODES} nodes", hint=_HINT)
    walltime = req_t if req_t > 0 else run
    user = f"u{int(uid)}" if _known(uid) else "unknown"
    group = f"g{int(gid)}" if _known(gid) else "unknown"
    tenant = user if tenant_by == "user" else group
    vcluster = default_vcluster
    if _known(queue):
        vcluster = queue_map.get(int(queue), default_vcluster)
    return SubmitEvent(
        t=t,
        id=str(int(job)),
        tenant=tenant,
        user=user,
        nodes=nodes,
        walltime=float(walltime),
        vcluster=vcluster,
        runtime=float(run),
        exit=0 if st in (1, -1) else 1,
        name=f"exe{int(exe)}" if _known(exe) else "",
    )


def parse_swf(
    lines: Iterable[str | bytes],
    *,
    cores_per_node: int,
    tenant_by: str = "group",
    queue_map: Mapping[int, str] | None = None,
    default_vcluster: str = "",
    path: str | None = None,
) -> SwfParse:
    """Every job of an SWF file (see the module docstring for the mapping)."""
    if isinstance(cores_per_node, bool) or not isinstance(cores_per_node, int):
        raise SwfError("cores_per_node must be an integer", path=path)
    if cores_per_node < 1:
        raise SwfError(
            f"cores_per_node must be at least 1, got {cores_per_node}",
            hint="Pass --cores-per-node: the processors (cores) of one node of the traced system.",
            path=path,
        )
    if tenant_by not in ("group", "user"):
        raise SwfError(f"tenant_by must be 'group' or 'user', got {tenant_by!r}", path=path)
    events: list[SubmitEvent] = []
    skipped: list[tuple[int, str, str]] = []
    start = 0.0
    for n, raw in enumerate(lines, 1):
        if isinstance(raw, bytes):
            try:
                raw = raw.decode("utf-8")
            except UnicodeDecodeError:
                raise SwfError("not UTF-8 text", hint=_HINT, path=path, line=n) from None
        m = _START.match(raw.strip())
        if m and not events:
            start = float(m.group(1))
            if not 0 <= start <= MAX_TS:
                raise SwfError("UnixStartTime out of range", path=path, line=n)
            continue
        try:
            ev = parse_swf_line(
                raw,
                cores_per_node=cores_per_node,
                tenant_by=tenant_by,
                queue_map=queue_map,
                default_vcluster=default_vcluster,
                start_time=start,
                line_no=n,
            )
        except SwfError as e:
            raise e.at(path=path) from None
        if isinstance(ev, str):
            job = raw.split()[0]
            skipped.append((n, job, ev))
        elif ev is not None:
            events.append(ev)
    check_trace(events, path=path)
    return SwfParse(events=events, skipped=skipped, unix_start_time=start)


def load_swf(
    path: str | Path,
    *,
    cores_per_node: int,
    tenant_by: str = "group",
    queue_map: Mapping[int, str] | None = None,
    default_vcluster: str = "",
) -> list[SubmitEvent]:
    """The submit events of an SWF file (skipped jobs are left out; use
    :func:`parse_swf` to see them)."""
    p = Path(path)
    with p.open("rb") as f:
        return parse_swf(
            f,
            cores_per_node=cores_per_node,
            tenant_by=tenant_by,
            queue_map=queue_map,
            default_vcluster=default_vcluster,
            path=str(p),
        ).events
