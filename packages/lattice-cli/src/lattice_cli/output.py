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
            ("Nodes", spec.get("nodes")),
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
