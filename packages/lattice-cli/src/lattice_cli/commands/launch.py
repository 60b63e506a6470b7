"""``lattice launch``: start ranks inside a Running allocation (srun's equivalent).

The agents serve PMI to the ranks (MPI without ssh); this command prints what the
ranks write as it comes and exits with the launch's exit status.
"""

from __future__ import annotations

import os
import sys
from typing import Annotated, Any

import typer

from lattice_cli.context import OutputOpt, run_api, state_of


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
    status = {"code": 1}

    from lattice_cli import output as out

    def show(ev: dict[str, Any]) -> None:
        kind = ev.get("type")
        if fmt in ("json", "yaml"):
            print(out.to_json(ev, compact=True), flush=True)
        elif kind == "output":
            line = ev.get("line", "")
            text = f"[{ev.get('rank')}] {line}" if label else line
            print(text, file=sys.stderr if ev.get("stream") == "stderr" else sys.stdout, flush=True)
        elif kind == "start" and st.verbose:
            print(
                f"launch {ev['task_id']}: {ev['world_size']} ranks on {', '.join(ev['nodes'])}",
                file=sys.stderr,
            )
        if kind == "done":
            status["code"] = int(ev.get("exit_status") or 0)
            if fmt not in ("json", "yaml") and status["code"] != 0:
                where = ""
                if ev.get("failed_rank", -1) >= 0:
                    where = f" at rank {ev['failed_rank']}"
                if ev.get("failed_node"):
                    where += f" on node {ev['failed_node']}"
                print(
                    f"lattice launch: failed{where} (exit {status['code']}): "
                    f"{ev.get('reason') or 'a rank failed'}",
                    file=sys.stderr,
                )

    async def go(client: Any) -> None:
        res = await client.launch_tasks(
            alloc_id,
            list(command),
            num_tasks=ntasks,
            tasks_per_node=tasks_per_node,
            env=variables,
            pmi=pmi,
            nodes=wanted,
            working_dir=os.path.abspath(chdir or os.getcwd()),
        )
        async for ev in client.watch_launch(alloc_id, res["task_id"]):
            show(ev)

    run_api(st, go)
    raise typer.Exit(status["code"])
