"""Pure pieces of the Slurm-named commands (``lattice sbatch``, ``squeue``, ``sacct``,
``srun``, ``history``, ``compat-aliases``): reading their argv, Slurm state codes, the
``-o/--format`` field codes, dates, and the alias script. No I/O.

Script-directive translation is :mod:`lattice_cli.directives` (sbatch flags on the command
line go through the same :func:`~lattice_cli.directives.apply_sbatch` as ``#SBATCH``
lines); hostlists, arrays, dependencies and output patterns are
:mod:`lattice_common.slurm`.
"""

from __future__ import annotations

import datetime as _dt
import math
import re
from dataclasses import dataclass, field
from typing import Any

from lattice_cli.submit_options import DirectiveError, SubmitOptions

# --------------------------------------------------------------------------- argv


def split_argv(
    argv: list[str], takes: set[str], flags: set[str], command: str
) -> tuple[list[tuple[str, str | None]], list[str]]:
    """getopt with "+": (option, value) pairs up to the first operand, and the operands.

    ``--opt=v``, ``--opt v``, ``-Xv``, ``-X v`` and ``--`` are understood; an option in
    neither set is a usage error (:class:`DirectiveError`), as with Slurm's commands.
    """
    pairs: list[tuple[str, str | None]] = []
    i = 0
    while i < len(argv):
        tok = argv[i]
        if tok == "--":
            return pairs, argv[i + 1 :]
        if not tok.startswith("-") or tok == "-":
            return pairs, argv[i:]
        i += 1
        if tok.startswith("--"):
            name, sep, value = tok.partition("=")
            inline: str | None = value if sep else None
        else:
            name, rest = tok[:2], tok[2:]
            inline = rest.removeprefix("=") if rest else None
        if name in flags:
            if inline is not None and tok.startswith("--"):
                raise DirectiveError(f"{command}: option {name} takes no value")
            pairs.append((name, None))
            if inline and not tok.startswith("--"):  # bundled short flags: -Hv
                argv = [*argv[:i], "-" + inline, *argv[i:]]
            continue
        if name not in takes:
            raise DirectiveError(
                f"{command}: unrecognized option {name!r}",
                hint=f"See `lattice {command} --help` for the options Lattice understands.",
            )
        if inline is None:
            if i >= len(argv):
                raise DirectiveError(f"{command}: option {name} needs a value")
            inline = argv[i]
            i += 1
        pairs.append((name, inline))
    return pairs, []


# sbatch options of the command line only (not #SBATCH).
SBATCH_CLI_TAKES = {"--wrap"}
SBATCH_CLI_FLAGS = {"--parsable", "--test-only"}


@dataclass
class SbatchArgs:
    opts: SubmitOptions
    ntasks: int | None = None
    ntasks_per_node: int | None = None
    operands: list[str] = field(default_factory=list)  # script and its arguments
    wrap: str | None = None
    parsable: bool = False
    test_only: bool = False


def parse_sbatch_argv(
    argv: list[str],
    *,
    partition_map: dict[str, str] | None = None,
    qos_map: dict[str, int] | None = None,
    environ: dict[str, str] | None = None,
) -> SbatchArgs:
    """``sbatch [OPTIONS] [SCRIPT [ARGS]]``: each option translated as its ``#SBATCH``
    line would be (warnings say ``sbatch --opt`` instead of a line number)."""
    from lattice_cli import directives

    takes = directives.SBATCH_TAKES | SBATCH_CLI_TAKES
    flags = directives.SBATCH_FLAGS | SBATCH_CLI_FLAGS
    pairs, operands = split_argv(argv, takes, flags, "sbatch")
    out = SbatchArgs(opts=SubmitOptions(), operands=operands)
    tasks = directives.SlurmTasks()
    qos = {**directives.DEFAULT_QOS_MAP, **(qos_map or {})}
    for option, value in pairs:
        if option == "--wrap":
            out.wrap = value
        elif option == "--parsable":
            out.parsable = True
        elif option == "--test-only":
            out.test_only = True
        else:
            directives.apply_sbatch(
                out.opts, tasks, option, value, None, dict(partition_map or {}), qos, environ
            )
    out.ntasks, out.ntasks_per_node = tasks.ntasks, tasks.per_node
    return out


