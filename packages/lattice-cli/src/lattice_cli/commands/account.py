"""``lattice account``: balances, top-ups, transfers, transactions and costs of the
built-in ledger (``accounting.enabled``).

::

    lattice account balance                          # your tenant's account
    lattice account balance --project ml             # one project's: available, reserved
    lattice account topup --tenant physics 1000      # system admins
    lattice account transfer --project ml 250        # tenant -> project
    lattice account transactions --project ml --kind charge --limit 20
    lattice account costs --by user --since 2026-03-01 --until 2026-04-01

Amounts are decimal text, sent as typed (no float rounding). Rendering is in pure
functions (:func:`balance_text`, :func:`transactions_text`, :func:`costs_text`).
"""

from __future__ import annotations

from typing import Annotated, Any

import typer

from lattice_cli.context import OutputOpt, emit, run_api, state_of

account_app = typer.Typer(
    help="Balances, top-ups, transfers, transactions and costs (accounting).",
    no_args_is_help=True,
)

TenantOpt = Annotated[
    str | None, typer.Option("--tenant", help="Tenant (default: yours).", metavar="NAME")
]
ProjectOpt = Annotated[str | None, typer.Option("--project", help="Project of the tenant.")]


def register(app: typer.Typer) -> None:
    app.add_typer(account_app, name="account")


def _tenant(ctx: typer.Context, tenant: str | None) -> str | None:
    return (tenant or "").strip() or state_of(ctx).config.tenant or None


@account_app.command("balance")
def balance(
    ctx: typer.Context,
    tenant: TenantOpt = None,
    project: ProjectOpt = None,
    output: OutputOpt = None,
) -> None:
    """Available, reserved (held for queued and running work) and spent funds."""
    st = state_of(ctx)
    t = _tenant(ctx, tenant)

    async def go(client: Any) -> Any:
        return await client.balance(t, project or None)

    data = run_api(st, go)
    emit(st, st.output(output), data, lambda: balance_text(data))


@account_app.command("topup")
def topup(
    ctx: typer.Context,
    amount: Annotated[str, typer.Argument(help="Amount paid in, e.g. 1000 or 12.50.")],
    tenant: TenantOpt = None,
    output: OutputOpt = None,
) -> None:
    """Add funds to a tenant's account (system admins)."""
    st = state_of(ctx)
    t = _tenant(ctx, tenant) or ""

    async def go(client: Any) -> Any:
        return await client.topup(t, amount)

    data = run_api(st, go)
    emit(st, st.output(output), data, lambda: f"tenant {t}: " + _short(data))


@account_app.command("transfer")
def transfer(
    ctx: typer.Context,
    amount: Annotated[str, typer.Argument(help="Amount to move, e.g. 250.")],
    project: Annotated[str, typer.Option("--project", help="Project receiving the funds.")],
    tenant: TenantOpt = None,
    output: OutputOpt = None,
) -> None:
    """Move funds from the tenant's account to one of its projects."""
    st = state_of(ctx)
    t = _tenant(ctx, tenant)

    async def go(client: Any) -> Any:
        return await client.transfer(project, amount, tenant=t)

    data = run_api(st, go)
    emit(st, st.output(output), data, lambda: f"project {t}/{project}: " + _short(data))


@account_app.command("transactions")
def transactions(
    ctx: typer.Context,
    tenant: TenantOpt = None,
    project: ProjectOpt = None,
    allocation: Annotated[
        str | None, typer.Option("--allocation", help="One allocation's.")
    ] = None,
    kind: Annotated[
        str | None,
        typer.Option(
            "--kind", help="topup, transfer, reserve, release, charge, refund, adjustment"
        ),
    ] = None,
    user: Annotated[str | None, typer.Option("--user", "-u", help="This user's.")] = None,
    since: Annotated[str | None, typer.Option("--since", help="ISO 8601 date or time.")] = None,
    until: Annotated[str | None, typer.Option("--until", help="ISO 8601 date or time.")] = None,
    limit: Annotated[int, typer.Option("--limit", min=1, max=1000, help="At most this many.")] = 50,
    output: OutputOpt = None,
) -> None:
    """The journal, newest first."""
    st = state_of(ctx)
    filters = {
        "tenant": _tenant(ctx, tenant),
        "project": project,
        "allocation": allocation,
        "kind": kind,
        "user": user,
        "since": since,
        "until": until,
        "limit": limit,
    }

    async def go(client: Any) -> Any:
        return await client.transactions(**{k: v for k, v in filters.items() if v})

    data = run_api(st, go)
    emit(st, st.output(output), data, lambda: transactions_text(data))


