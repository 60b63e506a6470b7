"""``lattice admin tenant create|list|update|set-quota``: tenants and their quotas."""

from __future__ import annotations

from typing import Annotated, Any

import typer

from lattice_cli.context import OutputOpt, emit, fail, run_api, show_one, state_of

tenant_app = typer.Typer(
    help="Create, list and update tenants and their quotas.", no_args_is_help=True
)


MaxNodesOpt = Annotated[
    int | None, typer.Option("--max-nodes", help="Hard limit on nodes in use.", min=0)
]
MaxConcurrentOpt = Annotated[
    int | None,
    typer.Option("--max-concurrent-allocations", help="Hard limit on running allocations.", min=0),
]
FairShareOpt = Annotated[
    float | None,
    typer.Option("--fair-share-target", help="Soft share of the cluster (0..1).", min=0),
]
BurstOpt = Annotated[
    float | None,
    typer.Option(
        "--burst-allowance",
        help=(
            "How far above its fair share target the tenant may burst, as a multiple of "
            "the target (1.5 = up to 150%); beyond it its work only starts when no one "
            "else's can. 0 = not set."
        ),
        min=0,
    ),
]
GpuHoursOpt = Annotated[
    float | None, typer.Option("--gpu-hours-budget", help="GPU-hours budget.", min=0)
]
NodeHoursOpt = Annotated[
    float | None, typer.Option("--node-hours-budget", help="Node-hours budget.", min=0)
]
MaxClassOpt = Annotated[
    int | None,
    typer.Option(
        "--max-preemption-class",
        help="Highest preemption class (0-10) its users may submit with.",
        min=0,
        max=10,
    ),
]
IsolationOpt = Annotated[
    str | None, typer.Option("--isolation", help="standard or strict (sensitive workloads).")
]


def _tenant_fields(**kwargs: Any) -> dict[str, Any]:
    return {k: v for k, v in kwargs.items() if v is not None}


@tenant_app.command("create")
def tenant_create(
    ctx: typer.Context,
    name: Annotated[str, typer.Option("--name", help="Tenant name.")],
    max_nodes: MaxNodesOpt = None,
    max_concurrent_allocations: MaxConcurrentOpt = None,
    fair_share_target: FairShareOpt = None,
    burst_allowance: BurstOpt = None,
    gpu_hours_budget: GpuHoursOpt = None,
    node_hours_budget: NodeHoursOpt = None,
    isolation: IsolationOpt = None,
    max_preemption_class: MaxClassOpt = None,
    output: OutputOpt = None,
) -> None:
    """Create a tenant with its quotas."""
    st = state_of(ctx)
    fields = _tenant_fields(
        max_nodes=max_nodes,
        max_concurrent_allocations=max_concurrent_allocations,
        fair_share_target=fair_share_target,
        burst_allowance=burst_allowance,
        gpu_hours_budget=gpu_hours_budget,
        node_hours_budget=node_hours_budget,
        isolation=isolation,
        max_preemption_class=max_preemption_class,
    )

    async def go(client: Any) -> Any:
        return await client.create_tenant(name, **fields)

    tenant = run_api(st, go)
    show_one(st, output, tenant, f"Created tenant {tenant.name or name}")


@tenant_app.command("list")
def tenant_list(ctx: typer.Context, output: OutputOpt = None) -> None:
    """List tenants and their quotas."""
    from lattice_cli import output as out

    st = state_of(ctx)

    async def go(client: Any) -> Any:
        return await client.list_tenants()

    raws = [t.raw for t in run_api(st, go)]
    emit(st, st.output(output), raws, lambda: out.tenant_table(raws))


def _tenant_update(ctx: typer.Context, name: str, output: Any, **kwargs: Any) -> None:
    st = state_of(ctx)
    fields = _tenant_fields(**kwargs)
    if not fields:
        fail("nothing to update", hint="Give at least one option, e.g. --max-nodes=250.", code=2)

    async def go(client: Any) -> Any:
        return await client.update_tenant(name, **fields)

    tenant = run_api(st, go)
    show_one(st, output, tenant, f"Updated tenant {tenant.name or name}")


@tenant_app.command("update")
def tenant_update(
    ctx: typer.Context,
    name: Annotated[str, typer.Argument(help="Tenant name.", metavar="NAME")],
    max_nodes: MaxNodesOpt = None,
    max_concurrent_allocations: MaxConcurrentOpt = None,
    fair_share_target: FairShareOpt = None,
    burst_allowance: BurstOpt = None,
    gpu_hours_budget: GpuHoursOpt = None,
    node_hours_budget: NodeHoursOpt = None,
    isolation: IsolationOpt = None,
    max_preemption_class: MaxClassOpt = None,
    output: OutputOpt = None,
) -> None:
    """Change a tenant's quotas; options not given stay as they are."""
    _tenant_update(
        ctx,
        name,
        output,
        max_nodes=max_nodes,
        max_concurrent_allocations=max_concurrent_allocations,
        fair_share_target=fair_share_target,
        burst_allowance=burst_allowance,
        gpu_hours_budget=gpu_hours_budget,
        node_hours_budget=node_hours_budget,
        isolation=isolation,
        max_preemption_class=max_preemption_class,
    )


@tenant_app.command("set-quota")
def tenant_set_quota(
    ctx: typer.Context,
    name: Annotated[str, typer.Option("--name", help="Tenant name.")],
    max_nodes: MaxNodesOpt = None,
    max_concurrent_allocations: MaxConcurrentOpt = None,
    output: OutputOpt = None,
) -> None:
    """Change a tenant's hard quotas (same as `update`, spelled as in the spec)."""
    _tenant_update(
        ctx,
        name,
        output,
        max_nodes=max_nodes,
        max_concurrent_allocations=max_concurrent_allocations,
    )
