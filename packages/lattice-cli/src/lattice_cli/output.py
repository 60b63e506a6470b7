"""Turn API records (plain JSON dicts) into what the CLI prints.

Tables are plain aligned text rather than rich tables: importing rich's table machinery
costs ~80 ms, which the default ``lattice status`` cannot afford. Everything here is a
pure function of its arguments (``now`` is passed in), so it is tested without a server.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Iterable, Sequence
from typing import Any

DASH = "—"

# The core's state names (lattice_common.types.AllocationState / NodeState / HOLDING_STATES),
# spelled out because importing that module costs ~80 ms at start; tests/test_core_names.py
# fails when these copies and the originals differ.
ALLOCATION_STATES = (
    "Pending",
    "Staging",
    "Running",
    "Checkpointing",
    "Suspended",
    "Completed",
    "Failed",
    "Cancelled",
)
NODE_STATES = ("Unknown", "Booting", "Ready", "Degraded", "Down", "Draining", "Drained", "Failed")
HOLDING_STATES = ("Staging", "Running", "Checkpointing")  # an allocation holds nodes
ALLOCATION_COLUMNS = (
    "ID",
    "NAME",
    "STATE",
    "NODES",
    "WALLTIME",
    "ELAPSED",
    "START_TIME",
    "VCLUSTER",
)
ALLOCATION_WIDE_COLUMNS = ("TENANT", "PROJECT", "UENV", "GPU_TYPE", "NODELIST", "REASON")
NODE_COLUMNS = ("NODE", "STATE", "GPUS", "VCLUSTER", "TENANT", "GROUP", "CONFORMANCE")
NODE_WIDE_COLUMNS = ("HOSTNAME", "CPUS", "MEMORY", "OWNER", "CLAIMED_BY", "REASON")
TENANT_COLUMNS = (
    "NAME",
    "MAX_NODES",
    "MAX_CONCURRENT",
    "FAIR_SHARE",
    "BURST",
    "GPU_HOURS",
    "NODE_HOURS",
    "ISOLATION",
)
VCLUSTER_COLUMNS = ("NAME", "SCHEDULER", "TENANT", "CYCLE", "BACKFILL_DEPTH", "BORROWING")

_STATE_COLORS = {
    "Running": "32",
    "Ready": "32",
    "Completed": "36",
    "Pending": "33",
    "Staging": "33",
    "Checkpointing": "33",
    "Suspended": "33",
    "Draining": "33",
    "Drained": "33",
    "Degraded": "33",
    "Failed": "31",
    "Down": "31",
    "Cancelled": "2",
}


# --------------------------------------------------------------------------- cells


def format_hms(seconds: float | None) -> str:
    """Seconds as HH:MM:SS with hours unbounded (72h -> ``72:00:00``); em dash for none."""
    if seconds is None:
        return DASH
    try:
        total = max(0, int(seconds))
    except (TypeError, ValueError, OverflowError):
        return DASH
    hours, rem = divmod(total, 3600)
    minutes, secs = divmod(rem, 60)
    return f"{hours:02d}:{minutes:02d}:{secs:02d}"


def iso_utc(epoch: Any) -> str:
    """Epoch seconds -> ``2026-03-05T10:00:12Z``; strings pass through; em dash for none."""
    if epoch is None or epoch == "":
        return DASH
    if isinstance(epoch, str):
        return epoch
    try:
        return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(float(epoch)))
    except (TypeError, ValueError, OverflowError, OSError):
        return str(epoch)


def clock_time(epoch: float, now: float) -> str:
    """A moment near ``now`` in local time: ``14:32`` today, ``Nov 27 09:00`` otherwise."""
    t, today = time.localtime(epoch), time.localtime(now)
    same_day = (t.tm_year, t.tm_yday) == (today.tm_year, today.tm_yday)
    return time.strftime("%H:%M" if same_day else "%b %d %H:%M", t)


def start_cell(alloc: dict[str, Any], now: float) -> str:
    """START_TIME: when it started, or for a Pending allocation the scheduler's estimate,
    marked with ``~`` (``~now`` when the current cycle is starting it); em dash when
    there is neither."""
    if alloc.get("state") == "Pending":
        est = alloc.get("estimated_start")
        if est is None:
            return DASH
        if alloc.get("estimate_basis") == "now" or float(est) <= now:
            return "~now"
        return "~" + clock_time(float(est), now)
    started = alloc.get("started_at")
    return DASH if started is None else clock_time(float(started), now)


def estimate_text(alloc: dict[str, Any], now: float) -> str | None:
    """``lattice status ID``'s estimated start: the time, how far away, and its basis."""
    est = alloc.get("estimated_start")
    if alloc.get("state") != "Pending" or est is None:
        return None
    basis = alloc.get("estimate_basis") or "estimate"
    if float(est) <= now or basis == "now":
        return f"now (estimate: {basis})"
    wait = format_hms(float(est) - now)
    return f"{iso_utc(est)} (in {wait}; estimate: {basis})"


