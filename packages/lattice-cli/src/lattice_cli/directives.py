"""Read submission options out of batch scripts: ``#LATTICE`` and ``#SBATCH`` directives.

A script may carry ``#LATTICE --flag=value`` directives and, for Slurm users, ``#SBATCH``
directives, which are translated with the specification's directive mapping::

    --nodes/-N -> nodes          --time/-t -> walltime       --job-name/-J -> name
    --account/-A -> tenant       --partition/-p -> vcluster  --constraint/-C -> constraint
    --gres=gpu[:type]:N -> gpu_count (and gpu_type)          --qos/-q -> preemption class
    --ntasks + --ntasks-per-node -> nodes = ceil(ntasks / per node)
    --mem -> memory_gb constraint   --requeue/--no-requeue -> requeue policy
    --array -> task group           --dependency/-d -> depends_on
    --cpus-per-task/-c, --ntasks -> tags      --export -> env (named variables)
    --output/-o, --error/-e -> tags slurm_output/slurm_error: the agent links the job's
        stdout/stderr to the expanded file (-o alone does not collect stderr)
    --uenv -> uenv  --view -> view (the uenv Slurm plugin's options)
    --mail-type/--mail-user and the options in SBATCH_UNSUPPORTED -> warnings

As with sbatch, directives are read from the top of the script up to the first line that
is neither blank nor a comment. ``#LATTICE`` directives win over ``#SBATCH`` ones, and
command-line flags (see :func:`lattice_cli.submit_options.merge`) win over both. Unknown
``#SBATCH`` directives become warnings; unknown ``#LATTICE`` directives and malformed
values raise :class:`~lattice_cli.submit_options.DirectiveError` (a ``ValueError``), the
only exception these functions raise. Each value is parsed by
:mod:`lattice_cli.submit_options`; this module also builds the entrypoint of a script or
a command.
"""

from __future__ import annotations

import math
import re
import shlex
from typing import Any

from lattice_cli.submit_options import (
    SCALE_OPTIONS,
    WORD,
    DirectiveError,
    SubmitOptions,
    merge,
    merge_constraints,
    parse_checkpoint,
    parse_constraint,
    parse_env_item,
    parse_gres,
    parse_lifecycle,
    parse_mem_gb,
    parse_positive_int,
    parse_preemption_class,
    parse_requeue,
    parse_scale_value,
    parse_walltime,
    text_value,
)

_DIRECTIVE = re.compile(r"#(LATTICE|SBATCH)(?=\s|$)(.*)\Z")

# Slurm QOS names to preemption classes (0 = preempted first, 10 = never); sites override
# this with ``qos_map`` in the CLI config.
DEFAULT_QOS_MAP: dict[str, int] = {
    "scavenger": 0,
    "standby": 1,
    "low": 3,
    "normal": 5,
    "high": 7,
    "urgent": 9,
}


# --------------------------------------------------------------------------- tokens


def _split_options(tokens: list[str], takes_value: set[str], flags: set[str]):
    """Yield (option, value-or-None, stray) from argv-like tokens.

    ``--opt=value``, ``--opt value``, ``-Xvalue`` and ``-X value`` are understood. For an
    option in neither set (unknown), a following token that does not start with ``-`` is
    taken as its value.
    """
    i = 0
    while i < len(tokens):
        tok = tokens[i]
        i += 1
        if tok.startswith("--") and len(tok) > 2:
            name, sep, value = tok.partition("=")
            if sep:
                yield name, value, None
                continue
            if name in flags:
                yield name, None, None
                continue
            if i < len(tokens) and (name in takes_value or not tokens[i].startswith("-")):
                yield name, tokens[i], None
                i += 1
            else:
                yield name, None, None
        elif tok.startswith("-") and len(tok) > 1 and tok != "--":
            name, value = tok[:2], tok[2:]
            if value.startswith("="):
                value = value[1:]
            if value:
                yield name, value, None
                continue
            if name in flags:
                yield name, None, None
                continue
            if i < len(tokens) and (name in takes_value or not tokens[i].startswith("-")):
                yield name, tokens[i], None
                i += 1
            else:
                yield name, None, None
        else:
            yield None, None, tok


