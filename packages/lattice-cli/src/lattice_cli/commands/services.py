"""``lattice services [NAME]``: the service registry, where the exposed ports of running
service allocations answer.

::

    lattice services                 # every service of your tenant, with its endpoints
    lattice services api             # the endpoints of one service
    lattice services --tenant bio    # an admin's view of another tenant
    lattice services -o json

Endpoints are registered while an allocation with ``expose`` ports runs and move with
it when it is rescheduled. Rendering is the pure :func:`services_text`.
"""

from __future__ import annotations

from typing import Annotated, Any

import typer

from lattice_cli.context import OutputOpt, emit, run_api, state_of


def register(app: typer.Typer) -> None:
    app.command("services")(services)


def services_text(items: list[dict[str, Any]]) -> str:
    """One line per endpoint: NAME, ADDRESS (host:port), NODE, ALLOCATION, TENANT."""
    rows = [("NAME", "ADDRESS", "NODE", "ALLOCATION", "TENANT")]
    for svc in items:
        for e in svc.get("endpoints", []):
            rows.append(
                (
                    str(svc.get("name", "")),
                    f"{e.get('address', '')}:{e.get('port', '')}",
                    str(e.get("node_id", "")),
                    str(e.get("allocation_id", "")),
                    str(e.get("tenant", "")),
                )
            )
    if len(rows) == 1:
        return "No services registered."
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join(
        "  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in rows
    )


def services(
    ctx: typer.Context,
    name: Annotated[
        str | None,
        typer.Argument(help="Show one service's endpoints.", metavar="[NAME]", show_default=False),
    ] = None,
    tenant: Annotated[
        str | None,
        typer.Option("--tenant", help="Only this tenant's services (admins; default: yours)."),
    ] = None,
    output: OutputOpt = None,
) -> None:
    """List registered services (exposed ports of running allocations), or one service."""
    st = state_of(ctx)
    fmt = st.output(output)

    async def go(client: Any) -> Any:
        if name:
            return [await client.lookup_service(name, tenant=tenant)]
        return await client.list_services(tenant=tenant)

    items = run_api(st, go)
    data: Any = items[0] if name else items
    if st.quiet and fmt in ("table", "wide"):
        for svc in items:
            print(svc.get("name"))
        return
    emit(st, "table" if fmt == "wide" else fmt, data, lambda: services_text(items))
