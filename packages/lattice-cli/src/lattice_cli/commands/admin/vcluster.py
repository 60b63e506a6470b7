"""``lattice admin vcluster create|list|show|set-weights``: vClusters and their
cost-function weights."""

from __future__ import annotations

import enum
from typing import Annotated, Any

import typer

from lattice_cli.context import OutputOpt, emit, fail, run_api, show_one, state_of

vcluster_app = typer.Typer(help="Create, list and update vClusters.", no_args_is_help=True)


class SchedulerType(enum.StrEnum):
    """``--scheduler``; a copy of :class:`lattice_common.types.SchedulerType` (importing
    that module costs ~80 ms at start; ``tests/test_core_names.py`` keeps the two equal)."""

    hpc_backfill = "hpc-backfill"
    service_binpack = "service-binpack"
    sensitive_reservation = "sensitive-reservation"
    interactive_fifo = "interactive-fifo"


@vcluster_app.command("create")
def vcluster_create(
    ctx: typer.Context,
    name: Annotated[str, typer.Option("--name", help="vCluster name.")],
    scheduler: Annotated[
        SchedulerType,
        typer.Option("--scheduler-type", "--scheduler", help="Scheduling policy of the vCluster."),
    ] = SchedulerType.hpc_backfill,
    tenant: Annotated[
        str, typer.Option("--tenant", help="Owning tenant (empty: shared by all tenants).")
    ] = "",
    cycle_interval: Annotated[
        float | None,
        typer.Option("--cycle-interval", help="Seconds between scheduling cycles.", min=0),
    ] = None,
    backfill_depth: Annotated[
        int | None, typer.Option("--backfill-depth", help="Backfill look-ahead.", min=0)
    ] = None,
    allow_borrowing: Annotated[
        bool | None,
        typer.Option(
            "--allow-borrowing/--no-allow-borrowing", help="Lend idle nodes to other vClusters."
        ),
    ] = None,
    output: OutputOpt = None,
) -> None:
    """Create a vCluster."""
    st = state_of(ctx)

    async def go(client: Any) -> Any:
        return await client.create_vcluster(
            name,
            scheduler_type=scheduler.value,
            tenant=tenant,
            cycle_interval_seconds=cycle_interval,
            backfill_depth=backfill_depth,
            allow_borrowing=allow_borrowing,
        )

    vc = run_api(st, go)
    show_one(st, output, vc, f"Created vCluster {vc.name or name}")


@vcluster_app.command("list")
def vcluster_list(ctx: typer.Context, output: OutputOpt = None) -> None:
    """List vClusters."""
    from lattice_cli import output as out

    st = state_of(ctx)

    async def go(client: Any) -> Any:
        return await client.list_vclusters()

    raws = [v.raw for v in run_api(st, go)]
    emit(st, st.output(output), raws, lambda: out.vcluster_table(raws))


@vcluster_app.command("show")
def vcluster_show(
    ctx: typer.Context,
    name: Annotated[str, typer.Argument(help="vCluster name.", metavar="NAME")],
    output: OutputOpt = None,
) -> None:
    """Show one vCluster: scheduler type, cycle, backfill depth and its weights."""
    from lattice_cli import output as out

    st = state_of(ctx)

    async def go(client: Any) -> Any:
        return await client.get_vcluster(name)

    raw = run_api(st, go).raw
    emit(st, st.output(output), raw, lambda: out.vcluster_detail(raw))


# CostWeights' field names in order (w1..w9), spelled out: importing lattice_common.types
# (msgspec) would add ~80 ms to every command's start. tests/test_core_names.py fails when
# this list and CostWeights differ, and when set-weights lacks a `--<name>` flag for one.
WEIGHTS = (
    "priority",
    "wait_time",
    "fair_share",
    "topology",
    "data_readiness",
    "backlog",
    "energy",
    "checkpoint_efficiency",
    "conformance",
)


@vcluster_app.command("set-weights")
def vcluster_set_weights(
    ctx: typer.Context,
    name: Annotated[str, typer.Option("--name", help="vCluster name.")],
    weight: Annotated[
        list[str] | None,
        typer.Option(
            "--weight",
            help="NAME=VALUE, repeatable; names: " + ", ".join(WEIGHTS) + ".",
        ),
    ] = None,
    priority: Annotated[
        float | None, typer.Option("--priority", help="w1, priority class.")
    ] = None,
    wait_time: Annotated[float | None, typer.Option("--wait-time", help="w2, wait time.")] = None,
    fair_share: Annotated[
        float | None, typer.Option("--fair-share", help="w3, fair share.")
    ] = None,
    topology: Annotated[
        float | None, typer.Option("--topology", help="w4, topology fitness.")
    ] = None,
    data_readiness: Annotated[
        float | None, typer.Option("--data-readiness", help="w5, data readiness.")
    ] = None,
    backlog: Annotated[
        float | None, typer.Option("--backlog", help="w6, backlog pressure.")
    ] = None,
    energy: Annotated[float | None, typer.Option("--energy", help="w7, energy cost.")] = None,
    checkpoint_efficiency: Annotated[
        float | None,
        typer.Option("--checkpoint-efficiency", help="w8, checkpoint efficiency."),
    ] = None,
    checkpoint_alias: Annotated[
        float | None,
        typer.Option(
            "--checkpoint",
            hidden=True,
            help="Same as --checkpoint-efficiency (the Performance Tuning Guide's spelling).",
        ),
    ] = None,
    conformance: Annotated[
        float | None, typer.Option("--conformance", help="w9, conformance fitness.")
    ] = None,
    output: OutputOpt = None,
) -> None:
    """Change cost-function weights of a vCluster (only the ones given); the scheduler
    uses them from its next cycle, no restart needed."""
    if checkpoint_alias is not None:
        if checkpoint_efficiency is not None and checkpoint_efficiency != checkpoint_alias:
            fail(
                "--checkpoint and --checkpoint-efficiency give w8 two different values",
                hint="Give one of them (--checkpoint is the other's old spelling).",
                code=2,
            )
        checkpoint_efficiency = checkpoint_alias
    weights: dict[str, float] = {
        k: v
        for k, v in {
            "priority": priority,
            "wait_time": wait_time,
            "fair_share": fair_share,
            "topology": topology,
            "data_readiness": data_readiness,
            "backlog": backlog,
            "energy": energy,
            "checkpoint_efficiency": checkpoint_efficiency,
            "conformance": conformance,
        }.items()
        if v is not None
    }
    for key, val in weights.items():
        if not 0.0 <= val <= 1.0:
            fail(
                f"weight {key} must be between 0 and 1, not {val}",
                hint="e.g. --priority=0.3",
                code=2,
            )
    for item in weight or []:
        key, sep, value = item.partition("=")
        key = key.strip().replace("-", "_")
        if not sep or key not in WEIGHTS:
            fail(
                f"invalid weight {item!r}",
                hint="Use NAME=VALUE with NAME one of: " + ", ".join(WEIGHTS),
                code=2,
            )
        try:
            weights[key] = float(value)
        except ValueError:
            fail(f"weight {key} must be a number, not {value!r}", code=2)
    if not weights:
        fail(
            "nothing to update",
            hint="Give at least one weight, e.g. --priority=0.3 (or --weight priority=0.3).",
            code=2,
        )
    st = state_of(ctx)

    async def go(client: Any) -> Any:
        return await client.update_vcluster(name, weights=weights)

    vc = run_api(st, go)
    show_one(st, output, vc, f"Updated weights of vCluster {vc.name or name}")
