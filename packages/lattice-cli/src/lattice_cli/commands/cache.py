"""``lattice cache status|warm|evict``: the uenv image caches on the nodes.

::

    lattice cache status                          # every node's cached images
    lattice cache status --node x1000c0s0b0n0 -o json
    lattice cache warm --image=prgenv-gnu/24.11:v1 --group=3
    lattice cache warm --image=pytorch/2.4:cuda12 --nodes=x1000c0s0b0n0,x1000c0s0b0n1
    lattice cache warm --image=prgenv-gnu/24.11:v1 --all
    lattice cache evict --image=prgenv-gnu/24.11:v1 --node=x1000c0s0b0n0

Each node's agent keeps its own cache (least recently used images are evicted above its
size limit, never one an allocation uses). Warming and evicting are for system
administrators. A node that does not answer is shown as such; a warm that failed on any
node exits 1 after the per-node results. Rendering is the pure :func:`status_text` and
:func:`results_text`.
"""

from __future__ import annotations

import time
from typing import Annotated, Any

import typer

from lattice_cli.context import OutputOpt, emit, fail, run_api, state_of

cache_app = typer.Typer(
    help="uenv image caches on the nodes: what they hold, pre-warm an image, evict one.",
    no_args_is_help=True,
)

#: seconds the CLI waits for a warm (the server waits for every node's copy)
WARM_TIMEOUT = 660.0
DASH = "-"


def register(app: typer.Typer) -> None:
    app.add_typer(cache_app, name="cache")


# --------------------------------------------------------------------------- rendering


def size_text(n: Any) -> str:
    """Bytes for people: ``512 B``, ``4.0 KiB``, ... ``1.2 TiB``."""
    if not isinstance(n, int | float) or isinstance(n, bool):
        return DASH
    size = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if size < 1024 or unit == "TiB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return DASH  # pragma: no cover


def _when(epoch: Any, now: float) -> str:
    from lattice_cli.output import clock_time

    return clock_time(float(epoch), now) if isinstance(epoch, int | float) and epoch else DASH


def _error_line(item: dict[str, Any]) -> str:
    err = item.get("error") or {}
    return str(err.get("message") or "failed")


def status_text(nodes: list[dict[str, Any]], now: float, *, wide: bool = False) -> str:
    """One row per cached image: NODE, IMAGE, SIZE, LAST USED, IN USE (wide: SHA256 and the
    node's CACHE use/limit); a node with none shows ``-``; nodes that did not answer are
    listed under the table."""
    from lattice_cli.output import render_table

    headers = ["NODE", "IMAGE", "SIZE", "LAST USED", "IN USE"]
    if wide:
        headers += ["SHA256", "CACHE"]
    rows: list[list[str]] = []
    failed: list[str] = []
    for n in nodes:
        node = str(n.get("node", ""))
        if not n.get("ok"):
            why = _error_line(n)
            failed.append(why if why.startswith(f"node {node}") else f"node {node}: {why}")
            continue
        cache = f"{size_text(n.get('used_bytes'))}/{size_text(n.get('max_bytes'))}"
        images = n.get("images") or []
        if not images:
            empty = DASH if n.get("enabled", True) else "(uenv disabled)"
            rows.append([node, empty, DASH, DASH, DASH] + ([DASH, cache] if wide else []))
        for img in images:
            row = [
                node,
                str(img.get("ref") or "(unknown ref)"),
                size_text(img.get("size")),
                _when(img.get("last_access"), now),
                "yes" if img.get("in_use") else "no",
            ]
            if wide:
                row += [str(img.get("sha256", ""))[:12], cache]
            rows.append(row)
    parts = [render_table(headers, rows)] if rows else []
    if failed:
        parts.append("\n".join(failed))
    return "\n\n".join(parts) if parts else "No nodes."


