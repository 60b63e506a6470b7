"""The submit path shared by ``lattice submit``, ``lattice sbatch`` and ``lattice srun``:
read a script, build an :class:`lattice_sdk.AllocationSpec` from merged
:class:`~lattice_cli.submit_options.SubmitOptions`, and send it (one allocation or a task
group). Not a command module (commands import it, never each other); the SDK is imported
inside the functions.
"""

from __future__ import annotations

import os
from typing import Any

from lattice_cli.context import State, fail, run_api, warn


def read_script(script: str, command: str = "lattice submit") -> tuple[str, str]:
    """(absolute path, text) of a batch script; a usage error when it cannot be used."""
    path = os.path.abspath(os.path.expanduser(script))
    if not os.path.isfile(path):
        fail(
            f"script {script!r} not found",
            hint="To run a command rather than a script, put it after `--`: "
            f"lattice submit -- {script} ..."
            if command == "lattice submit"
            else f"To run a command, use --wrap: {command} --wrap='{script} ...'",
            code=2,
        )
    try:
        with open(path, "rb") as fh:
            data = fh.read()
    except OSError as exc:
        fail(f"cannot read script {script!r}: {exc.strerror or exc}", code=2)
    if b"\0" in data[:8192]:
        fail(
            f"{script!r} is not a text script",
            hint=f"To run a program, put it after `--`: lattice submit -- {script}",
            code=2,
        )
    return path, data.decode("utf-8", errors="replace")


def build_spec(
    state: State,
    opts: Any,
    entrypoint: str,
    default_name: str,
    *,
    min_nodes: int | None = None,
    wait_for_capacity: bool = False,
) -> Any:
    """The AllocationSpec for merged options (config supplies tenant, vCluster and uenv).
    Prints the options' warnings."""
    from lattice_sdk import AllocationSpec

    from lattice_cli import directives
    from lattice_cli.submit_options import checkpoint_fields

    cfg = state.config
    for message in opts.warnings:
        warn(message)
    job_name = opts.name or default_name
    depends_on = directives.depends_on_of(opts.dependency, job_name) if opts.dependency else []
    return AllocationSpec(
        entrypoint=entrypoint,
        nodes=opts.nodes or 1,
        walltime=opts.walltime,
        tenant=opts.tenant or cfg.tenant,
        vcluster=opts.vcluster or cfg.vcluster,
        name=job_name,
        project=opts.project or "",
        preemption_class=5 if opts.preemption_class is None else opts.preemption_class,
        constraints=opts.constraints,
        env=opts.env,
        submit_dir=os.path.abspath(opts.submit_dir) if opts.submit_dir else os.getcwd(),
        uenv=opts.uenv or cfg.uenv,
        view=opts.view or "",
        image=opts.image or "",
        requeue_policy=opts.requeue,
        max_requeue=opts.max_requeue,
        tags=opts.tags,
        min_nodes=min_nodes,
        wait_for_capacity=wait_for_capacity,
        depends_on=depends_on,
        **checkpoint_fields(opts.checkpoint),
    )


def send(state: State, spec: Any, task_group: str | None) -> tuple[str, Any]:
    """Submit: ``("group", {"task_group_id", "allocation_ids", "tasks", "concurrency"})``
    for a task group, else ``("allocation", Allocation)``. API errors exit 1."""
    if task_group:

        async def go_group(client: Any) -> Any:
            return await client.submit_task_group(spec, task_group)

        return "group", run_api(state, go_group)

    async def go(client: Any) -> Any:
        return await client.submit(spec)

    return "allocation", run_api(state, go)


def test_only(state: State, fmt: str, spec: Any) -> None:
    """``--test-only``: when and on how many nodes it would start; nothing stored."""
    import time

    from lattice_cli import output as out
    from lattice_cli.context import emit

    async def go(client: Any) -> Any:
        return await client.test_submit(spec)

    est = run_api(state, go)
    if fmt in ("json", "yaml"):
        emit(state, fmt, est.raw)
        return
    print(out.test_only_text(est.raw, time.time()))