def combine_tasks(script: SubmitOptions, cli: SbatchArgs, merged: SubmitOptions) -> None:
    """Command-line ``--ntasks``/``--ntasks-per-node`` without ``--nodes`` on the command
    line: nodes = ceil(ntasks / per node), per node from either source (the command line
    wins, as for every option)."""
    if cli.opts.nodes is not None or (cli.ntasks is None and cli.ntasks_per_node is None):
        return
    ntasks = cli.ntasks or _int_tag(script.tags, "ntasks")
    per_node = cli.ntasks_per_node or _int_tag(script.tags, "ntasks_per_node")
    if ntasks and per_node:
        merged.nodes = max(1, math.ceil(ntasks / per_node))
    elif ntasks and merged.nodes is None:
        merged.warnings.append(
            f"sbatch --ntasks={ntasks} without --nodes or --ntasks-per-node: Lattice"
            " allocates whole nodes, so 1 node is requested; set --nodes"
        )


def _int_tag(tags: dict[str, str], key: str) -> int | None:
    value = tags.get(key, "")
    return int(value) if value.isdigit() else None


# srun: what maps onto `lattice launch` (inside an allocation) or a one-off job.
SRUN_TAKES = {
    "-n": "ntasks",
    "--ntasks": "ntasks",
    "--ntasks-per-node": "ntasks_per_node",
    "-N": "nodes",
    "--nodes": "nodes",
    "--mpi": "mpi",
    "-t": "time",
    "--time": "time",
    "-J": "name",
    "--job-name": "name",
    "-p": "partition",
    "--partition": "partition",
    "-A": "account",
    "--account": "account",
    "-C": "constraint",
    "--constraint": "constraint",
    "--gres": "gres",
    "-D": "chdir",
    "--chdir": "chdir",
    "--jobid": "jobid",
    "--export": "export",
    "-c": "cpus_per_task",
    "--cpus-per-task": "cpus_per_task",
    "-w": "nodelist",
    "--nodelist": "nodelist",
}
SRUN_FLAGS = {
    "-l": "label",
    "--label": "label",
    "--pty": "pty",
    "--exclusive": "exclusive",
    "-u": "unbuffered",
    "--unbuffered": "unbuffered",
}
SRUN_MPI = ("pmi2", "pmix", "none", "pmi1")


@dataclass
class SrunArgs:
    settings: dict[str, str] = field(default_factory=dict)
    flags: set[str] = field(default_factory=set)
    command: list[str] = field(default_factory=list)


def parse_srun_argv(argv: list[str]) -> SrunArgs:
    pairs, operands = split_argv(argv, set(SRUN_TAKES), set(SRUN_FLAGS), "srun")
    out = SrunArgs(command=operands)
    for option, value in pairs:
        if option in SRUN_FLAGS:
            out.flags.add(SRUN_FLAGS[option])
        else:
            out.settings[SRUN_TAKES[option]] = value or ""
    mpi = out.settings.get("mpi")
    if mpi is not None:
        mpi = mpi.strip().lower()
        if mpi.startswith("pmix"):  # pmix_v3, pmix_v4 ...
            mpi = "pmix"
        if mpi not in SRUN_MPI:
            raise DirectiveError(
                f"srun: --mpi={out.settings['mpi']} is not supported",
                hint="Lattice's agents serve pmi2 (the default), pmix and none.",
            )
        out.settings["mpi"] = mpi
    return out


# --------------------------------------------------------------------------- states