def _text(value: Any) -> str:
    if value is None or value == "" or value == []:
        return DASH
    return str(value)


def elapsed_seconds(alloc: dict[str, Any], now: float) -> float | None:
    """Run time so far (or in total, once finished); None before it started."""
    started = alloc.get("started_at")
    if not isinstance(started, int | float) or isinstance(started, bool):
        return None
    finished = alloc.get("finished_at")
    end = finished if isinstance(finished, int | float) and not isinstance(finished, bool) else now
    return max(0.0, float(end) - float(started))


def walltime_seconds(spec: dict[str, Any]) -> float | None:
    value = spec.get("walltime_seconds")
    if isinstance(value, int | float) and not isinstance(value, bool) and value > 0:
        return value
    return None


def compress_nodelist(names: Iterable[str]) -> str:
    """Slurm-style hostlist: ``nid001,nid002,nid003,x`` -> ``nid[001-003],x``."""
    groups: dict[tuple[str, int], list[int]] = {}
    order: list[tuple[str, Any]] = []
    for name in names:
        name = str(name)
        match = re.fullmatch(r"(.*?)(\d+)", name)
        if not match:
            order.append(("plain", name))
            continue
        key = (match.group(1), len(match.group(2)))
        if key not in groups:
            groups[key] = []
            order.append(("group", key))
        groups[key].append(int(match.group(2)))
    parts: list[str] = []
    for kind, item in order:
        if kind == "plain":
            parts.append(item)
            continue
        prefix, width = item
        numbers = sorted(set(groups[item]))
        if len(numbers) == 1:
            parts.append(f"{prefix}{numbers[0]:0{width}d}")
            continue
        ranges: list[str] = []
        start = prev = numbers[0]
        for n in [*numbers[1:], None]:
            if n is not None and n == prev + 1:
                prev = n
                continue
            ranges.append(
                f"{start:0{width}d}" if start == prev else f"{start:0{width}d}-{prev:0{width}d}"
            )
            if n is not None:
                start = prev = n
        parts.append(f"{prefix}[{','.join(ranges)}]")
    return ",".join(parts)


def format_constraints(constraints: dict[str, Any] | None) -> str:
    if not constraints:
        return DASH
    items = []
    for key, value in constraints.items():
        if value in (None, "", [], 0):
            continue
        if key == "features" and isinstance(value, list):
            items.extend(str(v) for v in value)
        else:
            items.append(f"{key}={value}")
    return ",".join(items) or DASH


def gpus_cell(capabilities: dict[str, Any] | None) -> str:
    """``4×GH200`` from a node's capabilities; em dash without GPUs."""
    caps = capabilities or {}
    count = caps.get("gpu_count") or 0
    kind = caps.get("gpu_type") or ""
    if not count:
        return DASH
    return f"{count}×{kind}" if kind else str(count)


# --------------------------------------------------------------------------- tables


def render_table(
    headers: Sequence[str],
    rows: Sequence[Sequence[str]],
    *,
    color_column: str | None = None,
    color: bool = False,
) -> str:
    """Left-aligned columns separated by two spaces, like squeue/kubectl."""
    widths = [len(h) for h in headers]
    for row in rows:
        for i, cell in enumerate(row):
            widths[i] = max(widths[i], len(cell))
    col = headers.index(color_column) if color and color_column in headers else -1
    lines = []
    for n, row in enumerate([list(headers), *rows]):
        cells = []
        for i, cell in enumerate(row):
            padded = cell if i == len(row) - 1 else cell.ljust(widths[i])
            if i == col and n > 0 and cell in _STATE_COLORS:
                padded = f"\x1b[{_STATE_COLORS[cell]}m{cell}\x1b[0m" + padded[len(cell) :]
            cells.append(padded)
        lines.append("  ".join(cells).rstrip())
    return "\n".join(lines)


def allocation_row(alloc: dict[str, Any], now: float, *, wide: bool = False) -> list[str]:
    spec = alloc.get("spec") or {}
    row = [
        _text(alloc.get("id")),
        _text(spec.get("name")),
        _text(alloc.get("state")),
        _text(spec.get("nodes")),
        format_hms(walltime_seconds(spec)),
        format_hms(elapsed_seconds(alloc, now)),
        start_cell(alloc, now),
        _text(spec.get("vcluster")),
    ]
    if wide:
        constraints = spec.get("constraints") or {}
        row += [
            _text(spec.get("tenant")),
            _text(spec.get("project")),
            _text(spec.get("uenv")),
            _text(constraints.get("gpu_type")),
            _text(compress_nodelist(alloc.get("assigned_nodes") or [])),
            _text(
                alloc.get("pending_reason")
                if alloc.get("state") == "Pending" and alloc.get("pending_reason")
                else alloc.get("reason")
            ),
        ]
    return row


