"""The pure core of ``lattice diag`` (lattice_api.ops.diag): health marks and their
thresholds, the facts (TSDB series, the agents' latest values) per node, metric and GPU,
and the report's sections built from plain data, plus its wire form (proto
``Diagnostics``). No I/O here.

Marks are ``ok``, ``warning``, ``critical``, and ``unknown`` where nothing measures a
fact (the line then says so; no number is made up). The thresholds are the constants
below, the specification's alert thresholds where it gives them.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from lattice_common.errors import LatticeError, ValidationError
from lattice_common.types import Allocation, Node

from lattice_api.tsdb import Series

__all__ = [
    "CRITICAL",
    "MARKS",
    "METRICS",
    "OK",
    "UNKNOWN",
    "WARNING",
    "Facts",
    "build_report",
    "check",
    "facts_from_latest",
    "facts_from_series",
    "gpu_checks",
    "merge_facts",
    "mount_check",
    "network_checks",
    "parse_scope",
    "split_key",
    "storage_checks",
    "summary_text",
    "worst",
]

OK, WARNING, CRITICAL, UNKNOWN = "ok", "warning", "critical", "unknown"
#: marks from best to worst; ``unknown`` (nothing to judge) is outside the order
MARKS = (OK, WARNING, CRITICAL)
ALL, NETWORK, STORAGE, GPU = "all", "network", "storage", "gpu"
SECTIONS = {ALL: (NETWORK, STORAGE, GPU), NETWORK: (NETWORK,), STORAGE: (STORAGE,)}

# --- thresholds -----------------------------------------------------------------------
#: free space of a mount (fraction of its size) below which it is a warning / critical
FREE_WARNING, FREE_CRITICAL = 0.10, 0.02
#: free inodes (fraction) below which it is a warning / critical
INODES_WARNING, INODES_CRITICAL = 0.10, 0.02
#: seconds the write+fsync+read probe may take before it is a warning / critical
PROBE_WARNING, PROBE_CRITICAL = 0.1, 1.0
#: block I/O p99 latency, µs: the spec's io_latency alert (10 ms) is the warning
IO_P99_WARNING, IO_P99_CRITICAL = 10_000.0, 100_000.0
#: CSIG congestion level (0..1): LOW below the first, MEDIUM below the second, else HIGH
CONGESTION_MEDIUM, CONGESTION_HIGH = 0.1, 0.5
#: network errors in percent of packets: the spec's network_errors alert (0.1 %)
NET_ERRORS_WARNING, NET_ERRORS_CRITICAL = 0.1, 1.0
#: inter-node bandwidth against the target (when one is set): fraction for ok / warning
BANDWIDTH_OK, BANDWIDTH_WARNING = 0.75, 0.25
#: GPU SM occupancy below which the GPUs look idle (spec: gpu_idle, potential hang)
SM_IDLE = 10.0
#: GPU memory use (percent of capacity) above which OOM is near (spec: gpu_memory_high)
GPU_MEMORY_HIGH = 95.0

#: the series read per node (names of the user metrics catalog and the GPU source)
NET_METRICS = ("network_tx_bytes", "network_rx_bytes", "network_error_rate", "csig_congestion")
IO_METRICS = ("io_read_bytes", "io_write_bytes", "io_latency_p99")
GPU_METRICS = (
    "gpu_utilization",
    "gpu_memory_used",
    "gpu_memory_total",
    "gpu_ecc_errors_uncorrected",
    "gpu_ecc_errors_corrected",
    "gpu_nvlink_tx_bytes",
    "gpu_nvlink_rx_bytes",
)
METRICS = NET_METRICS + IO_METRICS + GPU_METRICS

#: node -> metric -> GPU index ("" for a node series) -> value
Facts = dict[str, dict[str, dict[str, float]]]


# --- pure: scope, marks, numbers ------------------------------------------------------


def parse_scope(scope: str | None) -> str:
    """``all`` ("" / None too), ``network`` or ``storage``; ValidationError otherwise."""
    text = (scope or ALL).strip().lower()
    if text not in SECTIONS:
        raise ValidationError(
            f"unknown diagnostics section {scope!r}",
            details={"available": "network, storage"},
            hint="Use section=network or section=storage, or leave it out for everything.",
        )
    return text


def worst(statuses: Iterable[str]) -> str:
    """The worst mark among ``statuses``; ``unknown`` when none is ok/warning/critical."""
    ranked = [MARKS.index(s) for s in statuses if s in MARKS]
    return MARKS[max(ranked)] if ranked else UNKNOWN


def _above(value: float, warning: float, critical: float) -> str:
    return CRITICAL if value >= critical else WARNING if value >= warning else OK


def _below(value: float, warning: float, critical: float) -> str:
    return CRITICAL if value < critical else WARNING if value < warning else OK


def fmt_bytes(n: float) -> str:
    """Decimal units, as the specification writes GB/s: ``12.5 GB``."""
    for unit, scale in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n:.0f} B"


def fmt_us(us: float) -> str:
    if us >= 1e6:
        return f"{us / 1e6:.2f} s"
    if us >= 1e3:
        return f"{us / 1e3:.1f} ms"
    return f"{us:.0f} µs"


def check(
    section: str,
    name: str,
    status: str,
    message: str,
    *,
    node_id: str = "",
    details: Mapping[str, str] | None = None,
    values: Mapping[str, float] | None = None,
    histogram: Sequence[Mapping[str, float]] = (),
) -> dict[str, Any]:
    return {
        "section": section,
        "name": name,
        "node_id": node_id,
        "status": status,
        "message": message,
        "details": dict(details or {}),
        "values": {k: float(v) for k, v in (values or {}).items()},
        "histogram": [dict(b) for b in histogram],
    }


# --- pure: facts ------------------------------------------------------------------------


def split_key(key: str) -> tuple[str, str]:
    """A reading's key as ``(name, gpu)``: ``gpu_utilization{gpu=0}`` -> ``("gpu_utilization",
    "0")``; a node series' key has gpu ``""``."""
    if key.endswith("}") and "{" in key:
        name, inner = key[:-1].split("{", 1)
        labels = dict(p.split("=", 1) for p in inner.split(",") if "=" in p)
        return name, labels.get("gpu", "")
    return key, ""