# Lattice state -> (squeue %t code, %T name); a Failed allocation's reason refines it.
_STATE_CODES: dict[str, tuple[str, str]] = {
    "Pending": ("PD", "PENDING"),
    "Staging": ("CF", "CONFIGURING"),
    "Running": ("R", "RUNNING"),
    "Checkpointing": ("R", "RUNNING"),
    "Suspended": ("S", "SUSPENDED"),
    "Completed": ("CD", "COMPLETED"),
    "Failed": ("F", "FAILED"),
    "Cancelled": ("CA", "CANCELLED"),
}
_FAILED_REASONS = {
    "walltime_exceeded": ("TO", "TIMEOUT"),
    "timeout": ("TO", "TIMEOUT"),
    "node_failure": ("NF", "NODE_FAIL"),
    "out_of_memory": ("OOM", "OUT_OF_MEMORY"),
}
ACTIVE_STATES = ("Pending", "Staging", "Running", "Checkpointing", "Suspended")
TERMINAL_STATES = ("Completed", "Failed", "Cancelled")
# squeue -t / sacct -s names -> Lattice states
_SLURM_STATE_NAMES: dict[str, tuple[str, ...]] = {
    "PD": ("Pending",),
    "PENDING": ("Pending",),
    "CF": ("Staging",),
    "CONFIGURING": ("Staging",),
    "R": ("Running", "Checkpointing"),
    "RUNNING": ("Running", "Checkpointing"),
    "S": ("Suspended",),
    "SUSPENDED": ("Suspended",),
    "CD": ("Completed",),
    "COMPLETED": ("Completed",),
    "F": ("Failed",),
    "FAILED": ("Failed",),
    "TO": ("Failed",),
    "TIMEOUT": ("Failed",),
    "NF": ("Failed",),
    "NODE_FAIL": ("Failed",),
    "OOM": ("Failed",),
    "OUT_OF_MEMORY": ("Failed",),
    "CA": ("Cancelled",),
    "CANCELLED": ("Cancelled",),
    "ALL": ACTIVE_STATES + TERMINAL_STATES,
}


def state_code(alloc: dict[str, Any]) -> tuple[str, str]:
    """(``%t`` code, ``%T`` name) of an allocation record, Slurm's spelling."""
    state = str(alloc.get("state") or "")
    if state == "Failed":
        found = _FAILED_REASONS.get(str(alloc.get("reason") or "").lower())
        if found:
            return found
    return _STATE_CODES.get(state, (state[:2].upper() or "?", state.upper() or "UNKNOWN"))


def lattice_states(text: str) -> list[str]:
    """``-t PD,R`` / ``--states=running`` -> Lattice state names (in first-seen order)."""
    out: list[str] = []
    for raw in str(text).split(","):
        name = raw.strip().upper()
        if not name:
            continue
        found = _SLURM_STATE_NAMES.get(name)
        if found is None:
            # Lattice's own names are fine too (Checkpointing, Staging ...)
            lattice = [s for s in _STATE_CODES if s.upper() == name]
            if not lattice:
                raise DirectiveError(
                    f"unknown job state {raw.strip()!r}",
                    hint="Use Slurm's names or codes: PENDING/PD, RUNNING/R, SUSPENDED/S, "
                    "COMPLETED/CD, FAILED/F, TIMEOUT/TO, NODE_FAIL/NF, CANCELLED/CA, all.",
                )
            found = tuple(lattice)
        out.extend(s for s in found if s not in out)
    return out


def state_filter(names: list[str], text: str) -> set[tuple[str, str]] | None:
    """Codes asked for that narrow a Lattice state (TO, NF, OOM within Failed)."""
    wanted = {n.strip().upper() for n in str(text).split(",")}
    narrow = {("Failed", code) for code in ("TO", "NF", "OOM") if code in wanted}
    narrow |= {
        ("Failed", code)
        for code, name in (("TO", "TIMEOUT"), ("NF", "NODE_FAIL"), ("OOM", "OUT_OF_MEMORY"))
        if name in wanted
    }
    if not narrow or "F" in wanted or "FAILED" in wanted or "ALL" in wanted:
        return None
    return narrow


# --------------------------------------------------------------------------- fields


def _hms(seconds: float | None, *, days: bool = True) -> str:
    """Slurm's time format: ``M:SS``, ``H:MM:SS``, ``D-HH:MM:SS``."""
    if seconds is None:
        return "0:00"
    total = max(0, int(seconds))
    d, rem = divmod(total, 86400)
    h, rem = divmod(rem, 3600)
    m, s = divmod(rem, 60)
    if d and days:
        return f"{d}-{h:02d}:{m:02d}:{s:02d}"
    h += d * 24
    return f"{h}:{m:02d}:{s:02d}" if h else f"{m}:{s:02d}"


