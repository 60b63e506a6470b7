"""``lattice srun``: Slurm's srun. Inside an allocation (``--jobid``, or
``$LATTICE_ALLOC_ID``/``$SLURM_JOB_ID`` as set in jobs and by ``salloc``) it is
``lattice launch``; outside one it submits a one-off job, waits for it and prints its
output, exiting with its exit code."""

from __future__ import annotations

import os
import sys
from typing import Any

import typer

from lattice_cli.context import fail, run_api, state_of, warn

_EPILOG = """Inside an allocation (lattice launch): -n/--ntasks, --ntasks-per-node, -N/--nodes, -l/--label, --mpi=pmi2|pmix|none, -D/--chdir, --export=VAR[=VALUE],..., -w/--nodelist. Outside one (a one-off job): -N/--nodes, -t/--time, -J/--job-name, -p/--partition, -A/--account, -C/--constraint, --gres, -D/--chdir, --export; -n and --ntasks-per-node then give the node count. --pty is not supported (use `lattice attach`). -c/--cpus-per-task, -u/--unbuffered and --exclusive are accepted and ignored."""


def register(app: typer.Typer) -> None:
    app.command(
        context_settings={
            "ignore_unknown_options": True,
            "allow_extra_args": True,
            "allow_interspersed_args": False,
            "help_option_names": ["--help"],
        },
        epilog=_EPILOG,
    )(srun)


def srun(ctx: typer.Context) -> None:
    """Run a command like srun: `lattice srun [OPTIONS] CMD [ARGS]`: ranks in the current
    allocation (lattice launch), or outside one a job whose output is printed."""
    from lattice_cli import slurm_cli
    from lattice_cli.submit_options import DirectiveError, parse_env_item

    st = state_of(ctx)
    try:
        args = slurm_cli.parse_srun_argv(list(ctx.args))
        env = {}
        for item in (args.settings.get("export") or "").split(","):
            item = item.strip()
            if not item or item.upper() in ("ALL", "NONE", "NIL"):
                continue
            if "=" in item:
                key, val = parse_env_item(item)
                env[key] = val
            elif item in os.environ:
                env[item] = os.environ[item]
    except DirectiveError as exc:
        fail(exc.message, hint=exc.hint, code=2)
    if "pty" in args.flags:
        fail(
            "srun --pty is not supported",
            hint="Attach a terminal to an allocation with `lattice attach ID`.",
            code=2,
        )
    if not args.command:
        fail("srun: no command given", hint="e.g. lattice srun -n 4 hostname", code=2)
    s = args.settings
    alloc_id = (
        s.get("jobid") or os.environ.get("LATTICE_ALLOC_ID") or os.environ.get("SLURM_JOB_ID")
    )
    if alloc_id:
        _in_allocation(st, alloc_id, args, env)
    _one_off(st, args, env)


def _count(value: str | None, what: str) -> int:
    from lattice_cli.submit_options import DirectiveError, parse_positive_int

    if value is None:
        return 0
    try:
        return parse_positive_int(value.partition("-")[0], what)
    except DirectiveError as exc:
        fail(f"srun: {exc.message}", hint=exc.hint, code=2)


def _in_allocation(st: Any, alloc_id: str, args: Any, env: dict[str, str]) -> None:
    from lattice_cli.launching import run_launch

    s = args.settings
    ntasks = _count(s.get("ntasks"), "ntasks")
    per_node = _count(s.get("ntasks_per_node"), "ntasks per node")
    nodes = []
    if s.get("nodelist"):
        from lattice_common.slurm import SlurmSyntaxError, expand_hostlist

        try:
            nodes = expand_hostlist(s["nodelist"])
        except SlurmSyntaxError as exc:
            fail(f"srun --nodelist: {exc.message}", hint=exc.hint, code=2)
    for key in ("time", "name", "partition", "account", "constraint", "gres"):
        if key in s:
            warn(f"srun --{key.replace('_', '-')} is ignored inside allocation {alloc_id}")
    if "nodes" in s and not per_node and ntasks:
        per_node = -(-ntasks // _count(s["nodes"], "nodes"))
    code = run_launch(
        st,
        alloc_id,
        list(args.command),
        ntasks=ntasks,
        tasks_per_node=per_node,
        env=env,
        pmi=s.get("mpi", "pmi2"),
        nodes=nodes,
        chdir=s.get("chdir"),
        label="label" in args.flags,
    )
    raise typer.Exit(code)


def _one_off(st: Any, args: Any, env: dict[str, str]) -> None:
    """Submit the command as a job of its own, wait for it, print its output."""
    import math

    from lattice_cli import directives, slurm_cli, submitting
    from lattice_cli import submit_options as d

    s = args.settings
    cfg = st.config
    opts = d.SubmitOptions(tenant=st.tenant, vcluster=st.vcluster, env=dict(env))
    tasks = directives.SlurmTasks()
    qos = {**directives.DEFAULT_QOS_MAP, **cfg.qos_map}
    sbatch_names = {
        "nodes": "--nodes",
        "time": "--time",
        "name": "--job-name",
        "partition": "--partition",
        "account": "--account",
        "constraint": "--constraint",
        "gres": "--gres",
        "chdir": "--chdir",
        "ntasks": "--ntasks",
        "ntasks_per_node": "--ntasks-per-node",
        "cpus_per_task": "--cpus-per-task",
    }
    try:
        for key, option in sbatch_names.items():
            if key in s:
                directives.apply_sbatch(
                    opts, tasks, option, s[key], None, cfg.partition_map, qos, dict(os.environ)
                )
        if tasks.ntasks and tasks.per_node and opts.nodes is None:
            opts.nodes = max(1, math.ceil(tasks.ntasks / tasks.per_node))
        if "mpi" in s:
            opts.tags["mpi"] = s["mpi"]
        entrypoint = directives.command_entrypoint(args.command)
    except d.DirectiveError as exc:
        fail(exc.message.replace("sbatch", "srun"), hint=exc.hint, code=2)
    opts.warnings = [w.replace("sbatch ", "srun ") for w in opts.warnings]
    spec = submitting.build_spec(st, opts, entrypoint, os.path.basename(args.command[0]))
    _kind, alloc = submitting.send(st, spec, None)
    print(f"srun: job {alloc.id} queued and waiting for resources", file=sys.stderr)

    async def wait(client: Any) -> Any:
        last = alloc
        async for ev in client.watch(alloc.id):
            last = ev.allocation
        lines = await client.logs(alloc.id)
        return last, lines

    final, lines = run_api(st, wait)
    label = "label" in args.flags
    for line in lines:
        text = f"0: {line.message}" if label else line.message
        print(text, file=sys.stderr if line.stream == "stderr" else sys.stdout)
    state = final.raw.get("state")
    code = final.raw.get("exit_code")
    if state != "Completed":
        code_name = slurm_cli.state_code(final.raw)[1]
        print(f"srun: error: job {alloc.id}: {code_name}", file=sys.stderr)
        raise typer.Exit(code if isinstance(code, int) and code > 0 else 1)
    raise typer.Exit(int(code or 0))