def facts_from_series(series: Iterable[Series]) -> Facts:
    """The TSDB's answer (labels ``__name__, node_id, gpu, agg``) as facts: the window
    mean of each series, its raw value where no mean was pushed."""
    best: dict[tuple[str, str, str], tuple[int, float]] = {}
    for s in series:
        name, node = s.labels.get("__name__", ""), s.labels.get("node_id", "")
        if name not in METRICS or not node or not math.isfinite(s.value):
            continue
        rank = 1 if s.labels.get("agg") == "mean" else 0
        key = (node, name, s.labels.get("gpu", ""))
        if key not in best or rank > best[key][0]:
            best[key] = (rank, s.value)
    out: Facts = {}
    for (node, name, gpu), (_, value) in best.items():
        out.setdefault(node, {}).setdefault(name, {})[gpu] = value
    return out


def facts_from_latest(node_id: str, latest: Mapping[str, float]) -> Facts:
    """An agent's latest collection (keys ``name`` or ``name{gpu=N}``) as facts."""
    out: dict[str, dict[str, float]] = {}
    for key, value in latest.items():
        name, gpu = split_key(key)
        if name in METRICS and math.isfinite(value):
            out.setdefault(name, {})[gpu] = float(value)
    return {node_id: out} if out else {}


def merge_facts(first: Facts, fallback: Facts) -> tuple[Facts, dict[tuple[str, str], str]]:
    """``first`` (the TSDB), with what only ``fallback`` (the agents) has added, per node
    and metric; and where each came from."""
    out: Facts = {}
    source: dict[tuple[str, str], str] = {}
    for tag, facts in (("tsdb", first), ("agent", fallback)):
        for node, metrics in facts.items():
            for name, per_gpu in metrics.items():
                if name not in out.setdefault(node, {}):
                    out[node][name] = dict(per_gpu)
                    source[(node, name)] = tag
    return out, source


