"""``lattice telemetry --alloc=ID --mode=MODE [--duration=D]``: switch an allocation's
telemetry mode on all its nodes (``PATCH /api/v1/allocations/{id}``).

::

    lattice telemetry --alloc=a1b2c3d4 --mode=debug --duration=30m   # 1 s data for 30 min
    lattice telemetry --alloc=a1b2c3d4 --mode=prod                   # back to 30 s windows

Debug mode reverts to the default after ``--duration`` (default 30 minutes); the switch
shows at once in ``lattice watch`` and ``lattice top``. The owner, a tenant admin of its
tenant or a system admin may switch it; sensitive allocations stay in audit mode.
"""

from __future__ import annotations

from typing import Annotated, Any

import typer

from lattice_cli.context import OutputOpt, emit, run_api, state_of

MODES = ("prod", "debug", "audit")


def register(app: typer.Typer) -> None:
    app.command("telemetry")(telemetry)


def telemetry(
    ctx: typer.Context,
    alloc: Annotated[str, typer.Option("--alloc", help="Allocation ID.", metavar="ID")],
    mode: Annotated[
        str, typer.Option("--mode", help="prod (30 s windows), debug (1 s raw) or audit.")
    ],
    duration: Annotated[
        str | None,
        typer.Option(
            "--duration",
            help="How long before it reverts: 90s, 30m, 2h (debug default: 30m).",
            metavar="DURATION",
        ),
    ] = None,
    output: OutputOpt = None,
) -> None:
    """Switch an allocation's telemetry mode (prod, debug, audit) on all its nodes."""
    from lattice_cli.context import fail

    st = state_of(ctx)
    fmt = st.output(output)
    chosen = mode.strip().lower()
    if chosen not in MODES:
        fail(f"unknown telemetry mode {mode!r}", hint="Use --mode=prod, debug or audit.", code=2)

    async def go(client: Any) -> Any:
        return await client.set_telemetry_mode(alloc, chosen, duration)

    result = run_api(st, go)
    emit(st, fmt, result, lambda: None if st.quiet else mode_switched_text(result))


def mode_switched_text(result: dict[str, Any]) -> str:
    """``Telemetry of a1b2 is now debug on 2 nodes until 12:30:00 (then prod).`` and a
    line per node that did not take it (pure)."""
    import time

    nodes = result.get("nodes") or []
    ok = [n for n in nodes if n.get("ok")]
    until = result.get("until")
    text = (
        f"Telemetry of {result.get('allocation_id')} is now {result.get('telemetry_mode')} "
        f"on {len(ok)} node{'s' if len(ok) != 1 else ''}"
    )
    if isinstance(until, int | float) and until:
        default = next((n.get("default_mode") for n in ok if n.get("default_mode")), "prod")
        stamp = time.strftime("%H:%M:%S", time.localtime(until))
        text += f" until {stamp} (then {default})"
    lines = [text + "."]
    for n in nodes:
        if not n.get("ok"):
            err = n.get("error") or {}
            lines.append(f"  {n.get('node')}: not switched: {err.get('message') or 'no answer'}")
    return "\n".join(lines)