def results_text(out: dict[str, Any], action: str) -> str:
    """Per-node results of a warm or evict: NODE, RESULT."""
    from lattice_cli.output import render_table

    rows = []
    for r in out.get("results", []):
        img = r.get("image") or {}
        if r.get("ok"):
            what = (
                f"{action} {img.get('ref') or out.get('image', '')} "
                f"(sha256 {str(img.get('sha256', ''))[:12]}, {size_text(img.get('size'))})"
            )
        else:
            what = f"FAILED: {_error_line(r)}"
        rows.append([str(r.get("node", "")), what])
    return render_table(["NODE", "RESULT"], rows)


# --------------------------------------------------------------------------- commands

ImageOpt = Annotated[
    str,
    typer.Option(
        "--image",
        help="uenv image NAME/VERSION[:TAG], e.g. prgenv-gnu/24.11:v1.",
        show_default=False,
    ),
]


@cache_app.command("status")
def cache_status(
    ctx: typer.Context,
    node: Annotated[
        str | None,
        typer.Option("--node", help="Only this node (default: every node).", show_default=False),
    ] = None,
    output: OutputOpt = None,
) -> None:
    """Show the uenv images cached on every node (or one): size, last use, in use."""
    st = state_of(ctx)
    fmt = st.output(output)
    nodes = run_api(st, lambda client: client.cache_status(node))
    if node and nodes and not nodes[0].get("ok") and fmt in ("table", "wide"):
        err = nodes[0].get("error") or {}
        fail(
            str(err.get("message") or f"node {node} did not answer"),
            details=err.get("details") or None,
            hint=str(err.get("hint") or ""),
        )
    emit(st, fmt, nodes, lambda: status_text(nodes, time.time(), wide=fmt == "wide"))


@cache_app.command("warm")
def cache_warm(
    ctx: typer.Context,
    image: ImageOpt,
    nodes: Annotated[
        str | None,
        typer.Option("--nodes", help="Comma-separated node ids.", show_default=False),
    ] = None,
    group: Annotated[
        int | None,
        typer.Option("--group", help="Every node of this dragonfly group.", show_default=False),
    ] = None,
    all_nodes: Annotated[bool, typer.Option("--all", help="Every node.")] = False,
    output: OutputOpt = None,
) -> None:
    """Pre-fetch a uenv image into node caches (system admin): --nodes, --group or --all."""
    st = state_of(ctx)
    fmt = st.output(output)
    ids = [n.strip() for n in (nodes or "").split(",") if n.strip()]
    if sum((bool(ids), group is not None, all_nodes)) != 1:
        fail(
            "name the nodes to warm: exactly one of --nodes, --group or --all",
            hint="e.g. lattice cache warm --image=prgenv-gnu/24.11:v1 --group=3",
            code=2,
        )

    async def go(client: Any) -> Any:
        return await client.warm_cache(image, nodes=ids or None, group=group, all=all_nodes)

    # the server answers once every node has its copy (or gave up): wait for it
    out = run_api(st, go, min_timeout=WARM_TIMEOUT)
    emit(st, fmt, out, lambda: results_text(out, "cached"))
    failed = [r for r in out.get("results", []) if not r.get("ok")]
    if failed:
        hint = next(((r.get("error") or {}).get("hint") for r in failed), "") or ""
        fail(
            f"{out.get('image', image)} was not warmed on {len(failed)} of "
            f"{len(out.get('results', []))} node(s)",
            hint=hint or "See each node's error above; `lattice cache status` shows the caches.",
        )


@cache_app.command("evict")
def cache_evict(
    ctx: typer.Context,
    image: ImageOpt,
    node: Annotated[str, typer.Option("--node", help="The node's id.", show_default=False)],
    output: OutputOpt = None,
) -> None:
    """Remove a uenv image from one node's cache (system admin); refused while in use."""
    st = state_of(ctx)
    fmt = st.output(output)
    out = run_api(st, lambda client: client.evict_cache(image, node))
    if fmt in ("json", "yaml"):
        emit(st, fmt, out)
    elif not st.quiet:
        for r in out.get("results", []):
            img = r.get("image") or {}
            print(
                f"Evicted {img.get('ref') or image} "
                f"({size_text(img.get('size'))}) from {r.get('node', node)}"
            )


__all__ = ["WARM_TIMEOUT", "cache_app", "register", "results_text", "size_text", "status_text"]
