"""Running ranks in an allocation and printing what they write: ``lattice launch`` and
``lattice srun`` inside an allocation. Not a command module (commands import it)."""

from __future__ import annotations

import os
import sys
from typing import Any

from lattice_cli.context import State, run_api


def run_launch(
    st: State,
    alloc_id: str,
    command: list[str],
    *,
    ntasks: int = 0,
    tasks_per_node: int = 0,
    env: dict[str, str] | None = None,
    pmi: str = "pmi2",
    nodes: list[str] | None = None,
    chdir: str | None = None,
    label: bool = False,
    fmt: str = "table",
) -> int:
    """Launch ``command`` as ranks of ``alloc_id``; print events as they come; return the
    launch's exit status (the abort status if a rank called MPI_Abort or failed, else 0)."""
    env = dict(env or {})
    nodes = list(nodes or [])
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
            env=env,
            pmi=pmi,
            nodes=nodes,
            working_dir=os.path.abspath(chdir or os.getcwd()),
        )
        async for ev in client.watch_launch(alloc_id, res["task_id"]):
            show(ev)

    run_api(st, go)
    return status["code"]