def _node_value(facts: Facts, node: str, name: str, combine: str = "sum") -> float | None:
    per = facts.get(node, {}).get(name)
    if not per:
        return None
    vals = list(per.values())
    return math.fsum(vals) / len(vals) if combine == "avg" else math.fsum(vals)


def _across(facts: Facts, nodes: Sequence[str], name: str, combine: str) -> list[float]:
    return [v for n in nodes if (v := _node_value(facts, n, name, combine)) is not None]


def _sources(source: Mapping[tuple[str, str], str], nodes: Sequence[str], *names: str) -> str:
    tags = sorted({source[(n, m)] for n in nodes for m in names if (n, m) in source})
    return ",".join(tags)


# --- pure: the sections -----------------------------------------------------------------


def network_checks(
    alloc: Allocation,
    nodes: Sequence[Node],
    facts: Facts,
    source: Mapping[tuple[str, str], str],
    *,
    sensitive: bool = False,
    bandwidth_target: float = 0.0,
) -> list[dict[str, Any]]:
    """Group span, CSIG congestion, inter-node bandwidth, network errors (when measured)."""
    ids = [n.id for n in nodes]
    out = []
    groups = sorted({n.group for n in nodes})
    names = ", ".join(f"g{g}" for g in groups)
    tight = alloc.spec.constraints.topology == "tight"
    span_status = WARNING if tight and len(groups) > 1 else OK
    out.append(
        check(
            NETWORK,
            "group_span",
            span_status,
            f"{len(groups)} group{'s' if len(groups) != 1 else ''} ({names})"
            + (" although topology=tight asks for one" if span_status == WARNING else ""),
            details={
                "groups": ",".join(map(str, groups)),
                "topology": alloc.spec.constraints.topology,
            },
            values={"groups": len(groups)},
        )
    )
    if sensitive:
        out.append(
            check(
                NETWORK,
                "congestion",
                UNKNOWN,
                "not shown for sensitive allocations (fabric-wide, beyond the allocation's traffic)",
            )
        )
    else:
        levels = _across(facts, ids, "csig_congestion", "avg")
        if levels:
            avg = math.fsum(levels) / len(levels)
            level = (
                "HIGH"
                if avg >= CONGESTION_HIGH
                else "MEDIUM"
                if avg >= CONGESTION_MEDIUM
                else "LOW"
            )
            out.append(
                check(
                    NETWORK,
                    "congestion",
                    _above(avg, CONGESTION_MEDIUM, CONGESTION_HIGH),
                    f"{level} ({avg:.2f} avg)",
                    details={"source": _sources(source, ids, "csig_congestion")},
                    values={"congestion": avg},
                )
            )
        else:
            out.append(
                check(
                    NETWORK,
                    "congestion",
                    UNKNOWN,
                    "no data (no CSIG congestion telemetry for these nodes)",
                )
            )
    if len(ids) < 2:
        out.append(
            check(NETWORK, "inter_node_bandwidth", OK, "n/a: one node, no inter-node traffic")
        )
    else:
        tx = _across(facts, ids, "network_tx_bytes", "sum")
        rx = _across(facts, ids, "network_rx_bytes", "sum")
        if not tx and not rx:
            out.append(
                check(
                    NETWORK,
                    "inter_node_bandwidth",
                    UNKNOWN,
                    "no data (no network series for this allocation's nodes)",
                )
            )
        else:
            avg_tx = math.fsum(tx) / len(tx) if tx else 0.0
            avg_rx = math.fsum(rx) / len(rx) if rx else 0.0
            per_node = max(avg_tx, avg_rx)
            values = {
                "tx_bytes_per_second": avg_tx,
                "rx_bytes_per_second": avg_rx,
                "nodes_measured": float(max(len(tx), len(rx))),
            }
            text = f"{fmt_bytes(avg_tx)}/s out, {fmt_bytes(avg_rx)}/s in, avg per node"
            status = OK
            if bandwidth_target > 0:
                values["target_bytes_per_second"] = bandwidth_target
                status = _below(per_node / bandwidth_target, BANDWIDTH_OK, BANDWIDTH_WARNING)
                text += f" (target: {fmt_bytes(bandwidth_target)}/s)"
            out.append(
                check(
                    NETWORK,
                    "inter_node_bandwidth",
                    status,
                    text,
                    details={
                        "source": _sources(source, ids, "network_tx_bytes", "network_rx_bytes")
                    },
                    values=values,
                )
            )
    errors = _across(facts, ids, "network_error_rate", "avg")
    if errors:
        peak = max(errors)
        out.append(
            check(
                NETWORK,
                "network_errors",
                _above(peak, NET_ERRORS_WARNING, NET_ERRORS_CRITICAL),
                f"{peak:.2f} % of packets (worst node)",
                values={"error_rate_percent": peak},
            )
        )
    return out


