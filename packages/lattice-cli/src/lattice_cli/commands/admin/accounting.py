"""``lattice admin accounting status|reconcile``: the accounting service's state (its
quorum consumer, durable cursor, last charge pass, Waldur push) and a check of the
books for a time range (with Waldur: the range's events regenerated)."""

from __future__ import annotations

from typing import Annotated, Any

import typer

from lattice_cli.context import OutputOpt, emit, run_api, state_of

accounting_app = typer.Typer(help="The accounting service.", no_args_is_help=True)


@accounting_app.command("status")
def status(ctx: typer.Context, output: OutputOpt = None) -> None:
    """Consumer, cursor and lag, last charge pass, provider (Waldur buffer and push)."""
    st = state_of(ctx)

    async def go(client: Any) -> Any:
        return await client.accounting_status()

    data = run_api(st, go)
    emit(st, st.output(output), data, lambda: status_text(data))


@accounting_app.command("reconcile")
def reconcile(
    ctx: typer.Context,
    since: Annotated[str, typer.Option("--since", help="ISO 8601 date or time.")],
    until: Annotated[str, typer.Option("--until", help="ISO 8601 date or time.")],
    output: OutputOpt = None,
) -> None:
    """Check the ledger; with Waldur, regenerate the events of [since, until)."""
    st = state_of(ctx)

    async def go(client: Any) -> Any:
        return await client.accounting_reconcile(since, until)

    data = run_api(st, go)
    emit(st, st.output(output), data, lambda: reconcile_text(data))


def status_text(d: dict[str, Any]) -> str:
    p = d.get("last_pass") or {}
    lines = [
        f"Provider:     {d.get('provider', 'none')} (ledger on {d.get('backend', '?')})",
        f"Quorum:       {'connected' if d.get('connected') else 'DISCONNECTED'}, revision "
        f"{d.get('revision')}, cursor {d.get('cursor')} (lag {d.get('lag')})",
        f"Last pass:    {p.get('at', 'never')}: {p.get('charged', 0)} charged, "
        f"{p.get('finalized', 0)} finalized, {p.get('released', 0)} released, "
        f"{p.get('cancelled', 0)} cancelled ({float(p.get('seconds') or 0):.3f}s)",
    ]
    if d.get("exhausted"):
        lines.append(f"Out of funds: {', '.join(d['exhausted'])}")
    w = d.get("waldur")
    if w:
        lines.append(f"Waldur:       {w}")
    return "\n".join(lines)


def reconcile_text(d: dict[str, Any]) -> str:
    problems = d.get("discrepancies") or []
    head = f"{d.get('since')} .. {d.get('until')}: {d.get('events_queued', 0)} events queued"
    if not problems:
        return head + "; the books balance"
    return "\n".join(
        [head + f"; {len(problems)} discrepancies:"]
        + [
            f"  {p['what']} {p['subject']}: expected {p['expected']}, found {p['actual']}"
            for p in problems
        ]
    )