# #LATTICE: the flags of `lattice submit`.
_LATTICE_OPTS: dict[str, str] = {
    "--nodes": "nodes",
    "-N": "nodes",
    "--walltime": "walltime",
    "-t": "walltime",
    "--name": "name",
    "-J": "name",
    "--tenant": "tenant",
    "--vcluster": "vcluster",
    "--project": "project",
    "--preemption-class": "preemption_class",
    "--checkpoint": "checkpoint",
    "--constraint": "constraint",
    "-C": "constraint",
    "--env": "env",
    "-e": "env",
    "--requeue": "requeue",
    "--max-requeue": "max_requeue",
    "--uenv": "uenv",
    "--view": "view",
    "--image": "image",
    "--chdir": "submit_dir",
    "--dependency": "dependency",
    "--lifecycle": "lifecycle",
    "--reactive": "reactive",
    "--min-nodes": "min_nodes",
    "--max-nodes": "max_nodes",
    **{option: "scale" for option in SCALE_OPTIONS},
}
#: #LATTICE options that take no value
_LATTICE_FLAGS = {"--reactive"}

# #SBATCH options translated, by Slurm name.
_SBATCH_OPTS: dict[str, str] = {
    "--nodes": "nodes",
    "-N": "nodes",
    "--time": "time",
    "-t": "time",
    "--job-name": "name",
    "-J": "name",
    "--account": "tenant",
    "-A": "tenant",
    "--partition": "partition",
    "-p": "partition",
    "--constraint": "constraint",
    "-C": "constraint",
    "--gres": "gres",
    "--gpus-per-node": "gpus_per_node",
    "--mem": "mem",
    "--qos": "qos",
    "-q": "qos",
    "--ntasks": "ntasks",
    "-n": "ntasks",
    "--ntasks-per-node": "ntasks_per_node",
    "--chdir": "submit_dir",
    "-D": "submit_dir",
    "--requeue": "requeue_always",
    "--no-requeue": "requeue_never",
    "--exclusive": "exclusive",
    "--output": "output",
    "-o": "output",
    "--error": "output",
    "-e": "output",
    "--array": "array",
    "-a": "array",
    "--dependency": "dependency",
    "-d": "dependency",
    "--cpus-per-task": "cpus_per_task",
    "-c": "cpus_per_task",
    "--export": "export",
    "--mail-type": "mail",
    "--mail-user": "mail",
    # the uenv Slurm plugin's options (spec: #SBATCH --uenv=prgenv-gnu/24.11:v1 --view=default)
    "--uenv": "uenv",
    "--view": "view",
}
_SBATCH_FLAGS = {"--requeue", "--no-requeue", "--exclusive"}

