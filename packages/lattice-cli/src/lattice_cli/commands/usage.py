"""``lattice usage``: node-hours, GPU-hours and budgets of a tenant or a user.

::

    lattice usage                       # your own usage over the budget period (90 days)
    lattice usage --tenant physics      # the tenant's usage, budgets and quotas
    lattice usage --user bob --days 30  # another user's (needs permission)
    lattice usage --user bob --tenant physics -o json

Imported by :mod:`lattice_cli.main` only for ``lattice usage`` and the root help; this
module imports typer and the standard library only, and everything else inside the
command. Rendering is in pure functions (:func:`tenant_text`, :func:`user_text`) tested
without a server.
"""

from __future__ import annotations

import enum
import time
from typing import Annotated, Any

import typer

from lattice_cli.context import emit, fail, run_api, state_of

MIN_DAYS = 1
MAX_DAYS = 3650


def register(app: typer.Typer) -> None:
    app.command("usage")(usage)


class UsageFormat(enum.StrEnum):
    table = "table"
    json = "json"
    yaml = "yaml"


def usage(
    ctx: typer.Context,
    tenant: Annotated[
        str | None,
        typer.Option(
            "--tenant",
            help="Show this tenant's usage, budgets and quotas; with --user, only that "
            "user's usage in this tenant.",
        ),
    ] = None,
    user: Annotated[
        str | None,
        typer.Option("--user", "-u", help="Show this user's usage (default: yours)."),
    ] = None,
    days: Annotated[
        int | None,
        typer.Option(
            "--days",
            help=f"Rolling window in days, {MIN_DAYS}..{MAX_DAYS} "
            "(default: the budget period, 90).",
        ),
    ] = None,
    output: Annotated[
        UsageFormat | None,
        typer.Option(
            "--output",
            "-o",
            help="Output format: table (default), json or yaml.",
            case_sensitive=False,
        ),
    ] = None,
) -> None:
    """Show node-hours and GPU-hours used: yours, a user's, or a tenant's with its budget."""
    st = state_of(ctx)
    if days is not None and not MIN_DAYS <= days <= MAX_DAYS:
        fail(
            f"--days must be between {MIN_DAYS} and {MAX_DAYS} (got {days})",
            hint="Pass a window in days, e.g. --days 30 (default: the 90-day budget period).",
            code=2,
        )
    fmt = output.value if output is not None else st.output()
    if fmt == "wide":
        fmt = "table"
    tenant = (tenant or "").strip() or None
    user = (user or "").strip() or None

    async def go(client: Any) -> Any:
        if tenant and not user:
            return await client.tenant_usage(tenant, days=days)
        return await client.user_usage(user, days=days, tenant=tenant)

    data = run_api(st, go)
    now = time.time()
    if tenant and not user:
        emit(st, fmt, data, lambda: tenant_text(data, now))
    else:
        emit(st, fmt, data, lambda: user_text(data, now))


# --------------------------------------------------------------------------- rendering

DASH = "—"