@account_app.command("costs")
def costs(
    ctx: typer.Context,
    by: Annotated[
        str, typer.Option("--by", help="Group by project, user, vcluster, day (or tenant).")
    ] = "project",
    tenant: TenantOpt = None,
    project: ProjectOpt = None,
    since: Annotated[str | None, typer.Option("--since", help="ISO 8601 date or time.")] = None,
    until: Annotated[str | None, typer.Option("--until", help="ISO 8601 date or time.")] = None,
    output: OutputOpt = None,
) -> None:
    """What was spent (charges less refunds), grouped."""
    st = state_of(ctx)
    t = _tenant(ctx, tenant)

    async def go(client: Any) -> Any:
        return await client.costs(by, tenant=t, project=project, since=since, until=until)

    data = run_api(st, go)
    emit(st, st.output(output), data, lambda: costs_text(data))


# --------------------------------------------------------------------------- rendering


def _short(d: dict[str, Any]) -> str:
    return (
        f"available {d.get('available', '0.00')}, reserved {d.get('reserved', '0.00')}, "
        f"spent {d.get('spent', '0.00')}"
    )


def balance_text(d: dict[str, Any]) -> str:
    name = f"{d.get('tenant', '')}/{d['project']}" if d.get("project") else d.get("tenant", "")
    rows = [
        ("Account", str(d.get("account") or name)),
        ("Available", str(d.get("available", "0.00"))),
        ("Reserved", str(d.get("reserved", "0.00"))),
        ("Spent", str(d.get("spent", "0.00"))),
    ]
    if not d.get("project"):
        rows.append(("In projects", str(d.get("allocated", "0.00"))))
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k + ':':<{width + 1}} {v}" for k, v in rows)


def _money(text: Any) -> str:
    from decimal import Decimal, InvalidOperation

    try:
        return f"{Decimal(str(text)).quantize(Decimal('0.01')):.2f}"
    except (InvalidOperation, ValueError):
        return str(text)


def transactions_text(d: dict[str, Any]) -> str:
    rows = d.get("transactions") or []
    if not rows:
        return "no transactions"
    head = ("ID", "TIME", "KIND", "AMOUNT", "PROJECT", "ALLOCATION", "USER")
    table = [
        (
            str(t["id"]),
            str(t["at"])[:19].replace("T", " "),
            t["kind"],
            _money(t["amount"]),
            f"{t.get('tenant') or ''}/{t.get('project') or ''}".strip("/"),
            t.get("allocation_id") or "",
            t.get("user") or "",
        )
        for t in rows
    ]
    out = _table(head, table, right=(3,))
    if d.get("next_before_id"):
        out += "\n(more: raise --limit or narrow --since/--until)"
    return out


def costs_text(d: dict[str, Any]) -> str:
    rows = d.get("costs") or []
    if not rows:
        return "no costs"
    return _table(
        (str(d.get("by", "key")).upper(), "COST"),
        [(r["key"] or "-", r["amount"]) for r in rows],
        right=(1,),
    )


def _table(head: tuple[str, ...], rows: list[tuple[str, ...]], right: tuple[int, ...] = ()) -> str:
    widths = [max(len(str(x)) for x in col) for col in zip(head, *rows, strict=True)]

    def line(cells: tuple[str, ...]) -> str:
        return "  ".join(
            str(c).rjust(w) if i in right else str(c).ljust(w)
            for i, (c, w) in enumerate(zip(cells, widths, strict=True))
        ).rstrip()

    return "\n".join([line(head), *(line(r) for r in rows)])