# sbatch options Lattice knows but does not translate: option -> (takes a value, why).
# Each one is a warning (never silent, never an error: scripts must keep working).
SBATCH_UNSUPPORTED: dict[str, tuple[bool, str]] = {
    **{
        o: (True, "Lattice allocates whole nodes")
        for o in (
            "--mem-per-cpu",
            "--mem-per-gpu",
            "--cpus-per-gpu",
            "--ntasks-per-core",
            "--ntasks-per-socket",
            "--ntasks-per-gpu",
            "--threads-per-core",
            "--cores-per-socket",
            "--sockets-per-node",
            "--hint",
            "--tmp",
            "--distribution",
            "-m",
            "--gpus",
            "-G",
            "--gpus-per-task",
            "--gpus-per-socket",
            "--cpu-freq",
            "--gpu-bind",
            "--mem-bind",
        )
    },
    **{
        o: (True, "Lattice places nodes itself (topology-aware)")
        for o in ("--nodelist", "-w", "--exclude", "-x", "--switches", "--nodefile", "-F")
    },
    **{
        o: (True, "no Lattice equivalent")
        for o in (
            "--begin",
            "-b",
            "--deadline",
            "--signal",
            "--comment",
            "--reservation",
            "--licenses",
            "-L",
            "--clusters",
            "--cluster",
            "-M",
            "--wckey",
            "--priority",
            "--nice",
            "--input",
            "-i",
            "--open-mode",
            "--propagate",
            "--profile",
            "--acctg-freq",
            "--time-min",
            "--kill-on-invalid-dep",
            "--mcs-label",
            "--power",
            "--container",
            "--uid",
            "--gid",
            "--core-spec",
            "-S",
            "--thread-spec",
            "--network",
            "--burst-buffer",
            "--bb",
            "--bbf",
        )
    },
    **{
        o: (False, "no Lattice equivalent")
        for o in (
            "--hold",
            "-H",
            "--overcommit",
            "-O",
            "--contiguous",
            "--spread-job",
            "--no-kill",
            "-k",
            "--oversubscribe",
            "-s",
            "--use-min-nodes",
            "--ignore-pbs",
            "--reboot",
            "--get-user-env",
            "--quiet",
            "-Q",
            "--verbose",
            "-v",
            "--wait",
            "-W",
            "--requeue-exit",
        )
    },
}


def _apply_lattice(opts: SubmitOptions, option: str, value: str | None, line: int) -> None:
    setting = _LATTICE_OPTS.get(option)
    if setting is None:
        raise DirectiveError(
            f"unknown #LATTICE directive {option}",
            line=line,
            hint="#LATTICE lines take the flags of `lattice submit` (see `lattice submit --help`).",
        )
    if setting == "reactive":
        if value is not None:
            raise DirectiveError(f"#LATTICE {option} takes no value", line=line)
        opts.lifecycle = "reactive"
        return
    if value is None:
        raise DirectiveError(f"#LATTICE {option} needs a value", line=line)
    try:
        if setting == "nodes":
            opts.nodes = parse_positive_int(value, "nodes")
        elif setting == "walltime":
            opts.walltime = parse_walltime(value)
        elif setting == "preemption_class":
            opts.preemption_class = parse_preemption_class(value)
        elif setting == "checkpoint":
            opts.checkpoint = parse_checkpoint(value)
        elif setting == "constraint":
            opts.constraints = merge_constraints(opts.constraints, parse_constraint(value))
        elif setting == "env":
            key, val = parse_env_item(value)
            opts.env[key] = val
        elif setting == "requeue":
            opts.requeue = parse_requeue(value)
        elif setting == "max_requeue":
            opts.max_requeue = parse_positive_int(value, "max requeue", minimum=0)
        elif setting == "dependency":
            check_dependency(value, f"#LATTICE {option}")
            opts.dependency = value
        elif setting == "lifecycle":
            opts.lifecycle = parse_lifecycle(value)
        elif setting in ("min_nodes", "max_nodes"):
            setattr(opts, setting, parse_positive_int(value, setting.replace("_", " ")))
        elif setting == "scale":
            opts.scaling[SCALE_OPTIONS[option]] = parse_scale_value(option, value)
        else:
            setattr(opts, setting, text_value(value, option))
    except DirectiveError as exc:
        if exc.line is None:
            raise DirectiveError(exc.message, line=line, hint=exc.hint) from None
        raise


class SlurmTasks:
    """``--ntasks`` and ``--ntasks-per-node`` as given (nodes are derived at the end)."""

    def __init__(self) -> None:
        self.ntasks: int | None = None
        self.per_node: int | None = None


