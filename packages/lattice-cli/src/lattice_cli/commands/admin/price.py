"""``lattice admin price set|list``: the accounting price list (system admins set).

::

    lattice admin price set --vcluster default --rate 5.00            # per node-hour
    lattice admin price set --vcluster gpu --resource gpu_hour --gpu-type a100 --rate 2.5
    lattice admin price set --vcluster default --resource allocation --rate 0.50
    lattice admin price list [--vcluster default]
"""

from __future__ import annotations

from typing import Annotated, Any

import typer

from lattice_cli.context import OutputOpt, emit, run_api, state_of

price_app = typer.Typer(help="The accounting price list.", no_args_is_help=True)


@price_app.command("set")
def price_set(
    ctx: typer.Context,
    vcluster: Annotated[str, typer.Option("--vcluster", help="vCluster the price applies to.")],
    rate: Annotated[str, typer.Option("--rate", help="Price per unit, e.g. 5.00.")],
    resource: Annotated[
        str, typer.Option("--resource", help="node_hour, gpu_hour or allocation.")
    ] = "node_hour",
    gpu_type: Annotated[str, typer.Option("--gpu-type", help="For gpu_hour prices.")] = "",
    multiplier: Annotated[str, typer.Option("--multiplier", help="Margin (default 1).")] = "",
    fixed_cost: Annotated[str, typer.Option("--fixed-cost", help="Once per allocation.")] = "",
    tenant: Annotated[str, typer.Option("--for-tenant", help="A tenant's own price.")] = "",
    valid_from: Annotated[str, typer.Option("--from", help="ISO 8601 (default: now).")] = "",
    valid_until: Annotated[str, typer.Option("--until", help="ISO 8601 (default: open).")] = "",
    output: OutputOpt = None,
) -> None:
    """Add a price; refused when its validity overlaps another for the same resource."""
    st = state_of(ctx)
    fields = {
        "resource": resource,
        "gpu_type": gpu_type,
        "multiplier": multiplier,
        "fixed_cost": fixed_cost,
        "tenant": tenant,
        "valid_from": valid_from,
        "valid_until": valid_until,
    }

    async def go(client: Any) -> Any:
        return await client.set_price(vcluster, rate, **{k: v for k, v in fields.items() if v})

    data = run_api(st, go)
    emit(st, st.output(output), data, lambda: prices_text([data]))


@price_app.command("list")
def price_list(
    ctx: typer.Context,
    vcluster: Annotated[
        str | None, typer.Option("--vcluster", help="Only this vCluster's.")
    ] = None,
    output: OutputOpt = None,
) -> None:
    """The prices, oldest first."""
    st = state_of(ctx)

    async def go(client: Any) -> Any:
        return await client.list_prices(vcluster)

    data = run_api(st, go)
    emit(st, st.output(output), data, lambda: prices_text(data))


def prices_text(prices: list[dict[str, Any]]) -> str:
    if not prices:
        return "no prices"
    head = ("ID", "VCLUSTER", "RESOURCE", "RATE", "MULT", "FIXED", "TENANT", "FROM", "UNTIL")
    rows = [
        (
            str(p.get("id") or ""),
            p["vcluster"],
            p["resource"] + (f" ({p['gpu_type']})" if p.get("gpu_type") else ""),
            p["rate"],
            p["multiplier"],
            p["fixed_cost"],
            p.get("tenant") or "-",
            str(p["valid_from"])[:19],
            str(p.get("valid_until") or "-")[:19],
        )
        for p in prices
    ]
    widths = [max(len(str(x)) for x in col) for col in zip(head, *rows, strict=True)]
    return "\n".join(
        "  ".join(str(c).ljust(w) for c, w in zip(r, widths, strict=True)).rstrip()
        for r in [head, *rows]
    )