def elapsed_hms(seconds: float | None) -> str:
    """sacct's Elapsed: always ``[D-]HH:MM:SS``."""
    total = max(0, int(seconds or 0))
    d, rem = divmod(total, 86400)
    h, rem = divmod(rem, 3600)
    m, s = divmod(rem, 60)
    return (f"{d}-" if d else "") + f"{h:02d}:{m:02d}:{s:02d}"


def _elapsed(alloc: dict[str, Any], now: float) -> float | None:
    started = alloc.get("started_at")
    if not isinstance(started, int | float):
        return None
    finished = alloc.get("finished_at")
    end = finished if isinstance(finished, int | float) else now
    return max(0.0, float(end) - float(started))


def _time_limit(alloc: dict[str, Any]) -> str:
    value = (alloc.get("spec") or {}).get("walltime_seconds") or 0
    return _hms(value) if value else "UNLIMITED"


def _nodelist(alloc: dict[str, Any]) -> str:
    nodes = alloc.get("assigned_nodes") or []
    if not nodes:
        return ""
    from lattice_common.slurm import compress_hostlist

    return compress_hostlist([str(n) for n in nodes], sort=True)


def _reason(alloc: dict[str, Any]) -> str:
    if alloc.get("held"):
        return "Dependency"
    text = str(alloc.get("pending_reason") or alloc.get("reason") or "None")
    return text.split(":", 1)[0].split(";", 1)[0].strip() or "None"


def _iso_local(epoch: Any) -> str:
    if not isinstance(epoch, int | float):
        return "Unknown"
    return _dt.datetime.fromtimestamp(float(epoch)).strftime("%Y-%m-%dT%H:%M:%S")


def _exit_code(alloc: dict[str, Any]) -> str:
    code = alloc.get("exit_code")
    if code is None:
        return "0:0"
    code = int(code)
    return f"0:{-code}" if code < 0 else f"{code}:0"  # Slurm: status:signal


def field_value(code: str, alloc: dict[str, Any], now: float) -> str:
    """One squeue/sacct field of an allocation record."""
    spec = alloc.get("spec") or {}
    if code in ("i", "jobid"):
        return str(alloc.get("id") or "")
    if code in ("j", "jobname"):
        return str(spec.get("name") or "")
    if code in ("u", "user"):
        return str(spec.get("user") or "")
    if code == "t":
        return state_code(alloc)[0]
    if code in ("T", "state"):
        return state_code(alloc)[1]
    if code in ("M", "elapsed"):
        return _hms(_elapsed(alloc, now)) if code == "M" else elapsed_hms(_elapsed(alloc, now))
    if code in ("D", "nnodes"):
        nodes = alloc.get("assigned_nodes") or []
        return str(len(nodes) if nodes else spec.get("nodes") or 1)
    if code in ("N", "nodelist"):
        return _nodelist(alloc) or ("None assigned" if code == "nodelist" else "")
    if code == "R":
        if alloc.get("state") in ("Pending", "Suspended"):
            return f"({_reason(alloc)})"
        return _nodelist(alloc) or f"({_reason(alloc)})"
    if code == "r":
        return _reason(alloc)
    if code in ("P", "partition"):
        return str(spec.get("vcluster") or "")
    if code in ("a", "account"):
        return str(spec.get("tenant") or "")
    if code in ("l", "timelimit"):
        return _time_limit(alloc)
    if code in ("S", "start"):
        return _iso_local(alloc.get("started_at") or alloc.get("estimated_start"))
    if code in ("e", "end"):
        return _iso_local(alloc.get("finished_at"))
    if code in ("V", "submit"):
        return _iso_local(alloc.get("submitted_at"))
    if code == "exitcode":
        return _exit_code(alloc)
    if code == "q":
        return str(spec.get("preemption_class", ""))
    return ""