def apply_sbatch(
    opts: SubmitOptions,
    tasks: SlurmTasks,
    option: str,
    value: str | None,
    line: int | None,
    partition_map: dict[str, str],
    qos_map: dict[str, int],
    environ: dict[str, str] | None = None,
) -> None:
    setting = _SBATCH_OPTS.get(option)
    where = f"line {line}: #SBATCH {option}" if line else f"sbatch {option}"
    if setting is None:
        known = SBATCH_UNSUPPORTED.get(option)
        why = f" ({known[1]})" if known else ""
        opts.warnings.append(f"{where} is not supported by Lattice and was ignored{why}")
        return
    if setting in ("exclusive",):
        return  # Lattice always allocates full nodes
    if setting == "requeue_always":
        opts.requeue = "always"
        return
    if setting == "requeue_never":
        opts.requeue = "never"
        return
    if value is None:
        opts.warnings.append(f"{where} has no value and was ignored")
        return
    try:
        _apply_sbatch_value(
            opts, tasks, setting, option, value, where, partition_map, qos_map, environ or {}
        )
    except DirectiveError as exc:
        if exc.line is None:
            raise DirectiveError(exc.message, line=line, hint=exc.hint) from None
        raise


def _apply_sbatch_value(
    opts: SubmitOptions,
    tasks: SlurmTasks,
    setting: str,
    option: str,
    value: str,
    where: str,
    partition_map: dict[str, str],
    qos_map: dict[str, int],
    environ: dict[str, str],
) -> None:
    if setting == "nodes":
        low, sep, _high = value.partition("-")
        opts.nodes = parse_positive_int(low, "nodes")
        if sep:
            opts.warnings.append(
                f"{where}={value}: node ranges are not supported; requesting {opts.nodes}"
            )
    elif setting == "time":
        if value.strip().lower() in ("unlimited", "infinite"):
            opts.warnings.append(f"{where}={value}: no walltime requested")
            opts.walltime = None
        else:
            opts.walltime = parse_walltime(value)
    elif setting == "name":
        opts.name = text_value(value, option)
    elif setting == "tenant":
        opts.tenant = text_value(value, option)
    elif setting == "partition":
        partition = text_value(value, option)
        if "," in partition:
            first = partition.split(",")[0].strip()
            opts.warnings.append(f"{where}={value}: several partitions; using {first!r}")
            partition = text_value(first, option)
        opts.vcluster = partition_map.get(partition, partition)
    elif setting == "constraint":
        opts.constraints = merge_constraints(opts.constraints, parse_constraint(value))
    elif setting == "gres":
        gres, warnings = parse_gres(value)
        opts.constraints = merge_constraints(opts.constraints, gres)
        if where.startswith("line "):
            prefix = where.split(":", 1)[0]  # "line N"
            opts.warnings.extend(f"{prefix}: {w}" for w in warnings)
        else:
            opts.warnings.extend(w.replace("#SBATCH", "sbatch") for w in warnings)
    elif setting == "gpus_per_node":
        kind, _, count = value.rpartition(":")
        gpus: dict[str, Any] = {"gpu_count": parse_positive_int(count, "gpus per node", minimum=0)}
        if kind:
            if not WORD.match(kind):
                raise DirectiveError(f"invalid GPU type {kind!r} in {option}={value}")
            gpus["gpu_type"] = kind
        opts.constraints = merge_constraints(opts.constraints, gpus)
    elif setting == "mem":
        gb = parse_mem_gb(value)
        if gb is not None:
            opts.constraints = merge_constraints(opts.constraints, {"memory_gb": gb})
    elif setting == "qos":
        qos = text_value(value, option)
        if qos in qos_map:
            opts.preemption_class = qos_map[qos]
        else:
            opts.warnings.append(
                f"{where}={qos}: no preemption class is mapped to this QOS; ignored"
                " (add it to qos_map in the CLI config)"
            )
    elif setting == "ntasks":
        tasks.ntasks = parse_positive_int(value, "ntasks")
        opts.tags["ntasks"] = str(tasks.ntasks)
    elif setting == "ntasks_per_node":
        tasks.per_node = parse_positive_int(value, "ntasks per node")
        opts.tags["ntasks_per_node"] = str(tasks.per_node)
    elif setting == "submit_dir":
        opts.submit_dir = text_value(value, option)
    elif setting in ("uenv", "view", "image"):
        setattr(opts, setting, text_value(value, option))
    elif setting == "output":
        # the agent links the job's output to this file (lattice_agent.spawn); unlike
        # Slurm, stdout and stderr stay apart: -o alone does not collect stderr
        tag = "slurm_error" if option in ("--error", "-e") else "slurm_output"
        opts.tags[tag] = text_value(value, option)
    elif setting == "cpus_per_task":
        opts.tags["cpus_per_task"] = str(parse_positive_int(value, "cpus per task"))
    elif setting == "mail":
        opts.warnings.append(
            f"{where}={value} ignored: Lattice sends no mail; follow the job with"
            " `lattice status ID --watch`"
        )
    elif setting == "export":
        _apply_export(opts, value, where, environ)
    elif setting == "array":
        opts.task_group = task_group_of_array(value, option)
    elif setting == "dependency":
        check_dependency(value, option)
        opts.dependency = value