def fold_task_groups(allocs: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per task group (job array), like the specification's ``1×20`` rows:
    NODES is nodes-per-task × tasks running (or × all tasks when none runs)."""
    out: list[dict[str, Any]] = []
    groups: dict[str, list[dict[str, Any]]] = {}
    for a in allocs:
        gid = a.get("task_group_id") or ""
        if not gid:
            out.append(a)
            continue
        if gid not in groups:
            groups[gid] = []
            out.append({"_group": gid})
        groups[gid].append(a)
    for i, row in enumerate(out):
        gid = row.get("_group")
        if gid:
            out[i] = _group_row(gid, groups[gid])
    return out


def _group_row(gid: str, tasks: list[dict[str, Any]]) -> dict[str, Any]:
    states = [t.get("state") for t in tasks]
    if any(s in HOLDING_STATES for s in states):
        state = "Running"
    elif "Pending" in states or "Suspended" in states:
        state = "Pending"
    elif "Failed" in states:
        state = "Failed"
    elif all(s == "Cancelled" for s in states):
        state = "Cancelled"
    else:
        state = "Completed"
    spec = dict(tasks[0].get("spec") or {})
    name = str(spec.get("name") or "")
    spec["name"] = name.split("[", 1)[0] if name.endswith("]") else name
    running = sum(1 for s in states if s in HOLDING_STATES)
    spec["nodes"] = f"{spec.get('nodes') or 1}×{running or len(tasks)}"
    starts = [t["started_at"] for t in tasks if t.get("started_at")]
    ends = [t["finished_at"] for t in tasks if t.get("finished_at")]
    return {
        "id": gid,
        "spec": spec,
        "state": state,
        "started_at": min(starts) if starts else None,
        "finished_at": max(ends) if ends and state not in ("Running", "Pending") else None,
        "assigned_nodes": [n for t in tasks for n in t.get("assigned_nodes") or []],
        "reason": f"{len(tasks)} tasks",
    }


def allocation_table(
    allocs: Iterable[dict[str, Any]],
    now: float,
    *,
    wide: bool = False,
    color: bool = False,
    expand: bool = False,
) -> str:
    headers = ALLOCATION_COLUMNS + (ALLOCATION_WIDE_COLUMNS if wide else ())
    rows = [
        allocation_row(a, now, wide=wide) for a in (allocs if expand else fold_task_groups(allocs))
    ]
    return render_table(headers, rows, color_column="STATE", color=color)


QUEUE_COLUMNS = ("POS", "ID", "USER", "NODES", "SCORE", "START_TIME", "BASIS", "REASON")


def queue_table(q: dict[str, Any], now: float, *, verbose: bool = False) -> str:
    """``lattice queue``: one row per visible entry, a header line with the counts."""
    entries = q.get("entries") or []
    head = (
        f"vCluster {q.get('vcluster')}: {q.get('total', 0)} pending, {len(entries)} shown"
        " (START_TIME ~ = estimate)"
    )
    rows = []
    for e in entries:
        a = e.get("allocation") or {}
        spec = a.get("spec") or {}
        est = {
            "state": "Pending",
            "estimated_start": e.get("estimated_start"),
            "estimate_basis": e.get("estimate_basis"),
        }
        rows.append(
            [
                str(e.get("position", "")),
                _text(a.get("id")),
                _text(spec.get("user")),
                _text(spec.get("nodes")),
                f"{float(e.get('score') or 0.0):.3f}",
                start_cell(est, now),
                _text(e.get("estimate_basis")),
                _text(e.get("pending_reason")),
            ]
        )
        if verbose:
            b = e.get("breakdown") or {}
            # the contributions w_i * f_i, keyed c1_priority .. c9_conformance
            contrib = sorted(k for k in b if k[:1] == "c" and k[1:2].isdigit())
            parts = [f"{k.split('_', 1)[1]}={b[k]:.3f}" for k in contrib if b[k]]
            pen = [f"{k}={b[k]:.2f}" for k in ("budget_penalty", "share_penalty") if k in b]
            rows.append(["", "", "", "", "", "", "", "  " + " ".join(parts + pen)])
    return head + "\n" + render_table(QUEUE_COLUMNS, rows) if rows else head


def test_only_text(est: dict[str, Any], now: float) -> str:
    """``lattice submit --test-only``: when and on how many nodes (estimated), or that
    it lies beyond the estimate's horizon, with the reason it would wait."""
    n = est.get("nodes") or 0
    where = f"on {n} node{'s' if n != 1 else ''}"
    if est.get("node_ids"):
        where += f" ({compress_nodelist(est['node_ids'])})"
    start = est.get("estimated_start")
    if start is None:
        line = "Would not start within the estimate's horizon"
    elif est.get("estimate_basis") == "now" or float(start) <= now:
        line = f"Would start now {where}"
    else:
        line = (
            f"Would start at {iso_utc(start)} (in {format_hms(float(start) - now)}) {where}"
            f" (estimate: {est.get('estimate_basis')})"
        )
    extra = []
    if est.get("position"):
        extra.append(f"Queue position: {est['position']}")
    if est.get("pending_reason"):
        extra.append(f"Pending reason: {est['pending_reason']}")
    extra.append("Nothing was submitted.")
    return "\n".join([line, *extra])


def key_values(pairs: Sequence[tuple[str, Any]]) -> str:
    width = max((len(k) for k, _ in pairs), default=0) + 1
    return "\n".join(f"{(k + ':').ljust(width)}  {_text(v)}" for k, v in pairs)


def _staged(alloc: dict[str, Any]) -> str | None:
    """Staging: how many nodes have finished their prologue."""
    if alloc.get("state") != "Staging":
        return None
    staged = alloc.get("staged_nodes") or []
    return f"{len(staged)}/{len(alloc.get('assigned_nodes') or [])} (prologue done)"


def _image_text(image: str | None, digest: str | None) -> str | None:
    if not image:
        return None
    return f"{image} ({digest})" if digest else image


def _bytes_text(n: int | None) -> str | None:
    if n is None:
        return None
    size = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if size < 1024 or unit == "GiB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return None


_SCALED = {"up": "scaled up", "down": "scaled down"}


def nodes_text(alloc: dict[str, Any], now: float) -> Any:
    """``Nodes``: the count asked for; for a reactive allocation the nodes it holds, the
    autoscaler's target, its bounds and its last scale event with the reason
    (``3 (target 3, min 2, max 4) — scaled up at 12:03: cpu_utilization 0.91 >= 0.80
    for 120 s``), and ``cooldown until`` while one runs."""
    spec = alloc.get("spec") or {}
    if spec.get("lifecycle") != "reactive" or not spec.get("min_nodes"):
        return spec.get("nodes")
    held = len(alloc.get("assigned_nodes") or [])
    status = alloc.get("scaling_status") or {}
    target = status.get("target") or held
    text = f"{held} (target {target}, min {spec.get('min_nodes')}, max {spec.get('nodes')})"
    at = status.get("at")
    if status.get("last_decision") in _SCALED and at is not None:
        text += f" — {_SCALED[status['last_decision']]} at {clock_time(float(at), now)}"
        if status.get("reason"):
            text += f": {status['reason']}"
        cooldown = (spec.get("scaling") or {}).get("cooldown")
        if cooldown is not None and now < float(at) + float(cooldown):
            text += f" (cooldown until {clock_time(float(at) + float(cooldown), now)})"
    return text


def releasing_text(alloc: dict[str, Any], now: float) -> str | None:
    """``Releasing``: the nodes a scale-down of a checkpointable allocation releases once
    the application has checkpointed (``x1000c0s0b0n2 after its checkpoint, by 12:13
    at the latest``); None when none is pending."""
    status = alloc.get("scaling_status") or {}
    nodes = status.get("releasing") or []
    if not nodes:
        return None
    text = f"{compress_nodelist(nodes)} after its checkpoint"
    by = status.get("release_by")
    if by is not None:
        text += f", by {clock_time(float(by), now)} at the latest"
    return text


def scaling_text(spec: dict[str, Any]) -> str | None:
    """``Scaling``: a reactive allocation's metric, thresholds and timings."""
    s = spec.get("scaling")
    if spec.get("lifecycle") != "reactive" or not isinstance(s, dict):
        return None
    target = float(s.get("target", 0.8))
    low = target * float(s.get("scale_down_threshold", 0.5))
    return (
        f"{s.get('metric') or 'cpu_utilization'}: up at >= {target:g}, down at <= {low:g}; "
        f"every {float(s.get('evaluation_interval', 60)):g}s, windows "
        f"{float(s.get('scale_up_window', 120)):g}s up / {float(s.get('scale_down_window', 300)):g}s "
        f"down, cooldown {float(s.get('cooldown', 180)):g}s"
    )


def allocation_detail(alloc: dict[str, Any], now: float) -> str:
    """``lattice status ID``: every field a person asks about, one per line."""
    spec = alloc.get("spec") or {}
    nodes = alloc.get("assigned_nodes") or []
    exit_code = alloc.get("exit_code")
    return key_values(
        [
            ("ID", alloc.get("id")),
            ("Name", spec.get("name")),
            ("State", alloc.get("state")),
            ("Reason", alloc.get("reason")),
            (
                "Pending reason",
                alloc.get("pending_reason") if alloc.get("state") == "Pending" else None,
            ),
            ("Estimated start", estimate_text(alloc, now)),
            ("Exit code", DASH if exit_code is None else exit_code),
            ("Tenant", spec.get("tenant")),
            ("vCluster", spec.get("vcluster")),
            ("Project", spec.get("project")),
            ("User", spec.get("user")),
            ("Nodes", nodes_text(alloc, now)),
            ("Scaling", scaling_text(spec)),
            ("Scaling blocked", (alloc.get("scaling_status") or {}).get("blocked") or None),
            ("Releasing", releasing_text(alloc, now)),
            ("Assigned nodes", compress_nodelist(nodes) if nodes else None),
            ("Staged nodes", _staged(alloc)),
            (
                "Prologue failures",
                f"{alloc['prologue_failures']} (excluded: "
                f"{compress_nodelist(alloc.get('excluded_nodes') or [])})"
                if alloc.get("prologue_failures")
                else None,
            ),
            ("Walltime", format_hms(walltime_seconds(spec))),
            ("Elapsed", format_hms(elapsed_seconds(alloc, now))),
            ("Submitted", iso_utc(alloc.get("submitted_at"))),
            ("Started", iso_utc(alloc.get("started_at"))),
            ("Finished", iso_utc(alloc.get("finished_at"))),
            ("Requeue count", alloc.get("requeue_count", 0)),
            ("Preempted count", alloc.get("preempted_count", 0)),
            ("Preemption class", spec.get("preemption_class")),
            ("Checkpoint", _checkpoint_mode(spec)),
            ("Last checkpoint", _checkpoint_text(alloc.get("last_checkpoint"))),
            ("Resume from", _resume_text(alloc)),
            ("Requeue policy", spec.get("requeue_policy")),
            ("Lifecycle", spec.get("lifecycle")),
            ("Constraints", format_constraints(spec.get("constraints"))),
            ("uenv", spec.get("uenv")),
            ("View", spec.get("view") or None),
            ("Image", _image_text(spec.get("image"), alloc.get("image_digest"))),
            ("Peak memory", _bytes_text(alloc.get("peak_memory_bytes"))),
            ("Entrypoint", spec.get("entrypoint")),
            ("Submit dir", spec.get("submit_dir")),
        ]
    )


def _checkpoint_mode(spec: dict[str, Any]) -> str | None:
    """``auto (grpc)``; None for checkpoint: none."""
    mode = spec.get("checkpoint") or "none"
    if mode == "none":
        return None
    protocol = spec.get("checkpoint_protocol") or ""
    return f"{mode} ({protocol})" if protocol else str(mode)


def _checkpoint_text(ck: Any) -> str | None:
    """``ckpt-1  /path  2.0 KiB in 0.3s``."""
    if not isinstance(ck, dict) or not ck.get("id"):
        return None
    size = _bytes_text(ck.get("size_bytes")) or "0 B"
    duration = float(ck.get("duration_seconds") or 0.0)
    return f"{ck['id']}  {ck.get('path', '')}  {size} in {duration:.1f}s"


def _resume_text(alloc: dict[str, Any]) -> str | None:
    ck = alloc.get("last_checkpoint")
    if alloc.get("resume_from_checkpoint") and isinstance(ck, dict) and ck.get("path"):
        return str(ck["path"])
    return None


def node_row(node: dict[str, Any], *, wide: bool = False) -> list[str]:
    caps = node.get("capabilities") or {}
    state = _text(node.get("state"))
    if node.get("disabled") and state != "Disabled":
        state = f"{state}(disabled)"
    conformance = str(node.get("conformance_group") or "")[:12]
    row = [
        _text(node.get("id")),
        state,
        gpus_cell(caps),
        _text(node.get("owner_vcluster") or node.get("home_vcluster")),
        _text(node.get("owner_tenant")),
        _text(node.get("group")),
        _text(conformance),
    ]
    if wide:
        memory = caps.get("memory_gb")
        row += [
            _text(node.get("hostname")),
            _text(caps.get("cpu_cores") or None),
            f"{memory}G" if memory else DASH,
            _text(node.get("owner")),
            _text(node.get("claimed_by")),
            _text(node.get("state_reason")),
        ]
    return row


def node_table(nodes: Iterable[dict[str, Any]], *, wide: bool = False, color: bool = False) -> str:
    headers = NODE_COLUMNS + (NODE_WIDE_COLUMNS if wide else ())
    rows = [node_row(n, wide=wide) for n in nodes]
    return render_table(headers, rows, color_column="STATE", color=color)


def node_detail(node: dict[str, Any]) -> str:
    caps = node.get("capabilities") or {}
    return key_values(
        [
            ("Node", node.get("id")),
            ("Hostname", node.get("hostname")),
            ("State", node.get("state")),
            ("Reason", node.get("state_reason")),
            ("Disabled", "yes" if node.get("disabled") else "no"),
            ("GPUs", gpus_cell(caps)),
            ("CPU cores", caps.get("cpu_cores")),
            ("Memory", f"{caps['memory_gb']} GB" if caps.get("memory_gb") else None),
            ("Features", ",".join(caps.get("features") or []) or None),
            ("Group", node.get("group")),
            ("Conformance", node.get("conformance_group")),
            ("Owner", node.get("owner")),
            ("Owner tenant", node.get("owner_tenant")),
            ("Owner vCluster", node.get("owner_vcluster")),
            ("Home vCluster", node.get("home_vcluster")),
            ("Claimed by", node.get("claimed_by")),
            # how its agent authenticated: spiffe, quorum-ca, site-ca, bootstrap, token, none
            ("Agent identity", node.get("agent_identity")),
            # telemetry collectors: ebpf, proc (the /proc + cgroup fallback), nvml
            ("Telemetry", node.get("telemetry")),
        ]
    )


def _number(value: Any) -> str:
    if value is None or value == "":
        return DASH
    if isinstance(value, float):
        return f"{value:g}"
    return str(value)


def tenant_table(tenants: Iterable[dict[str, Any]]) -> str:
    rows = [
        [
            _text(t.get("name")),
            _number(t.get("max_nodes")),
            _number(t.get("max_concurrent_allocations")),
            _number(t.get("fair_share_target")),
            _number(t.get("burst_allowance")),
            _number(t.get("gpu_hours_budget")),
            _number(t.get("node_hours_budget")),
            _text(t.get("isolation")),
        ]
        for t in tenants
    ]
    return render_table(TENANT_COLUMNS, rows)


def vcluster_detail(v: dict[str, Any]) -> str:
    """``lattice admin vcluster show NAME``: its policy and its cost-function weights."""
    cycle = v.get("cycle_interval_seconds")
    borrowing = v.get("allow_borrowing")
    weights = v.get("weights") or {}
    return key_values(
        [
            ("vCluster", v.get("name")),
            ("Scheduler type", v.get("scheduler_type")),
            ("Tenant", v.get("tenant") or None),
            ("Cycle interval", f"{_number(cycle)}s" if cycle is not None else None),
            ("Backfill depth", v.get("backfill_depth")),
            ("Lends idle nodes", None if borrowing is None else ("yes" if borrowing else "no")),
            *((f"Weight {k}", _number(w)) for k, w in weights.items()),
        ]
    )


def vcluster_table(vclusters: Iterable[dict[str, Any]]) -> str:
    rows = []
    for v in vclusters:
        cycle = v.get("cycle_interval_seconds")
        borrowing = v.get("allow_borrowing")
        rows.append(
            [
                _text(v.get("name")),
                _text(v.get("scheduler_type")),
                _text(v.get("tenant") or None),
                f"{_number(cycle)}s" if cycle is not None else DASH,
                _number(v.get("backfill_depth")),
                DASH if borrowing is None else ("yes" if borrowing else "no"),
            ]
        )
    return render_table(VCLUSTER_COLUMNS, rows)


def raft_status_text(status: dict[str, Any]) -> str:
    """Header lines (this member, leader, term, indexes) and a member table.

    Reads ``leader_id`` when the server sends it, else names the leader by address.
    """
    leader_id = status.get("leader_id")
    leader_address = status.get("leader_address") or ""
    leader = " ".join(
        str(p)
        for p in (
            leader_id if leader_id not in (None, "") else "",
            f"({leader_address})"
            if leader_id not in (None, "") and leader_address
            else leader_address,
        )
        if p
    )
    if status.get("leader_api_address"):
        leader += f", API {status['leader_api_address']}"
    member = status.get("member_id")
    if "is_leader" in status:
        member = f"{member} ({'leader' if status['is_leader'] else 'follower'})"
    pairs: list[tuple[str, Any]] = [
        ("Member", member),
        ("Leader", leader or "none"),
        ("Term", status.get("term")),
        ("Commit index", status.get("commit_index")),
    ]
    for key, label in (("last_applied", "Last applied"), ("revision", "Revision")):
        if key in status:
            pairs.append((label, status[key]))
    head = key_values(pairs)
    rows = []
    for m in status.get("members") or []:
        role = m.get("state") or ("leader" if m.get("id") == leader_id else "follower")
        rows.append([_text(m.get("id")), _text(m.get("address")), _text(role)])
    if not rows:
        return head
    return head + "\n\n" + render_table(("ID", "ADDRESS", "STATE"), rows)


def format_log_line(line: dict[str, Any], *, timestamps: bool = True, node: bool = False) -> str:
    """``[2026-03-05T10:00:12Z] Epoch 1/100`` (plus ``node:`` when several nodes write)."""
    text = str(line.get("line", line.get("message", "")) or "").rstrip("\r\n")
    prefix = ""
    if timestamps and line.get("timestamp") not in (None, ""):
        prefix += f"[{iso_utc(line.get('timestamp'))}] "
    if node and line.get("node_id"):
        prefix += f"{line['node_id']}: "
    return prefix + text


# --------------------------------------------------------------------------- metrics

#: ``lattice top``'s default view; ``--wide`` shows every metric of the catalog
TOP_METRICS = (
    "gpu_utilization",
    "gpu_memory_used",
    "cpu_utilization",
    "memory_used",
    "network_rx_bytes",
    "network_tx_bytes",
)
TOP_WIDE_METRICS = (
    "gpu_utilization",
    "gpu_memory_used",
    "gpu_power_draw",
    "cpu_utilization",
    "memory_used",
    "network_rx_bytes",
    "network_tx_bytes",
    "io_read_bytes",
    "io_write_bytes",
    "io_latency_p99",
)
#: per-node and per-GPU column headers
TOP_COLUMNS = {
    "gpu_utilization": "GPU_UTIL",
    "gpu_memory_used": "GPU_MEM",
    "gpu_power_draw": "GPU_POWER",
    "cpu_utilization": "CPU",
    "memory_used": "MEMORY",
    "network_rx_bytes": "NET_RX",
    "network_tx_bytes": "NET_TX",
    "io_read_bytes": "IO_READ",
    "io_write_bytes": "IO_WRITE",
    "io_latency_p99": "IO_P99",
}
_GPU_COLUMNS = {"gpu_utilization": "UTIL", "gpu_memory_used": "MEMORY", "gpu_power_draw": "POWER"}


def _scaled(value: float, base: float, units: Sequence[str]) -> tuple[str, str]:
    size, i = float(value), 0
    while abs(size) >= base and i < len(units) - 1:
        size /= base
        i += 1
    return (f"{size:.0f}" if i == 0 else f"{size:.1f}"), units[i]


def metric_value(value: Any, unit: str) -> tuple[str, str]:
    """A value in its unit, humanised: ``(87.3, %)``, ``(71.2, GB)``, ``(12.4, MB/s)``,
    ``(350.0, W)``, ``(45.0, µs)``/``(1.2, ms)``; bytes in powers of 1000, as the
    specification's examples. Em dash for no value."""
    if not isinstance(value, int | float) or isinstance(value, bool) or value != value:
        return DASH, ""
    if unit == "percent":
        return f"{value:.1f}", "%"
    if unit == "bytes":
        return _scaled(value, 1000, ("B", "KB", "MB", "GB", "TB", "PB"))
    if unit == "bytes_per_second":
        number, prefix = _scaled(value, 1000, ("B", "KB", "MB", "GB", "TB"))
        return number, prefix + "/s"
    if unit == "watts":
        return (f"{value / 1000:.1f}", "kW") if abs(value) >= 10_000 else (f"{value:.1f}", "W")
    if unit == "microseconds":
        if abs(value) >= 1_000_000:
            return f"{value / 1_000_000:.2f}", "s"
        if abs(value) >= 1000:
            return f"{value / 1000:.1f}", "ms"
        return f"{value:.1f}", "µs"
    return f"{value:g}", unit


def metric_cell(value: Any, unit: str) -> str:
    number, shown = metric_value(value, unit)
    if number == DASH:
        return DASH
    return f"{number}%" if shown == "%" else f"{number} {shown}"


def _ago(epoch: Any, now: float) -> str:
    if not isinstance(epoch, int | float) or not epoch:
        return DASH
    age = max(0.0, now - float(epoch))
    if age < 120:
        return f"{age:.0f} s ago"
    if age < 7200:
        return f"{age / 60:.0f} min ago"
    return iso_utc(epoch)


def metrics_caption(snap: dict[str, Any], now: float) -> str:
    """The line above ``lattice top``'s table: whose, how many nodes, the resolution and
    how old the values are."""
    nodes = len(snap.get("node_ids") or [])
    resolution = snap.get("resolution_seconds") or 0
    parts = [
        f"{snap.get('allocation_id', '')} ({snap.get('state') or '?'})",
        f"{nodes} node{'s' if nodes != 1 else ''} reporting",
        f"{resolution:g} s resolution ({snap.get('telemetry_mode') or 'prod'} mode)",
        f"updated {_ago(snap.get('timestamp'), now)}",
    ]
    return " · ".join(parts)


def no_metrics_text(snap: dict[str, Any], alloc_id: str) -> str:
    """What ``lattice top`` says when nothing was pushed within the duration."""
    state = snap.get("state") or ""
    every = f"agents push every {snap.get('resolution_seconds') or 30:g} s"
    mode = snap.get("telemetry_mode") or "prod"
    if state in ("Pending", "Staging"):
        return f"no metrics for {alloc_id} yet: it is {state} ({every} once it runs, {mode} mode)"
    if state in ("Completed", "Failed", "Cancelled"):
        return (
            f"no metrics for {alloc_id}: it is {state} and nothing was pushed in the "
            f"{format_hms(snap.get('duration_seconds'))} before it ended"
        )
    window = snap.get("duration_seconds") or 0
    if window and window < 300:
        return (
            f"no metrics for {alloc_id} in the last {window:g} s: {every} ({mode} mode); "
            "try a longer --duration"
        )
    return f"no metrics for {alloc_id} yet: {every} ({mode} mode)"


def _ordered(samples: Iterable[dict[str, Any]], names: Sequence[str]) -> list[str]:
    present = {s.get("name") for s in samples}
    return [n for n in names if n in present]


def metrics_summary_table(snap: dict[str, Any], *, wide: bool = False) -> str:
    """``lattice top ID``: METRIC VALUE UNIT, one row per metric (the spec's example)."""
    names = TOP_WIDE_METRICS if wide else TOP_METRICS
    samples = {s.get("name"): s for s in snap.get("samples") or []}
    rows = []
    for name in _ordered(samples.values(), names):
        s = samples[name]
        number, unit = metric_value(s.get("value"), str(s.get("unit") or ""))
        rows.append([name, number, unit])
    width = max((len(r[1]) for r in rows), default=0)
    rows = [[r[0], r[1].rjust(max(width, 5)), r[2]] for r in rows]
    return render_table(("METRIC", "VALUE".rjust(max(width, 5)), "UNIT"), rows)


def metrics_node_table(snap: dict[str, Any], *, wide: bool = False) -> str:
    """``lattice top ID --per-node``: NODE and one column per metric."""
    samples = snap.get("samples") or []
    names = _ordered(samples, TOP_WIDE_METRICS if wide else TOP_METRICS)
    by_node: dict[str, dict[str, dict[str, Any]]] = {}
    for s in samples:
        by_node.setdefault(str(s.get("node_id") or ""), {})[str(s.get("name"))] = s
    rows = []
    for node in sorted(by_node):
        cells = by_node[node]
        row = [node]
        for name in names:
            s = cells.get(name)
            row.append(metric_cell(s.get("value"), str(s.get("unit"))) if s else DASH)
        rows.append(row)
    return render_table(("NODE", *(TOP_COLUMNS[n] for n in names)), rows)


def metrics_gpu_table(snap: dict[str, Any]) -> str:
    """``lattice top ID --per-gpu``: NODE GPU UTIL MEMORY POWER, one row per GPU."""
    samples = snap.get("samples") or []
    names = _ordered(samples, tuple(_GPU_COLUMNS))
    by_gpu: dict[tuple[str, str], dict[str, dict[str, Any]]] = {}
    for s in samples:
        key = (str(s.get("node_id") or ""), str((s.get("labels") or {}).get("gpu", "")))
        by_gpu.setdefault(key, {})[str(s.get("name"))] = s

    def order(key: tuple[str, str]) -> tuple[str, int, str]:
        node, gpu = key
        return (node, int(gpu) if gpu.isdigit() else -1, gpu)

    rows = []
    for key in sorted(by_gpu, key=order):
        cells = by_gpu[key]
        row = list(key)
        for name in names:
            s = cells.get(name)
            row.append(metric_cell(s.get("value"), str(s.get("unit"))) if s else DASH)
        rows.append(row)
    return render_table(("NODE", "GPU", *(_GPU_COLUMNS[n] for n in names)), rows)


# --------------------------------------------------------------------------- formats


def to_json(data: Any, *, compact: bool = False) -> str:
    if compact:
        return json.dumps(data, separators=(",", ":"), ensure_ascii=False, default=str)
    return json.dumps(data, indent=2, ensure_ascii=False, default=str)


def to_yaml(data: Any) -> str:
    import yaml

    return yaml.safe_dump(data, sort_keys=False, allow_unicode=True, default_flow_style=False)


def colored(text: str, code: str, enabled: bool) -> str:
    return f"\x1b[{code}m{text}\x1b[0m" if enabled else text
