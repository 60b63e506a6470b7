"""The ``lattice`` command: the root app, its global options, and the table of commands.

Start time matters (``lattice status`` is typed all day), so each command lives in its own
module under :mod:`lattice_cli.commands` and :func:`main` imports only the one named on
the command line (all of them only for the root help, an unknown word, or shell
completion). Adding a command is one module there and one line in :data:`COMMANDS`.
Shared state and printing are in :mod:`lattice_cli.context`; parsing and rendering in
pure modules (:mod:`lattice_cli.directives`, :mod:`lattice_cli.config`,
:mod:`lattice_cli.output`).
"""

from __future__ import annotations

import os
import sys
from typing import Annotated, Any

import typer

from lattice_cli import __version__, _fastparams
from lattice_cli.context import OutputOpt, State

_fastparams.install()  # plain option conversion without importing pydantic (see module)

_HELP = """Lattice: submit and manage workloads on a Lattice HPC/AI cluster.

Slurm users: `sbatch` -> `lattice submit`, `squeue` -> `lattice status`,
`scancel` -> `lattice cancel`, `sinfo` -> `lattice nodes`. The Slurm names work too,
with Slurm's flags (`lattice sbatch`, `lattice squeue`, ...): `eval "$(lattice compat-aliases)"`.
"""

# Command word -> the module whose register(app) adds it; in the order of the root help.
COMMANDS: dict[str, str] = {
    "submit": "lattice_cli.commands.submit",
    "status": "lattice_cli.commands.status",
    "queue": "lattice_cli.commands.queue",
    "cancel": "lattice_cli.commands.cancel",
    "suspend": "lattice_cli.commands.suspend",
    "resume": "lattice_cli.commands.resume",
    "checkpoint": "lattice_cli.commands.checkpoint",
    "logs": "lattice_cli.commands.logs",
    "top": "lattice_cli.commands.top",
    "watch": "lattice_cli.commands.watch",
    "telemetry": "lattice_cli.commands.telemetry",
    "compare": "lattice_cli.commands.compare",
    "diag": "lattice_cli.commands.diag",
    "diagnostics": "lattice_cli.commands.diag",  # the spec's other spelling (hidden)
    "launch": "lattice_cli.commands.launch",
    "attach": "lattice_cli.commands.attach",
    "session": "lattice_cli.commands.session",
    "dag": "lattice_cli.commands.dag",
    "nodes": "lattice_cli.commands.nodes",
    "services": "lattice_cli.commands.services",
    "cache": "lattice_cli.commands.cache",
    "usage": "lattice_cli.commands.usage",
    "account": "lattice_cli.commands.account",
    "node": "lattice_cli.commands.node",
    "admin": "lattice_cli.commands.admin",
    "dev": "lattice_cli.commands.dev",
    "history": "lattice_cli.commands.history",
    "login": "lattice_cli.commands.login",
    "logout": "lattice_cli.commands.logout",
    "whoami": "lattice_cli.commands.whoami",
    # Slurm's own command names, with Slurm's flags (see the README's "Slurm compatibility")
    "sbatch": "lattice_cli.commands.sbatch",
    "squeue": "lattice_cli.commands.squeue",
    "scancel": "lattice_cli.commands.scancel",
    "sinfo": "lattice_cli.commands.sinfo",
    "sacct": "lattice_cli.commands.sacct",
    "srun": "lattice_cli.commands.srun",
    "salloc": "lattice_cli.commands.salloc",
    "compat-aliases": "lattice_cli.commands.compat_aliases",
}

app = typer.Typer(
    name="lattice",
    help=_HELP,
    no_args_is_help=True,
    pretty_exceptions_show_locals=False,
    context_settings={"help_option_names": ["-h", "--help"]},
)


# --------------------------------------------------------------------------- root


def _version_callback(value: bool) -> None:
    if value:
        print(f"lattice {__version__}")
        raise typer.Exit()