def _apply_export(opts: SubmitOptions, value: str, where: str, environ: dict[str, str]) -> None:
    """sbatch ``--export=[ALL|NONE|NIL,]VAR[=VALUE],...``: named variables go into the job's
    env (a bare name takes its value from the submitting environment). Lattice jobs never
    inherit the submitting environment, so ALL/NONE/NIL are kept as a warning."""
    keywords = []
    for raw in str(value).split(","):
        item = raw.strip()
        if not item:
            continue
        if item.upper() in ("ALL", "NONE", "NIL"):
            keywords.append(item.upper())
            continue
        if "=" in item:
            key, val = parse_env_item(item)
            opts.env[key] = val
        elif item in environ:
            opts.env[parse_env_item(f"{item}=")[0]] = environ[item]
        else:
            opts.warnings.append(f"{where}: {item} is not set here and was not exported")
    if keywords:
        opts.warnings.append(
            f"{where}={value}: Lattice jobs do not inherit the submitting environment"
            " (they start from the node's); only variables named here or given with"
            " --env are passed"
        )


def task_group_of_array(value: str, option: str) -> str:
    """sbatch ``--array`` as a task-group range (one arithmetic range, optional %N)."""
    from lattice_common.slurm import SlurmSyntaxError, parse_array, to_task_group

    try:
        start, end, step, limit = to_task_group(parse_array(value))
    except SlurmSyntaxError as e:
        raise DirectiveError(f"{option}={value}: {e.message}", hint=e.hint) from None
    text = f"{start}-{end}" + (f":{step}" if step != 1 else "")
    return text + (f"%{limit}" if limit else "")


def check_dependency(value: str, option: str) -> None:
    """A clear error now for a --dependency form Lattice cannot keep (never silent)."""
    from lattice_common.slurm import SlurmSyntaxError, parse_dependency

    try:
        parse_dependency(value)
    except SlurmSyntaxError as e:
        raise DirectiveError(f"{option}={value}: {e.message}", hint=e.hint) from None


def depends_on_of(value: str, name: str) -> list[dict[str, str]]:
    """The ``depends_on`` entries of a --dependency text (singleton: the job's name)."""
    from lattice_common.slurm import parse_dependency, to_depends_on

    return to_depends_on(parse_dependency(value), mutex_name=name)


# --------------------------------------------------------------------------- scripts


def iter_directives(text: str):
    """Yield (line number, "LATTICE"|"SBATCH", argument text) from the script's header."""
    for number, raw in enumerate(str(text).splitlines(), start=1):
        line = raw.strip()
        if not line:
            continue
        if not line.startswith("#"):
            return  # first command: directives end here, as with sbatch
        match = _DIRECTIVE.match(line)
        if match:
            yield number, match.group(1), match.group(2)


