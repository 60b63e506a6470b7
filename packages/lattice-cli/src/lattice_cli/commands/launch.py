"""``lattice launch``: start ranks inside a Running allocation (srun's equivalent).

The agents serve PMI to the ranks (MPI without ssh); this command prints what the
ranks write as it comes and exits with the launch's exit status.
"""

from __future__ import annotations

import os
from typing import Annotated

import typer

from lattice_cli.context import OutputOpt, state_of


def register(app: typer.Typer) -> None:
    app.command(
        context_settings={"allow_interspersed_args": False},
        epilog="Example: lattice launch --alloc=123 -n 8 --tasks-per-node=4 -- ./my_mpi_app",
    )(launch)


def _env_pairs(values: list[str]) -> dict[str, str]:
    env: dict[str, str] = {}
    for item in values:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise typer.BadParameter(f"{item!r} is not KEY=VALUE", param_hint="--env")
        env[key] = value
    return env


def launch(
    ctx: typer.Context,
    command: Annotated[
        list[str], typer.Argument(help="The program and its arguments (after --).", metavar="CMD")
    ],
    alloc: Annotated[
        str | None,
        typer.Option(
            "--alloc",
            help="Allocation to launch in (default: $LATTICE_ALLOC_ID, set inside allocations).",
        ),
    ] = None,
    ntasks: Annotated[
        int, typer.Option("--ntasks", "-n", help="Total ranks (default: one per node).", min=0)
    ] = 0,
    tasks_per_node: Annotated[
        int, typer.Option("--tasks-per-node", help="Ranks on each node.", min=0)
    ] = 0,
    env: Annotated[
        list[str] | None,
        typer.Option("--env", "-e", help="KEY=VALUE for every rank (repeatable).", metavar="K=V"),
    ] = None,
    pmi: Annotated[
        str,
        typer.Option(
            "--pmi",
            help="pmi2 (default; PMI-1 clients such as MPICH are detected), pmi1, pmix, or "
            "none for programs that are not MPI.",
        ),
    ] = "pmi2",
    nodes: Annotated[
        str | None, typer.Option("--nodes", help="Only these nodes (comma-separated).")
    ] = None,
    chdir: Annotated[
        str | None, typer.Option("--chdir", "-D", help="Working directory of the ranks.")
    ] = None,
    label: Annotated[
        bool, typer.Option("--label", "-l", help="Prefix each output line with its rank.")
    ] = False,
    output: OutputOpt = None,
) -> None:
    """Run CMD as N ranks in an allocation; the agents are the MPI process manager (no ssh).

    Node i gets ranks [i*K, (i+1)*K) with --tasks-per-node K. Output is printed as it
    comes (stderr to stderr); the exit status is the launch's: the abort status if a
    rank called MPI_Abort or failed, else 0.
    """
    st = state_of(ctx)
    fmt = st.output(output)
    alloc_id = alloc or os.environ.get("LATTICE_ALLOC_ID")
    if not alloc_id:
        raise typer.BadParameter(
            "which allocation? Give --alloc=ID (inside an allocation $LATTICE_ALLOC_ID is used)",
            param_hint="--alloc",
        )
    if pmi not in ("pmi1", "pmi2", "pmix", "none"):
        raise typer.BadParameter("choose pmi1, pmi2, pmix or none", param_hint="--pmi")
    variables = _env_pairs(env or [])
    wanted = [n for n in (nodes or "").split(",") if n]
    from lattice_cli.launching import run_launch

    code = run_launch(
        st,
        alloc_id,
        list(command),
        ntasks=ntasks,
        tasks_per_node=tasks_per_node,
        env=variables,
        pmi=pmi,
        nodes=wanted,
        chdir=chdir,
        label=label,
        fmt=fmt,
    )
    raise typer.Exit(code)
