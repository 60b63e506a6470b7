"""``lattice diag ID``: network, storage and GPU health of a running allocation in one
view, each line with a health mark (``lattice diagnostics`` is the same command).

::

    lattice diag a1b2c3d4              # network, storage and GPUs
    lattice diag a1b2c3d4 --network    # group span, congestion, inter-node bandwidth
    lattice diag a1b2c3d4 --storage    # mount health per node, I/O rates and latency
    lattice diag a1b2c3d4 -o wide      # with the I/O latency histograms
    lattice diag a1b2c3d4 -o json      # the structured answer

Marks: ✓ ok, ⚠ warning, ✗ critical, – no data (nothing measures it here; no number is
made up). The renderers are pure (tested without a server).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Annotated, Any

import typer

from lattice_cli.context import OutputOpt, emit, fail, run_api, state_of

MARKS = {"ok": "✓", "warning": "⚠ WARNING", "critical": "✗ CRITICAL", "unknown": "–"}
SECTION_TITLES = {"network": "Network", "storage": "Storage", "gpu": "GPUs"}
#: a check's label in front of its message (storage lines are named by their node)
LABELS = {
    "group_span": "Group span",
    "congestion": "CSIG congestion",
    "inter_node_bandwidth": "Inter-node BW",
    "network_errors": "Network errors",
    "sm_occupancy": "SM occupancy",
    "gpu_memory": "GPU memory",
    "nvlink": "NVLink",
    "ecc_errors": "ECC errors",
    "gpus": "GPUs",
    "io": "I/O",
    "agent": "agent",
}
BAR = "█"
BAR_WIDTH = 30


def register(app: typer.Typer) -> None:
    # both words of the table name this module: register once
    if any(c.name == "diag" for c in app.registered_commands):
        return
    app.command("diag")(diag)
    app.command("diagnostics", hidden=True)(diag)


def diag(
    ctx: typer.Context,
    alloc_id: Annotated[str, typer.Argument(help="Allocation ID.", metavar="ID")],
    network: Annotated[
        bool,
        typer.Option(
            "--network", help="Network only: group span, congestion, inter-node bandwidth."
        ),
    ] = False,
    storage: Annotated[
        bool,
        typer.Option(
            "--storage", help="Storage only: mount health per node, I/O rates and latency."
        ),
    ] = False,
    output: OutputOpt = None,
) -> None:
    """Diagnose a running allocation: network, storage and GPU health with marks."""
    st = state_of(ctx)
    if network and storage:
        fail(
            "--network and --storage cannot be combined",
            hint="Leave both out for the whole view (network, storage and GPUs).",
            code=2,
        )
    section = "network" if network else "storage" if storage else None
    fmt = st.output(output)

    async def go(client: Any) -> Any:
        return await client.get_diagnostics(alloc_id, section=section)

    answer = run_api(st, go)
    if fmt in ("json", "yaml"):
        emit(st, fmt, answer)
        return
    print(render(answer, histograms=fmt == "wide", quiet=st.quiet))


# --- pure renderers -------------------------------------------------------------------------


def mark(status: str) -> str:
    return MARKS.get(status, status)


def check_line(c: Mapping[str, Any]) -> str:
    """One check as ``Label: message mark``; node lines start with the node
    (``n1 working directory: /path (...): ... ✓``)."""
    if c.get("name") == "mount":
        role = (c.get("details") or {}).get("role") or "directory"
        label = f"{c.get('node_id')} {role}"
    else:
        label = LABELS.get(str(c.get("name")), str(c.get("name")))
        if c.get("node_id"):
            label = f"{c['node_id']} {label}"
    return f"{label}: {c.get('message', '')} {mark(str(c.get('status')))}"


def histogram_lines(buckets: Sequence[Mapping[str, Any]], width: int = BAR_WIDTH) -> list[str]:
    """An I/O latency histogram as one line per bucket with a bar scaled to the largest."""
    if not buckets:
        return []
    top = max(int(b.get("count") or 0) for b in buckets) or 1
    out = []
    for b in buckets:
        n = int(b.get("count") or 0)
        bar = BAR * (round(width * n / top) if n else 0)
        span = f"{_us(float(b.get('low_us') or 0))}-{_us(float(b.get('high_us') or 0))}"
        out.append(f"{span:>17} {n:>9} {bar}")
    return out


def _us(us: float) -> str:
    if us >= 1e6:
        return f"{us / 1e6:g}s"
    if us >= 1e3:
        return f"{us / 1e3:g}ms"
    return f"{us:g}µs"


def render(answer: Mapping[str, Any], *, histograms: bool = False, quiet: bool = False) -> str:
    """The human view: a caption, then each section's lines with marks (spec: Combined
    Diagnostics; a node whose agent did not answer is a line of its own), the verdict."""
    lines = []
    nodes = answer.get("nodes") or []
    if not quiet:
        lines.append(
            f"Diagnostics of allocation {answer.get('allocation_id')} "
            f"({answer.get('state')}, {len(nodes)} node{'s' if len(nodes) != 1 else ''})"
        )
    checks = answer.get("checks") or []
    for section in answer.get("sections") or []:
        mine = [c for c in checks if c.get("section") == section]
        if not mine:
            continue
        lines.append(f"{SECTION_TITLES.get(section, section.title())}:")
        for c in mine:
            lines.append("  " + check_line(c))
            if histograms and c.get("histogram"):
                lines.append("    I/O latency histogram (requests):")
                lines.extend("    " + h for h in histogram_lines(c["histogram"]))
    overall = str(answer.get("status") or "unknown")
    lines.append(f"Overall: {answer.get('summary', '')} {mark(overall)}")
    return "\n".join(lines)