def parse_script(
    text: str,
    *,
    partition_map: dict[str, str] | None = None,
    qos_map: dict[str, int] | None = None,
    environ: dict[str, str] | None = None,
) -> SubmitOptions:
    """The options a script's ``#LATTICE`` and ``#SBATCH`` directives ask for.

    ``partition_map`` maps Slurm partitions to vClusters (default: same name);
    ``qos_map`` maps QOS names to preemption classes (default :data:`DEFAULT_QOS_MAP`).
    """
    partitions = dict(partition_map or {})
    qos = {**DEFAULT_QOS_MAP, **(qos_map or {})}
    sbatch = SubmitOptions()
    native = SubmitOptions()
    tasks = SlurmTasks()
    for number, kind, rest in iter_directives(text):
        try:
            tokens = shlex.split(rest, comments=True)
        except ValueError as exc:
            raise DirectiveError(f"cannot read #{kind} line: {exc}", line=number) from None
        if kind == "LATTICE":
            for option, value, stray in _split_options(
                tokens, set(_LATTICE_OPTS) - _LATTICE_FLAGS, _LATTICE_FLAGS
            ):
                if stray is not None:
                    raise DirectiveError(
                        f"unexpected #LATTICE argument {stray!r}",
                        line=number,
                        hint="Write directives as #LATTICE --flag=value.",
                    )
                _apply_lattice(native, option, value, number)
        else:
            for option, value, stray in _split_options(tokens, SBATCH_TAKES, SBATCH_FLAGS):
                if stray is not None:
                    sbatch.warnings.append(
                        f"line {number}: unexpected #SBATCH argument {stray!r} ignored"
                    )
                    continue
                apply_sbatch(sbatch, tasks, option, value, number, partitions, qos, environ)
    finish_tasks(sbatch, tasks, "#SBATCH")
    return merge(sbatch, native)


def finish_tasks(opts: SubmitOptions, tasks: SlurmTasks, source: str) -> None:
    """``--ntasks`` without ``--nodes``: nodes = ceil(ntasks / ntasks-per-node)."""
    if tasks.ntasks is not None and opts.nodes is None:
        if tasks.per_node:
            opts.nodes = max(1, math.ceil(tasks.ntasks / tasks.per_node))
        else:
            opts.warnings.append(
                f"{source} --ntasks={tasks.ntasks} without --nodes or --ntasks-per-node:"
                " Lattice allocates whole nodes, so 1 node is requested; set --nodes"
            )


# Value-taking and flag sbatch options (translated or not), for argv-style parsing.
SBATCH_FLAGS = _SBATCH_FLAGS | {o for o, (takes, _) in SBATCH_UNSUPPORTED.items() if not takes}
SBATCH_TAKES = (set(_SBATCH_OPTS) - _SBATCH_FLAGS) | {
    o for o, (takes, _) in SBATCH_UNSUPPORTED.items() if takes
}


def shebang_command(text: str) -> list[str]:
    """The interpreter (with its arguments) from a ``#!`` line; ``/bin/bash`` without one."""
    first = str(text).split("\n", 1)[0].strip()
    if first.startswith("#!"):
        parts = first[2:].split()
        if parts:
            return parts
    return ["/bin/bash"]


def script_entrypoint(script_path: str, text: str, args: list[str] | tuple[str, ...] = ()) -> str:
    """The command line that runs a script: ``/bin/bash /abs/path/train.sh arg ...``."""
    return shlex.join([*shebang_command(text), script_path, *args])


def command_entrypoint(argv: list[str] | tuple[str, ...]) -> str:
    """``lattice submit -- torchrun train.py`` -> ``"torchrun train.py"`` (shell-quoted)."""
    if not argv or not any(a.strip() for a in argv):
        raise DirectiveError(
            "nothing to run", hint="Give a script (lattice submit job.sh) or a command after --."
        )
    return shlex.join(list(argv))