def _num(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def hours(value: Any) -> str:
    """Hours with two decimals and thousands separators: ``1,234.50``; ``<0.01`` for a
    little more than nothing (a few seconds of work)."""
    if not _num(value):
        return DASH
    return "<0.01" if 0 < value < 0.005 else f"{value:,.2f}"


def percent(value: Any) -> str:
    return f"{value * 100:.1f}%" if _num(value) else DASH


def _days(value: Any) -> str:
    if not _num(value):
        return DASH
    return f"{value:g} day" + ("" if value == 1 else "s")


def window_text(data: dict[str, Any]) -> str:
    from lattice_cli.output import iso_utc

    return f"last {_days(data.get('days'))} ({iso_utc(data.get('since'))} .. {iso_utc(data.get('until'))})"


def _allocations(data: dict[str, Any]) -> str:
    n = data.get("allocations", 0)
    running = data.get("running_allocations", 0)
    text = f"{n} ran in the window"
    if running:
        text += f"; {running} running now on {data.get('nodes_in_use', 0)} nodes"
    return text


def _budget_line(data: dict[str, Any], kind: str) -> str:
    budget = data.get(f"{kind}_hours_budget")
    if not _num(budget):
        return "none"
    used = data.get(f"{kind}_hours_used")
    fraction = data.get(f"{kind}_budget_fraction")
    remaining = data.get(f"{kind}_hours_remaining")
    return (
        f"{hours(used)} of {hours(budget)} ({percent(fraction)} used, {hours(remaining)} remaining)"
    )


def _quota(limit: Any, current: Any, what: str) -> str:
    limit_text = str(limit) if _num(limit) else "no limit"
    return f"{limit_text} ({current if _num(current) else 0} {what})"


def tenant_text(data: dict[str, Any], now: float | None = None) -> str:
    """The table form of ``GET /api/v1/tenants/{id}/usage``."""
    from lattice_cli.output import key_values, render_table

    period = data.get("budget_period_days")
    fraction = data.get("budget_fraction_used")
    if _num(fraction):
        budget_used = percent(fraction) + ("  (exhausted)" if fraction >= 1 else "")
    else:
        budget_used = "no budget set"
    target = data.get("fair_share_target")
    pairs: list[tuple[str, Any]] = [
        ("Tenant", data.get("tenant")),
        ("Window", window_text(data)),
        ("Node-hours", hours(data.get("node_hours"))),
        ("GPU-hours", hours(data.get("gpu_hours"))),
        ("Allocations", _allocations(data)),
        (f"Node-hours budget ({_days(period)})", _budget_line(data, "node")),
        (f"GPU-hours budget ({_days(period)})", _budget_line(data, "gpu")),
        ("Budget used", budget_used),
        ("Max nodes", _quota(data.get("max_nodes"), data.get("nodes_in_use"), "in use")),
        (
            "Max concurrent",
            _quota(
                data.get("max_concurrent_allocations"),
                data.get("running_allocations"),
                "running",
            ),
        ),
        (
            "Fair share",
            f"{percent(data.get('fair_share_usage'))} of node-hours used"
            + (f" (target {percent(target)})" if _num(target) and target > 0 else ""),
        ),
    ]
    text = key_values(pairs)
    users = data.get("users") or []
    if users:
        rows = [
            [
                str(u.get("user") or DASH),
                hours(u.get("node_hours")),
                hours(u.get("gpu_hours")),
                str(u.get("allocations", 0)),
                str(u.get("running_allocations", 0)),
            ]
            for u in users
        ]
        table = render_table(("USER", "NODE-HOURS", "GPU-HOURS", "ALLOCATIONS", "RUNNING"), rows)
        text += "\n\n" + table
    return text


def user_text(data: dict[str, Any], now: float | None = None) -> str:
    """The table form of ``GET /api/v1/usage``."""
    from lattice_cli.output import key_values, render_table

    pairs: list[tuple[str, Any]] = [
        ("User", data.get("user")),
        ("Tenant", data.get("tenant") or "all"),
        ("Window", window_text(data)),
        ("Node-hours", hours(data.get("node_hours"))),
        ("GPU-hours", hours(data.get("gpu_hours"))),
        ("Allocations", _allocations(data)),
    ]
    text = key_values(pairs)
    tenants = data.get("tenants") or []
    if tenants:
        rows = [
            [
                str(t.get("tenant") or DASH),
                hours(t.get("node_hours")),
                hours(t.get("gpu_hours")),
                str(t.get("allocations", 0)),
                str(t.get("running_allocations", 0)),
            ]
            for t in tenants
        ]
        table = render_table(("TENANT", "NODE-HOURS", "GPU-HOURS", "ALLOCATIONS", "RUNNING"), rows)
        text += "\n\n" + table
    return text