def mount_check(node_id: str, m: Mapping[str, Any]) -> dict[str, Any]:
    """One directory's mount health line (``m``: NodeDiagnosis.mounts[] as a dict)."""
    where = f"{m['path']} ({m.get('fs_type') or '?'} on {m.get('mount_point') or '?'})"
    total, free = float(m.get("total_bytes") or 0), float(m.get("free_bytes") or 0)
    inodes, free_inodes = float(m.get("total_inodes") or 0), float(m.get("free_inodes") or 0)
    probe = float(m.get("probe_seconds") or 0.0)
    values = {"total_bytes": total, "free_bytes": free, "probe_seconds": probe}
    if inodes:
        values.update(total_inodes=inodes, free_inodes=free_inodes)
    details = {
        "role": str(m.get("role") or ""),
        "path": str(m["path"]),
        "mount_point": str(m.get("mount_point") or ""),
        "fs_type": str(m.get("fs_type") or ""),
    }
    if m.get("timed_out"):
        status, text = (
            CRITICAL,
            f"not answering: {m.get('error') or 'the probe timed out'} (hung mount?)",
        )
    elif m.get("error") and str(m.get("error")).startswith("statvfs"):
        status, text = CRITICAL, str(m["error"])
    else:
        parts = []
        marks = []
        if total > 0:
            frac = free / total
            values["free_percent"] = 100.0 * frac
            parts.append(f"{fmt_bytes(free)} free of {fmt_bytes(total)} ({100.0 * frac:.0f} %)")
            marks.append(_below(frac, FREE_WARNING, FREE_CRITICAL))
        if inodes > 0:
            ifrac = free_inodes / inodes
            marks.append(_below(ifrac, INODES_WARNING, INODES_CRITICAL))
            if ifrac < INODES_WARNING:
                parts.append(f"{100.0 * ifrac:.1f} % inodes free")
        if m.get("error"):
            why = str(m["error"])
            if m.get("read_only"):
                parts.append("read-only")
                marks.append(WARNING)
            elif "No space" in why:
                parts.append(f"write failed: {why}")
                marks.append(CRITICAL)
            elif "Permission denied" in why:
                parts.append(f"not writable by the node agent ({why})")
                marks.append(WARNING)
            else:
                parts.append(f"write probe failed: {why}")
                marks.append(CRITICAL)
        else:
            parts.append(f"write+fsync+read {probe * 1000:.1f} ms")
            marks.append(_above(probe, PROBE_WARNING, PROBE_CRITICAL))
        status, text = worst(marks), ", ".join(parts)
    details["role"] = details["role"] or "directory"
    return check(
        STORAGE,
        "mount",
        status,
        f"{where}: {text}",
        node_id=node_id,
        details=details,
        values=values,
    )


