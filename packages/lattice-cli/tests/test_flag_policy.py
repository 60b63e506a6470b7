"""The short-flag policy of the CLI README ("Short flags"), checked over every command.

A short flag means one thing everywhere; a new short flag needs a README entry here and
there (the rule: a short form only where Slurm uses that letter for the same meaning).
"""

from __future__ import annotations

import pytest
from lattice_cli.main import app, load_commands, main
from typer.main import get_command
from typer.testing import CliRunner

load_commands()

# short flag -> the long options it may stand for (the README's table).
RESERVED: dict[str, set[str]] = {
    "-N": {"--nodes"},
    "-t": {"--walltime"},  # time, as sbatch -t; never tenant
    "-J": {"--name"},
    "-C": {"--constraint"},
    "-e": {"--env"},
    "-D": {"--chdir"},
    "-o": {"--output"},
    "-q": {"--quiet"},
    "-v": {"--verbose"},
    "-h": {"--help"},
    "-n": {"--tail", "--agents", "--ntasks"},  # a count: lines, agents, ranks (srun -n)
    "-l": {"--label"},  # srun -l
    "-f": {"--follow"},
    "-w": {"--watch"},
    "-a": {"--all"},
    "-u": {"--user"},
    "-r": {"--reason"},
    "-y": {"--yes"},
}


# The exception: the commands named after Slurm's (`lattice sbatch`, `squeue`, ...) take
# Slurm's own flags, letters included (squeue -t is --states, -o --format, -h --noheader),
# because scripts written for Slurm call them (README: "Slurm compatibility"). Each letter
# there must be the one Slurm uses for that long option, listed here; lattice's own
# commands stay under RESERVED.
SLURM_COMMANDS: dict[str, dict[str, set[str]]] = {
    "squeue": {
        "-u": {"--user"},
        "-t": {"--states"},
        "-j": {"--jobs"},
        "-p": {"--partition"},
        "-o": {"--format"},
        "-h": {"--noheader"},
    },
    "scancel": {"-u": {"--user"}},
    "sinfo": {"-N": {"--Node"}, "-p": {"--partition"}, "-h": {"--noheader"}},
    "sacct": {
        "-j": {"--jobs"},
        "-S": {"--starttime"},
        "-E": {"--endtime"},
        "-u": {"--user"},
        "-s": {"--state"},
        "-o": {"--format"},
        "-n": {"--noheader"},
        "-P": {"--parsable2"},
        "-X": {"--allocations"},
    },
    # sbatch, srun and salloc read Slurm's flags themselves (no typer options).
    "sbatch": {"-h": {"--help"}},
    "srun": {},
    "salloc": {},
}


def _options(cmd, path: str):
    for param in cmd.params:
        if param.param_type_name == "option":
            yield path, param
    for name, sub in getattr(cmd, "commands", {}).items():
        yield from _options(sub, f"{path} {name}")


def test_every_short_flag_follows_the_policy():
    wrong = []
    for path, param in _options(get_command(app), "lattice"):
        shorts = [o for o in param.opts + param.secondary_opts if len(o) == 2]
        longs = {o for o in param.opts + param.secondary_opts if o.startswith("--")}
        if shorts and not longs:
            wrong.append(f"{path} {shorts}: a short flag needs a long form")
        word = path.split()[1] if len(path.split()) > 1 else ""
        table = SLURM_COMMANDS.get(word, RESERVED)
        for short in shorts:
            if short not in table or not longs & table[short]:
                wrong.append(f"{path} {short} {sorted(longs)}")
    assert not wrong, "short flags outside the README's policy:\n" + "\n".join(wrong)


def test_t_is_time_not_tenant(capsys):
    root = {o for p in get_command(app).params for o in p.opts}
    assert "--tenant" in root and "-t" not in root
    result = CliRunner().invoke(app, ["-t", "physics", "status"])
    assert result.exit_code == 2  # a usage error, not a silent tenant switch
    for args in (["-t", "physics", "status"], ["-o", "json", "-tphysics", "status"]):
        with pytest.raises(SystemExit) as exited:
            main(args)
        assert exited.value.code == 2
        err = capsys.readouterr().err
        assert err.startswith("Error: -t is not a global option") and "Hint: " in err


def test_lattice_directives_are_submit_flags():
    """`#LATTICE` lines take the flags of `lattice submit`, with the same short forms."""
    from lattice_cli.directives import _LATTICE_OPTS

    submit = get_command(app).commands["submit"]
    flags = {o for p in submit.params for o in p.opts}
    assert set(_LATTICE_OPTS) <= flags
    for param in submit.params:
        known = [o for o in param.opts if o in _LATTICE_OPTS]
        assert len({_LATTICE_OPTS[o] for o in known}) <= 1, param.opts
