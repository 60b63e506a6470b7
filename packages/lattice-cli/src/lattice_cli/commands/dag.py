"""``lattice dag submit|status|list|cancel``: DAG workflows, allocations that start when
their dependencies allow (Slurm: a chain of ``sbatch --dependency``, submitted as one).

The file is sent as written; the server parses and checks it (either documented form:
``name``/``allocations`` with ``depends_on: [{prep: success}]``, or ``dag:
{allocations: [{id, ..., depends_on: [{ref, condition}]}]}``), so the CLI and the API
refuse the same things with the same words. Members that name no tenant or vCluster
get the configured ones (``--tenant``/``--vcluster``, LATTICE_TENANT/LATTICE_VCLUSTER,
the config file). The renderers at the bottom are pure.
"""

from __future__ import annotations

import sys
from typing import Annotated, Any

import typer

from lattice_cli.context import OutputOpt, emit, fail, run_api, state_of

dag_app = typer.Typer(
    help="DAG workflows: submit a file of allocations with dependencies, follow and cancel it.",
    no_args_is_help=True,
)


def register(app: typer.Typer) -> None:
    app.add_typer(dag_app, name="dag")


DagArg = Annotated[
    str, typer.Argument(help="DAG ID (printed by `lattice dag submit`).", metavar="ID")
]


def _read_file(path: str) -> str:
    if path == "-":
        return sys.stdin.read()
    try:
        with open(path, encoding="utf-8") as f:
            return f.read()
    except FileNotFoundError:
        fail(f"no such DAG file: {path}", hint="Give the path of a YAML DAG file.", code=2)
    except IsADirectoryError:
        fail(f"{path} is a directory", hint="Give the path of a YAML DAG file.", code=2)
    except UnicodeDecodeError as e:
        fail(f"{path} is not UTF-8 text (byte {e.start})", hint="Save the file as UTF-8.", code=2)
    except OSError as e:
        fail(f"cannot read {path}: {e.strerror}", code=2)


@dag_app.command("submit")
def dag_submit(
    ctx: typer.Context,
    file: Annotated[
        str, typer.Argument(help="The DAG file (YAML); - reads standard input.", metavar="FILE")
    ],
    output: OutputOpt = None,
) -> None:
    """Submit a DAG workflow; refused as a whole, nothing stored, if any part is wrong."""
    st = state_of(ctx)
    fmt = st.output(output)
    text = _read_file(file)
    cfg = st.config

    async def go(client: Any) -> Any:
        return await client.submit_dag(
            text, tenant=cfg.tenant or None, vcluster=cfg.vcluster or None
        )

    res = run_api(st, go)
    if fmt in ("json", "yaml"):
        emit(st, fmt, res)
    elif st.quiet:
        print(res["dag_id"])
    else:
        n = len(res.get("allocation_ids") or [])
        print(f"Submitted DAG {res['dag_id']} with {n} allocation{'s' if n != 1 else ''}")


@dag_app.command("status")
def dag_status(ctx: typer.Context, dag_id: DagArg, output: OutputOpt = None) -> None:
    """A DAG's state and each allocation's (Blocked while it waits for dependencies)."""
    st = state_of(ctx)
    fmt = st.output(output)
    dag = run_api(st, lambda client: client.get_dag(dag_id))
    if fmt in ("json", "yaml"):
        emit(st, fmt, dag)
    else:
        print(dag_status_text(dag, wide=fmt == "wide"))


@dag_app.command("list")
def dag_list(
    ctx: typer.Context,
    all_users: Annotated[
        bool, typer.Option("--all", "-a", help="Every user's DAGs (needs permission).")
    ] = False,
    state: Annotated[
        str | None,
        typer.Option(
            "--state", help="Only DAGs in this state: Running, Completed, Failed, Cancelled."
        ),
    ] = None,
    user: Annotated[str | None, typer.Option("--user", "-u", help="Only this user's DAGs.")] = None,
    limit: Annotated[
        int | None, typer.Option("--limit", help="At most this many, newest first (default 100).")
    ] = None,
    output: OutputOpt = None,
) -> None:
    """Your DAGs, newest first."""
    st = state_of(ctx)
    fmt = st.output(output)
    dags = run_api(
        st,
        lambda client: client.list_dags(state=state, user=user, all=all_users, limit=limit),
    )
    if fmt in ("json", "yaml"):
        emit(st, fmt, dags)
    elif st.quiet:
        for d in dags:
            print(d["id"])
    elif not dags:
        print("No DAGs.")
    else:
        print(dag_table(dags))


@dag_app.command("cancel")
def dag_cancel(
    ctx: typer.Context,
    dag_id: DagArg,
    reason: Annotated[
        str, typer.Option("--reason", "-r", help="Why (recorded on each cancelled allocation).")
    ] = "",
    output: OutputOpt = None,
) -> None:
    """Cancel every allocation of a DAG that has not ended."""
    st = state_of(ctx)
    fmt = st.output(output)
    res = run_api(st, lambda client: client.cancel_dag(dag_id, reason=reason))
    if fmt in ("json", "yaml"):
        emit(st, fmt, res)
    elif not st.quiet:
        n = len(res.get("cancelled_allocation_ids") or [])
        dag = res.get("dag") or {}
        print(
            f"Cancelled DAG {dag.get('id') or dag_id}: "
            f"{n} allocation{'s' if n != 1 else ''} cancelled; it is {dag.get('state', '?')}"
        )


# --------------------------------------------------------------------------- rendering


def member_counts(dag: dict[str, Any]) -> str:
    """``"1 Running, 3 Blocked"``: members per state, in order of first appearance."""
    counts: dict[str, int] = {}
    for m in dag.get("members") or []:
        counts[m.get("state") or "?"] = counts.get(m.get("state") or "?", 0) + 1
    return ", ".join(f"{n} {s}" for s, n in counts.items()) or "—"


def dag_status_text(dag: dict[str, Any], *, wide: bool = False) -> str:
    from lattice_cli import output as out

    head = f"DAG {dag.get('id', '')}"
    if dag.get("name"):
        head += f" ({dag['name']})"
    head += f": {dag.get('state', '')}"
    if dag.get("user"):
        head += f", submitted by {dag['user']}"
    waits: dict[str, list[str]] = {}
    for e in dag.get("edges") or []:
        waits.setdefault(e["downstream"], []).append(f"{e['upstream']}:{e['condition']}")
    headers = ["REF", "ALLOCATION", "STATE"] + (["DEPENDS_ON"] if wide else [])
    rows = []
    for m in dag.get("members") or []:
        row = [m.get("ref", ""), m.get("allocation_id") or "—", m.get("state", "")]
        if wide:
            row.append(",".join(waits.get(m.get("ref", ""), [])) or "—")
        rows.append(row)
    return head + "\n" + out.render_table(headers, rows)


def dag_table(dags: list[dict[str, Any]]) -> str:
    from lattice_cli import output as out

    rows = [
        [
            d.get("id", ""),
            d.get("name") or "—",
            d.get("state", ""),
            str(len(d.get("members") or [])),
            member_counts(d),
            d.get("user", ""),
        ]
        for d in dags
    ]
    return out.render_table(["ID", "NAME", "STATE", "ALLOCS", "MEMBERS", "USER"], rows)