def storage_checks(
    node_id: str, diagnosis: Mapping[str, Any], facts: Facts
) -> list[dict[str, Any]]:
    """Mount health of each directory, then the I/O line (rates and the p99 latency, with
    the histogram when the agent measures it) of one node that answered."""
    out = [mount_check(node_id, m) for m in diagnosis.get("mounts") or []]
    if not diagnosis.get("mounts"):
        out.append(
            check(
                STORAGE,
                "mount",
                UNKNOWN,
                "no working directory or scratch of the allocation on this node",
                node_id=node_id,
            )
        )
    read = _node_value(facts, node_id, "io_read_bytes")
    write = _node_value(facts, node_id, "io_write_bytes")
    # the recent p99 (the TSDB's window, else the agent's last collection) is judged; the
    # histogram's (since the job was first measured) where there is no recent one
    p99 = _node_value(facts, node_id, "io_latency_p99", "sum")
    if p99 is None:
        p99 = diagnosis.get("io_latency_p99_us")
    values: dict[str, float] = {}
    parts = []
    if read is not None or write is not None:
        values.update(read_bytes_per_second=read or 0.0, write_bytes_per_second=write or 0.0)
        parts.append(f"{fmt_bytes(read or 0.0)}/s read, {fmt_bytes(write or 0.0)}/s write")
    for q in ("p50", "p95", "p99"):
        if diagnosis.get(f"io_latency_{q}_us") is not None:
            values[f"histogram_{q}_us"] = float(diagnosis[f"io_latency_{q}_us"])
    if p99 is not None:
        values["latency_p99_us"] = float(p99)
        parts.append(f"p99 latency: {fmt_us(float(p99))}")
        status = _above(float(p99), IO_P99_WARNING, IO_P99_CRITICAL)
    else:
        parts.append("p99 latency: no data (block I/O latency needs the eBPF collector)")
        status = UNKNOWN
    out.append(
        check(
            STORAGE,
            "io",
            status,
            ", ".join(parts),
            node_id=node_id,
            values=values,
            histogram=diagnosis.get("io_latency") or (),
        )
    )
    return out


def gpu_checks(nodes: Sequence[Node], facts: Facts) -> list[dict[str, Any]]:
    """SM occupancy, memory, NVLink and ECC errors across the allocation's GPUs, from the
    GPU series; one ``no GPU data`` line when there are none."""
    ids = [n.id for n in nodes]
    per_gpu = [v for n in ids for v in facts.get(n, {}).get("gpu_utilization", {}).values()]
    if not per_gpu:
        gpus = sum(n.capabilities.gpu_count or len(n.capabilities.gpus) for n in nodes)
        why = "no GPU telemetry for this allocation" if gpus else "its nodes have no GPUs"
        return [check(GPU, "gpus", UNKNOWN, f"no GPU data ({why})", values={"gpus": gpus})]
    out = []
    avg = math.fsum(per_gpu) / len(per_gpu)
    out.append(
        check(
            GPU,
            "sm_occupancy",
            WARNING if avg < SM_IDLE else OK,
            f"{avg:.0f}% avg across {len(per_gpu)} GPU{'s' if len(per_gpu) != 1 else ''}"
            + (" (idle: potential hang)" if avg < SM_IDLE else ""),
            values={"utilization_percent": avg, "gpus": len(per_gpu)},
        )
    )
    used = math.fsum(_across(facts, ids, "gpu_memory_used", "sum"))
    total = math.fsum(_across(facts, ids, "gpu_memory_total", "sum"))
    if not total:
        total = float(sum(g.memory_bytes for n in nodes for g in n.capabilities.gpus))
    if used and total:
        pct = 100.0 * used / total
        out.append(
            check(
                GPU,
                "gpu_memory",
                WARNING if pct > GPU_MEMORY_HIGH else OK,
                f"{fmt_bytes(used)} of {fmt_bytes(total)} ({pct:.0f} %)"
                + (" (OOM risk)" if pct > GPU_MEMORY_HIGH else ""),
                values={"used_bytes": used, "total_bytes": total, "used_percent": pct},
            )
        )
    nvlink = _across(facts, ids, "gpu_nvlink_tx_bytes", "sum") + _across(
        facts, ids, "gpu_nvlink_rx_bytes", "sum"
    )
    if nvlink:
        count = len(per_gpu) or 1
        per = math.fsum(nvlink) / count
        out.append(
            check(
                GPU,
                "nvlink",
                OK,
                f"{fmt_bytes(per)}/s avg per GPU",
                values={"bytes_per_second_per_gpu": per},
            )
        )
    unc = _across(facts, ids, "gpu_ecc_errors_uncorrected", "sum")
    cor = _across(facts, ids, "gpu_ecc_errors_corrected", "sum")
    if unc or cor:
        u, c = math.fsum(unc), math.fsum(cor)
        status = CRITICAL if u > 0 else WARNING if c > 0 else OK
        out.append(
            check(
                GPU,
                "ecc_errors",
                status,
                f"{u:.0f} uncorrected, {c:.0f} corrected",
                values={"uncorrected": u, "corrected": c},
            )
        )
    else:
        out.append(
            check(GPU, "ecc_errors", UNKNOWN, "no data (the GPU source reports no ECC counts)")
        )
    return out