# squeue %-codes: header, the default width Slurm gives them.
SQUEUE_CODES: dict[str, str] = {
    "i": "JOBID",
    "j": "NAME",
    "u": "USER",
    "t": "ST",
    "T": "STATE",
    "M": "TIME",
    "D": "NODES",
    "R": "NODELIST(REASON)",
    "N": "NODELIST",
    "r": "REASON",
    "P": "PARTITION",
    "a": "ACCOUNT",
    "l": "TIME_LIMIT",
    "S": "START_TIME",
    "V": "SUBMIT_TIME",
    "q": "QOS",
}
SQUEUE_DEFAULT_FORMAT = "%.18i %.9P %.8j %.8u %.2t %.10M %.6D %R"
_PCT = re.compile(r"%(\.)?(-)?(\d*)([A-Za-z%])")


def parse_squeue_format(fmt: str) -> list[tuple[str, str | None, int, bool]]:
    """``"%.18i %j"`` -> [(literal, code, width, right)]: each field with the text before
    it. Unknown codes are usage errors listing the supported ones."""
    parts: list[tuple[str, str | None, int, bool]] = []
    pos = 0
    for m in _PCT.finditer(fmt):
        literal = fmt[pos : m.start()]
        pos = m.end()
        code = m.group(4)
        if code == "%":
            parts.append((literal + "%", None, 0, False))
            continue
        if code not in SQUEUE_CODES:
            raise DirectiveError(
                f"squeue: format code %{code} is not supported",
                hint="Supported: " + " ".join(f"%{c}" for c in SQUEUE_CODES),
            )
        parts.append((literal, code, int(m.group(3) or 0), bool(m.group(1))))
    parts.append((fmt[pos:], None, 0, False))
    return parts


def _cell(text: str, width: int, right: bool) -> str:
    if not width:
        return text
    text = text[:width]
    return text.rjust(width) if right else text.ljust(width)


def squeue_text(
    allocs: list[dict[str, Any]], now: float, fmt: str | None = None, *, header: bool = True
) -> str:
    """squeue's output for ``fmt`` (Slurm's default format when None)."""
    parts = parse_squeue_format(fmt or SQUEUE_DEFAULT_FORMAT)
    lines = []
    rows: list[Any] = ([None] if header else []) + list(allocs)
    for alloc in rows:
        out = []
        for literal, code, width, right in parts:
            out.append(literal)
            if code is not None:
                text = SQUEUE_CODES[code] if alloc is None else field_value(code, alloc, now)
                out.append(_cell(text, width, right))
        lines.append("".join(out).rstrip())
    return "\n".join(lines)


# sacct --format fields: name -> (header, default width, right-justified).
SACCT_FIELDS: dict[str, tuple[str, int, bool]] = {
    "jobid": ("JobID", 12, False),
    "jobname": ("JobName", 10, False),
    "user": ("User", 9, False),
    "partition": ("Partition", 10, False),
    "account": ("Account", 10, False),
    "state": ("State", 10, False),
    "exitcode": ("ExitCode", 8, True),
    "elapsed": ("Elapsed", 10, True),
    "nnodes": ("NNodes", 8, True),
    "nodelist": ("NodeList", 15, False),
    "start": ("Start", 19, False),
    "end": ("End", 19, False),
    "submit": ("Submit", 19, False),
    "timelimit": ("Timelimit", 10, True),
}
SACCT_DEFAULT_FORMAT = "jobid,jobname,partition,account,nnodes,state,exitcode"
HISTORY_FORMAT = "jobid,jobname,user,partition,state,exitcode,elapsed,nnodes,nodelist,end"


def parse_sacct_format(text: str) -> list[tuple[str, int | None]]:
    """``"JobID,State%20,Elapsed"`` -> [(field, width or None)]."""
    out: list[tuple[str, int | None]] = []
    for raw in str(text).split(","):
        item = raw.strip()
        if not item:
            continue
        name, _, width = item.partition("%")
        key = name.strip().lower()
        if key not in SACCT_FIELDS:
            raise DirectiveError(
                f"sacct: field {name.strip()!r} is not supported",
                hint="Supported: " + ",".join(h for h, _, _ in SACCT_FIELDS.values()),
            )
        if width and not width.isdigit():
            raise DirectiveError(f"sacct: bad width in {item!r}", hint="Use FIELD%WIDTH.")
        out.append((key, int(width) if width else None))
    if not out:
        raise DirectiveError("sacct: --format is empty", hint="e.g. --format=JobID,State")
    return out


