"""``lattice sbatch``: Slurm's sbatch, flags and all, on the ``lattice submit`` path.

Flags are sbatch's (translated by the same code as ``#SBATCH`` lines, see
:mod:`lattice_cli.directives`); command-line flags override the script's directives.
Prints ``Submitted batch job <id>`` (``--parsable``: the id alone).
"""

from __future__ import annotations

import os
import sys

import typer

from lattice_cli.context import fail, state_of

_EPILOG = """Translated (as #SBATCH lines are): -N/--nodes, -n/--ntasks, --ntasks-per-node, -t/--time, -J/--job-name, -p/--partition (partition_map), -A/--account (tenant), -q/--qos (qos_map), --gres=gpu[:type]:N, --gpus-per-node, -C/--constraint, --mem, -c/--cpus-per-task, -a/--array=A-B[:S][%N], -d/--dependency, -D/--chdir, --export=[ALL,]VAR[=VALUE], --requeue/--no-requeue, --exclusive (the default), -o/--output and -e/--error (kept as tags; output stays in the log store: `lattice logs ID`), --mail-type/--mail-user (warning), --wrap=CMD, --parsable, --test-only. Other known sbatch options print a warning and are ignored; unknown ones are errors. Without a script or --wrap, the script is read from stdin."""


def register(app: typer.Typer) -> None:
    app.command(
        context_settings={
            "ignore_unknown_options": True,
            "allow_extra_args": True,
            "allow_interspersed_args": False,
            "help_option_names": ["-h", "--help"],
        },
        add_help_option=True,
        epilog=_EPILOG,
    )(sbatch)


def sbatch(ctx: typer.Context) -> None:
    """Submit a batch script with sbatch's flags: `lattice sbatch [OPTIONS] SCRIPT [ARGS]`.

    Prints `Submitted batch job <id>` (an array: the task group's id).
    """
    from lattice_cli import directives, slurm_cli, submitting
    from lattice_cli import submit_options as d

    state = state_of(ctx)
    cfg = state.config
    environ = dict(os.environ)
    try:
        cli = slurm_cli.parse_sbatch_argv(
            list(ctx.args),
            partition_map=cfg.partition_map,
            qos_map=cfg.qos_map,
            environ=environ,
        )
        if cli.wrap is not None:
            if cli.operands:
                fail("sbatch: a script and --wrap cannot both be given", code=2)
            entrypoint = directives.command_entrypoint(["/bin/sh", "-c", cli.wrap])
            script_opts, default_name = d.SubmitOptions(), "wrap"
        else:
            if cli.operands:
                path, text = submitting.read_script(cli.operands[0], "lattice sbatch")
                entrypoint = directives.script_entrypoint(path, text, cli.operands[1:])
                default_name = os.path.basename(path)
            elif not sys.stdin.isatty():
                text = sys.stdin.read()
                if not text.strip():
                    fail("sbatch: the script from stdin is empty", code=2)
                shell = directives.shebang_command(text)
                entrypoint = directives.command_entrypoint([*shell, "-c", text, "sbatch"])
                default_name = "sbatch"
            else:
                fail(
                    "sbatch: nothing to submit",
                    hint="Give a script (`lattice sbatch job.sh`) or a command "
                    "(`lattice sbatch --wrap='hostname'`).",
                    code=2,
                )
            script_opts = directives.parse_script(
                text, partition_map=cfg.partition_map, qos_map=cfg.qos_map, environ=environ
            )
        if script_opts.tags.keys() & {"slurm_output", "slurm_error"}:
            # one note about the log store is enough
            cli.opts.warnings = [w for w in cli.opts.warnings if "log store" not in w]
        flags = d.merge(cli.opts, d.SubmitOptions(tenant=state.tenant, vcluster=state.vcluster))
        opts = d.merge(script_opts, flags)
        slurm_cli.combine_tasks(script_opts, cli, opts)
    except d.DirectiveError as exc:
        fail(exc.message, hint=exc.hint, code=2)

    spec = submitting.build_spec(state, opts, entrypoint, default_name)
    if cli.test_only:
        if opts.task_group:
            fail("sbatch: --test-only takes a single job, not an array", code=2)
        submitting.test_only(state, state.output(None), spec)
        return
    kind, result = submitting.send(state, spec, opts.task_group)
    job_id = result["task_group_id"] if kind == "group" else result.id
    print(job_id if cli.parsable or state.quiet else f"Submitted batch job {job_id}")