@app.callback()
def root(
    ctx: typer.Context,
    output: OutputOpt = None,
    quiet: Annotated[
        bool, typer.Option("--quiet", "-q", help="Print only essential output (e.g. bare IDs).")
    ] = False,
    verbose: Annotated[
        bool, typer.Option("--verbose", "-v", help="Print debug information to stderr.")
    ] = False,
    tenant: Annotated[
        str | None,
        typer.Option("--tenant", help="Tenant to act as (overrides config and env)."),
    ] = None,
    vcluster: Annotated[
        str | None,
        typer.Option("--vcluster", help="Default vCluster (overrides config and env)."),
    ] = None,
    config: Annotated[
        str | None,
        typer.Option(
            "--config",
            help="Config file (default: ~/.config/lattice/config.yaml, or $LATTICE_CONFIG).",
            metavar="PATH",
        ),
    ] = None,
    no_color: Annotated[bool, typer.Option("--no-color", help="Disable colored output.")] = False,
    endpoint: Annotated[
        str | None,
        typer.Option(
            "--endpoint",
            help="API address, e.g. http://127.0.0.1:8080 (overrides LATTICE_ENDPOINT).",
            metavar="URL",
        ),
    ] = None,
    version: Annotated[
        bool,
        typer.Option(
            "--version",
            help="Show the version and exit.",
            callback=_version_callback,
            is_eager=True,
        ),
    ] = False,
) -> None:
    """Lattice: submit and manage workloads on a Lattice HPC/AI cluster."""
    ctx.obj = State(
        output=output.value if output else None,
        quiet=quiet,
        verbose=verbose,
        tenant=tenant,
        vcluster=vcluster,
        config_path=config,
        no_color=no_color,
        endpoint=endpoint,
    )


# --------------------------------------------------------------------------- commands

# Root options that take a value (so the word after them is not the command).
_ROOT_VALUE_OPTIONS = {"-o", "--output", "--tenant", "--vcluster", "--config", "--endpoint"}
_loaded: set[str] = set()


def _root_options(args: list[str]) -> tuple[list[str], str | None]:
    """The root options in ``args`` (without their values), and the command word after
    them (None for none, or after ``--``)."""
    options: list[str] = []
    i = 0
    while i < len(args):
        arg = args[i]
        if arg == "--":
            return options, None
        if not arg.startswith("-"):
            return options, arg
        options.append(arg)
        i += 2 if arg in _ROOT_VALUE_OPTIONS else 1
    return options, None


def command_word(args: list[str]) -> str | None:
    """The subcommand named in ``args`` (skipping root options and their values)."""
    return _root_options(args)[1]


def load_commands(args: list[str] | None = None) -> None:
    """Register the command named in ``args`` on :data:`app`; every command when ``args``
    is None, names none (root help), names an unknown word (so the error can suggest one),
    or when the shell asks for completions. Each module is registered once."""
    word = None if args is None or os.environ.get("_LATTICE_COMPLETE") else command_word(args)
    names = [word] if word in COMMANDS else list(COMMANDS)
    for name in names:
        if name not in _loaded:
            # __import__, not importlib.import_module: only imports made through the
            # import statement's C path show up in `python -X importtime`.
            __import__(COMMANDS[name], fromlist=["register"]).register(app)
            _loaded.add(name)


def _root_short_t(args: list[str]) -> bool:
    """Whether ``-t`` is given before the command (the root's old short form of --tenant)."""
    return any(o.startswith("-t") for o in _root_options(args)[0])


def main(argv: list[str] | None = None) -> Any:
    args = list(sys.argv[1:] if argv is None else argv)
    if _root_short_t(args):
        from lattice_cli.context import fail

        try:
            fail(
                "-t is not a global option: it means time (--walltime), as in sbatch",
                hint="Give the tenant as --tenant NAME (e.g. `lattice --tenant physics status`).",
                code=2,
            )
        except typer.Exit as exc:
            sys.exit(exc.exit_code)
    load_commands(args)
    try:
        return app(args=args, prog_name="lattice")
    except BrokenPipeError:  # `lattice status | head`
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        sys.exit(1)


if __name__ == "__main__":
    main()