def sacct_text(
    allocs: list[dict[str, Any]],
    now: float,
    fmt: str | None = None,
    *,
    header: bool = True,
    parsable: bool = False,
) -> str:
    """sacct's fixed-width table (header, dashes, rows), or ``-P``: ``|``-separated."""
    fields = parse_sacct_format(fmt or SACCT_DEFAULT_FORMAT)
    rows = [[field_value(k, a, now) for k, _ in fields] for a in allocs]
    heads = [SACCT_FIELDS[k][0] for k, _ in fields]
    if parsable:
        lines = ["|".join(heads)] if header else []
        lines += ["|".join(r) for r in rows]
        return "\n".join(lines)
    widths = [w or SACCT_FIELDS[k][1] for k, w in fields]
    rights = [SACCT_FIELDS[k][2] for k, _ in fields]

    def line(cells: list[str]) -> str:
        return " ".join(_cell(c, w, r) for c, w, r in zip(cells, widths, rights, strict=True))

    lines = [line(heads), " ".join("-" * w for w in widths)] if header else []
    lines += [line(r) for r in rows]
    return "\n".join(x.rstrip() for x in lines)


# --------------------------------------------------------------------------- dates


def parse_date(text: str, now: float, *, end: bool = False) -> float:
    """``2026-03-01``, ``2026-03-01T10:00[:00][Z|+01:00]``, ``-7d``/``-12h``/``-30m``,
    ``now``, ``today``, ``yesterday`` -> epoch seconds (local time unless a zone is given).
    A bare date means its start (or with ``end``, its end: the next midnight)."""
    value = str(text).strip()
    low = value.lower()
    today = _dt.datetime.fromtimestamp(now).replace(hour=0, minute=0, second=0, microsecond=0)
    if low == "now":
        return now
    if low in ("today", "yesterday", "tomorrow"):
        shift = {"today": 0, "yesterday": -1, "tomorrow": 1}[low] + (1 if end else 0)
        return (today + _dt.timedelta(days=shift)).timestamp()
    rel = re.fullmatch(r"([-+]?)(\d{1,6})\s*([smhdw])", low)
    if rel:
        sign = 1 if rel.group(1) == "+" else -1
        unit = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800}[rel.group(3)]
        return now + sign * int(rel.group(2)) * unit
    try:
        moment = _dt.datetime.fromisoformat(value.replace("Z", "+00:00"))
    except ValueError:
        raise DirectiveError(
            f"cannot read the date {text!r}",
            hint="Use ISO 8601 (2026-03-01, 2026-03-01T10:00:00) or relative: -7d, -12h, "
            "now, today, yesterday.",
        ) from None
    if re.fullmatch(r"\d{4}-\d{2}-\d{2}", value) and end:
        moment += _dt.timedelta(days=1)
    return moment.timestamp()


def finished_between(alloc: dict[str, Any], since: float | None, until: float | None) -> bool:
    """Whether the allocation ended in [since, until) (its submit time when it never ran)."""
    when = alloc.get("finished_at")
    if not isinstance(when, int | float):
        when = alloc.get("submitted_at")
    if not isinstance(when, int | float):
        return since is None and until is None
    if since is not None and when < since:
        return False
    return not (until is not None and when >= until)


# --------------------------------------------------------------------------- aliases

ALIASED = ("sbatch", "squeue", "scancel", "salloc", "srun", "sinfo", "sacct")


def compat_aliases_script(lattice: str = "lattice") -> str:
    """A POSIX shell snippet (bash, zsh, dash) defining the Slurm commands as functions
    that call ``lattice <cmd>``; for ``eval "$(lattice compat-aliases)"``."""
    lines = [
        '# Slurm command names for Lattice: eval "$(lattice compat-aliases)"',
        "# (bash, zsh, sh). Undo with: unset -f " + " ".join(ALIASED),
    ]
    for name in ALIASED:
        # `unalias` first: in bash/zsh an alias of the same name would capture the
        # definition `name() {...}` and break it.
        lines.append(f"unalias {name} 2>/dev/null")
        lines.append(f'{name}() {{ {lattice} {name} "$@"; }}')
    return "\n".join(lines)