def summary_text(checks: Sequence[Mapping[str, Any]]) -> str:
    counts = {m: sum(1 for c in checks if c["status"] == m) for m in (*MARKS, UNKNOWN)}
    judged = len(checks) - counts[UNKNOWN]
    bad = [f"{counts[m]} {m}" for m in (CRITICAL, WARNING) if counts[m]]
    head = ", ".join(bad) if bad else ("all ok" if judged else "nothing could be judged")
    tail = f"{judged} check{'s' if judged != 1 else ''}"
    if counts[UNKNOWN]:
        tail += f", {counts[UNKNOWN]} without data"
    return f"{head} ({tail})"


def build_report(
    alloc: Allocation,
    nodes: Sequence[Node],
    answers: Mapping[str, Mapping[str, Any] | LatticeError],
    tsdb_facts: Facts,
    *,
    scope: str = ALL,
    tsdb: str = "ok",
    sensitive: bool = False,
    bandwidth_target: float = 0.0,
    now: float = 0.0,
) -> dict[str, Any]:
    """The whole answer from plain data: ``answers`` per node the agent's NodeDiagnosis
    as a dict, or the error it gave."""
    agent_facts: Facts = {}
    for node, a in answers.items():
        if not isinstance(a, LatticeError):
            agent_facts.update(facts_from_latest(node, a.get("latest") or {}))
    facts, source = merge_facts(tsdb_facts, agent_facts)
    sections = SECTIONS[scope]
    checks: list[dict[str, Any]] = []
    if NETWORK in sections:
        checks += network_checks(
            alloc, nodes, facts, source, sensitive=sensitive, bandwidth_target=bandwidth_target
        )
    # a node whose agent did not answer: in the storage section (its mounts are unknown),
    # else in the network section (its traffic may be missing from the numbers)
    lost_in = STORAGE if STORAGE in sections else NETWORK
    for n in nodes:
        a = answers.get(n.id)
        if isinstance(a, LatticeError) or a is None:
            why = a.message if isinstance(a, LatticeError) else "not asked"
            checks.append(check(lost_in, "agent", CRITICAL, f"no answer: {why}", node_id=n.id))
        elif STORAGE in sections:
            checks += storage_checks(n.id, a, facts)
    if GPU in sections:
        checks += gpu_checks(nodes, facts)
    node_rows = []
    for n in nodes:
        a = answers.get(n.id)
        err = a.message if isinstance(a, LatticeError) else "" if a is not None else "not asked"
        node_rows.append({"node_id": n.id, "group": n.group, "ok": not err, "error": err})
    return {
        "allocation_id": alloc.id,
        "state": alloc.state.value,
        "scope": scope,
        "sections": list(sections),
        "timestamp": now,
        "status": worst(c["status"] for c in checks),
        "summary": summary_text(checks),
        "tsdb": tsdb,
        "nodes": node_rows,
        "checks": checks,
    }
