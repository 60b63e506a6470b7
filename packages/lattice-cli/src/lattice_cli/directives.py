"""Read submission options out of batch scripts and flag values: the pure part of submit.

A script may carry ``#LATTICE --flag=value`` directives and, for Slurm users, ``#SBATCH``
directives, which are translated with the specification's directive mapping::

    --nodes/-N -> nodes          --time/-t -> walltime       --job-name/-J -> name
    --account/-A -> tenant       --partition/-p -> vcluster  --constraint/-C -> constraint
    --gres=gpu[:type]:N -> gpu_count (and gpu_type)          --qos/-q -> preemption class
    --ntasks + --ntasks-per-node -> nodes = ceil(ntasks / per node)
    --mem -> memory_gb constraint   --requeue/--no-requeue -> requeue policy

As with sbatch, directives are read from the top of the script up to the first line that
is neither blank nor a comment. ``#LATTICE`` directives win over ``#SBATCH`` ones, and
command-line flags (see :func:`merge`) win over both. Unknown ``#SBATCH`` directives become
warnings; unknown ``#LATTICE`` directives and malformed values raise
:class:`DirectiveError` (a ``ValueError``), the only exception these functions raise.
"""

from __future__ import annotations

import math
import re
import shlex
from dataclasses import dataclass, field
from typing import Any

REQUEUE_POLICIES = ("never", "on_node_failure", "always")
CONSTRAINT_KEYS = ("gpu_type", "gpu_count", "memory_gb", "topology", "features")
_INT_KEYS = ("gpu_count", "memory_gb")
_WORD = re.compile(r"[A-Za-z0-9_.\-/]+\Z")
_ENV_KEY = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")
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


class DirectiveError(ValueError):
    """A directive or option value that cannot be used. ``line`` is 1-based or None."""

    def __init__(self, message: str, *, line: int | None = None, hint: str = "") -> None:
        self.message = f"line {line}: {message}" if line else message
        super().__init__(self.message)
        self.line = line
        self.hint = hint


@dataclass
class SubmitOptions:
    """Submission settings from one source; ``None`` means "not given here"."""

    nodes: int | None = None
    walltime: str | None = None
    name: str | None = None
    tenant: str | None = None
    vcluster: str | None = None
    project: str | None = None
    preemption_class: int | None = None
    constraints: dict[str, Any] = field(default_factory=dict)
    env: dict[str, str] = field(default_factory=dict)
    requeue: str | None = None
    max_requeue: int | None = None
    uenv: str | None = None
    submit_dir: str | None = None
    tags: dict[str, str] = field(default_factory=dict)
    warnings: list[str] = field(default_factory=list)


_SCALARS = (
    "nodes",
    "walltime",
    "name",
    "tenant",
    "vcluster",
    "project",
    "preemption_class",
    "requeue",
    "max_requeue",
    "uenv",
    "submit_dir",
)


def merge(base: SubmitOptions, override: SubmitOptions) -> SubmitOptions:
    """``override`` wins for every setting it gives; maps merge key by key."""
    out = SubmitOptions()
    for name in _SCALARS:
        value = getattr(override, name)
        setattr(out, name, value if value is not None else getattr(base, name))
    out.constraints = merge_constraints(base.constraints, override.constraints)
    out.env = {**base.env, **override.env}
    out.tags = {**base.tags, **override.tags}
    out.warnings = [*base.warnings, *override.warnings]
    return out


# --------------------------------------------------------------------------- values


def parse_positive_int(text: str, what: str, *, minimum: int = 1) -> int:
    value = str(text).strip()
    hint = f"Give {what} as a whole number of at least {minimum}."
    if value.startswith("-") and value[1:].isascii() and value[1:].isdigit():
        raise DirectiveError(f"{what} must be at least {minimum}, not {value}", hint=hint)
    if not value.isascii() or not value.isdigit() or len(value) > 9:
        raise DirectiveError(f"{what} must be a whole number, not {text!r}", hint=hint)
    number = int(value)
    if number < minimum:
        raise DirectiveError(f"{what} must be at least {minimum}, not {number}", hint=hint)
    return number


def parse_preemption_class(text: str) -> int:
    value = parse_positive_int(text, "preemption class", minimum=0)
    if value > 10:
        raise DirectiveError(
            f"preemption class must be between 0 and 10, not {value}",
            hint="0 is preempted first, 5 is the default, 10 is never preempted.",
        )
    return value


def parse_requeue(text: str) -> str:
    value = str(text).strip().lower().replace("-", "_")
    if value not in REQUEUE_POLICIES:
        raise DirectiveError(
            f"unknown requeue policy {text!r}", hint="Use one of: " + ", ".join(REQUEUE_POLICIES)
        )
    return value


def parse_walltime(text: str) -> str:
    """Keep the user's text (the server parses durations); reject only the empty one."""
    value = str(text).strip()
    if not value:
        raise DirectiveError(
            "walltime is empty", hint="Use a duration like 30m, 24h, 1d or HH:MM:SS."
        )
    if any(c.isspace() for c in value) or len(value) > 32 or not value.isprintable():
        raise DirectiveError(
            f"invalid walltime {text!r}", hint="Use a duration like 30m, 24h, 1d or HH:MM:SS."
        )
    return value


def parse_env_item(item: str) -> tuple[str, str]:
    """``KEY=VALUE`` -> (KEY, VALUE)."""
    key, sep, value = str(item).partition("=")
    key = key.strip()
    if not sep or not _ENV_KEY.match(key):
        raise DirectiveError(
            f"invalid environment setting {item!r}",
            hint="Use KEY=VALUE, e.g. --env OMP_NUM_THREADS=8.",
        )
    return key, value


def parse_env(items: list[str] | tuple[str, ...]) -> dict[str, str]:
    return dict(parse_env_item(i) for i in items)


def _text_value(text: str, what: str) -> str:
    value = str(text).strip()
    if not value:
        raise DirectiveError(f"{what} is empty")
    if not value.isprintable():
        raise DirectiveError(f"{what} contains control characters: {text!r}")
    return value


# --------------------------------------------------------------------------- constraints


def parse_constraint(expr: str) -> dict[str, Any]:
    """``"gpu_type=GH200,gpu_count=4"``, ``"memory_gb>=512"``, ``"ib&nvme"`` -> dict.

    Items are separated by ``,`` or ``&`` (AND). ``key=value`` (also ``key:value`` and, for
    counts, ``key>=value``) sets one of gpu_type, gpu_count, memory_gb, topology; bare
    words are node features. Slurm's OR and bracket forms are not supported.
    """
    text = str(expr)
    if any(c in text for c in "|[]()*"):
        raise DirectiveError(
            f"constraint {expr!r} uses OR, brackets or counts, which Lattice does not support",
            hint="List required features separated by commas, e.g. --constraint=ib,nvme.",
        )
    out: dict[str, Any] = {}
    for raw in re.split(r"[,&]", text):
        item = raw.strip()
        if not item:
            continue
        match = re.match(r"([A-Za-z_][A-Za-z0-9_]*)\s*(>=|<=|==|=|<|>|:)\s*(.*)\Z", item)
        if match:
            key, op, value = match.group(1).lower(), match.group(2), match.group(3).strip()
            _constraint_item(out, key, op, value, item)
        elif _WORD.match(item):
            features = out.setdefault("features", [])
            if item not in features:
                features.append(item)
        else:
            raise DirectiveError(
                f"invalid constraint {item!r}",
                hint="Use key=value (gpu_type, gpu_count, memory_gb, topology) or a feature name.",
            )
    return out


def _constraint_item(out: dict[str, Any], key: str, op: str, value: str, item: str) -> None:
    if key not in CONSTRAINT_KEYS:
        raise DirectiveError(
            f"unknown constraint {key!r} in {item!r}",
            hint="Known constraints: "
            + ", ".join(CONSTRAINT_KEYS)
            + "; bare words are node features.",
        )
    if op in ("<", "<=", ">"):
        raise DirectiveError(
            f"constraint {item!r}: only = and >= are supported",
            hint="Counts are minimums: memory_gb>=512 and memory_gb=512 mean the same.",
        )
    if op == ">=" and key not in _INT_KEYS:
        raise DirectiveError(f"constraint {item!r}: >= only applies to gpu_count and memory_gb")
    if not value:
        raise DirectiveError(f"constraint {item!r} has no value")
    if key in _INT_KEYS:
        out[key] = parse_positive_int(value, key, minimum=0)
    elif key == "features":
        for feature in re.split(r"[+:\s]+", value):
            if not feature:
                continue
            if not _WORD.match(feature):
                raise DirectiveError(f"invalid feature name {feature!r} in {item!r}")
            features = out.setdefault("features", [])
            if feature not in features:
                features.append(feature)
    else:
        if not _WORD.match(value):
            raise DirectiveError(f"invalid value {value!r} for {key}")
        out[key] = value


def parse_constraints(exprs: list[str] | tuple[str, ...]) -> dict[str, Any]:
    """Several ``--constraint`` values, later ones overriding earlier ones key by key."""
    out: dict[str, Any] = {}
    for expr in exprs:
        out = merge_constraints(out, parse_constraint(expr))
    return out


def merge_constraints(base: dict[str, Any], override: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    out.update(override)
    if "features" in out:
        out["features"] = list(out["features"])
    return out


def parse_gres(text: str) -> tuple[dict[str, Any], list[str]]:
    """Slurm ``--gres``: ``gpu:4``, ``gpu:a100:4``, ``gpu`` -> constraints, warnings."""
    out: dict[str, Any] = {}
    warnings: list[str] = []
    for raw in str(text).split(","):
        item = raw.strip()
        if not item:
            continue
        parts = item.split(":")
        if parts[0].removeprefix("gres/") != "gpu":
            warnings.append(f"#SBATCH --gres={item} ignored: only gpu resources are translated")
            continue
        rest = parts[1:]
        count = 1
        if rest and rest[-1].isascii() and rest[-1].isdigit():
            count = parse_positive_int(rest.pop(), "gpu count", minimum=0)
        if len(rest) > 1:
            raise DirectiveError(f"invalid --gres value {item!r}", hint="Use gpu:N or gpu:TYPE:N.")
        if rest:
            if not _WORD.match(rest[0]):
                raise DirectiveError(f"invalid GPU type {rest[0]!r} in --gres={item}")
            out["gpu_type"] = rest[0]
        out["gpu_count"] = count
    return out, warnings


_MEM = re.compile(r"(\d{1,12})\s*([KMGT]?)B?\Z", re.IGNORECASE)
_MEM_MB = {"": 1, "K": 1 / 1024, "M": 1, "G": 1024, "T": 1024 * 1024}


def parse_mem_gb(text: str) -> int | None:
    """Slurm ``--mem`` (MB by default; K/M/G/T suffixes) -> whole GB, None for ``0``."""
    match = _MEM.match(str(text).strip())
    if not match:
        raise DirectiveError(f"invalid --mem value {text!r}", hint="Use e.g. 512G or 64000M.")
    mb = int(match.group(1)) * _MEM_MB[match.group(2).upper()]
    if mb == 0:
        return None  # Slurm: all of the node's memory; full nodes are the default here
    return max(1, math.ceil(mb / 1024))


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
    "--constraint": "constraint",
    "-C": "constraint",
    "--env": "env",
    "-e": "env",
    "--requeue": "requeue",
    "--max-requeue": "max_requeue",
    "--uenv": "uenv",
    "--chdir": "submit_dir",
}

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
}
_SBATCH_FLAGS = {"--requeue", "--no-requeue", "--exclusive"}


def _apply_lattice(opts: SubmitOptions, option: str, value: str | None, line: int) -> None:
    setting = _LATTICE_OPTS.get(option)
    if setting is None:
        raise DirectiveError(
            f"unknown #LATTICE directive {option}",
            line=line,
            hint="#LATTICE lines take the flags of `lattice submit` (see `lattice submit --help`).",
        )
    if value is None:
        raise DirectiveError(f"#LATTICE {option} needs a value", line=line)
    try:
        if setting == "nodes":
            opts.nodes = parse_positive_int(value, "nodes")
        elif setting == "walltime":
            opts.walltime = parse_walltime(value)
        elif setting == "preemption_class":
            opts.preemption_class = parse_preemption_class(value)
        elif setting == "constraint":
            opts.constraints = merge_constraints(opts.constraints, parse_constraint(value))
        elif setting == "env":
            key, val = parse_env_item(value)
            opts.env[key] = val
        elif setting == "requeue":
            opts.requeue = parse_requeue(value)
        elif setting == "max_requeue":
            opts.max_requeue = parse_positive_int(value, "max requeue", minimum=0)
        else:
            setattr(opts, setting, _text_value(value, option))
    except DirectiveError as exc:
        if exc.line is None:
            raise DirectiveError(exc.message, line=line, hint=exc.hint) from None
        raise


class _SlurmTasks:
    def __init__(self) -> None:
        self.ntasks: int | None = None
        self.per_node: int | None = None


def _apply_sbatch(
    opts: SubmitOptions,
    tasks: _SlurmTasks,
    option: str,
    value: str | None,
    line: int,
    partition_map: dict[str, str],
    qos_map: dict[str, int],
) -> None:
    setting = _SBATCH_OPTS.get(option)
    where = f"line {line}: #SBATCH {option}"
    if setting is None:
        opts.warnings.append(f"{where} is not supported by Lattice and was ignored")
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
        _apply_sbatch_value(opts, tasks, setting, option, value, where, partition_map, qos_map)
    except DirectiveError as exc:
        if exc.line is None:
            raise DirectiveError(exc.message, line=line, hint=exc.hint) from None
        raise


def _apply_sbatch_value(
    opts: SubmitOptions,
    tasks: _SlurmTasks,
    setting: str,
    option: str,
    value: str,
    where: str,
    partition_map: dict[str, str],
    qos_map: dict[str, int],
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
        opts.name = _text_value(value, option)
    elif setting == "tenant":
        opts.tenant = _text_value(value, option)
    elif setting == "partition":
        partition = _text_value(value, option)
        if "," in partition:
            first = partition.split(",")[0].strip()
            opts.warnings.append(f"{where}={value}: several partitions; using {first!r}")
            partition = _text_value(first, option)
        opts.vcluster = partition_map.get(partition, partition)
    elif setting == "constraint":
        opts.constraints = merge_constraints(opts.constraints, parse_constraint(value))
    elif setting == "gres":
        gres, warnings = parse_gres(value)
        opts.constraints = merge_constraints(opts.constraints, gres)
        prefix = where.split(":", 1)[0]  # "line N"
        opts.warnings.extend(f"{prefix}: {w}" for w in warnings)
    elif setting == "gpus_per_node":
        kind, _, count = value.rpartition(":")
        gpus: dict[str, Any] = {"gpu_count": parse_positive_int(count, "gpus per node", minimum=0)}
        if kind:
            if not _WORD.match(kind):
                raise DirectiveError(f"invalid GPU type {kind!r} in {option}={value}")
            gpus["gpu_type"] = kind
        opts.constraints = merge_constraints(opts.constraints, gpus)
    elif setting == "mem":
        gb = parse_mem_gb(value)
        if gb is not None:
            opts.constraints = merge_constraints(opts.constraints, {"memory_gb": gb})
    elif setting == "qos":
        qos = _text_value(value, option)
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
        opts.submit_dir = _text_value(value, option)
    elif setting == "output":
        opts.warnings.append(
            f"{where} ignored: output always goes to the log store; read it with `lattice logs ID`"
        )
    elif setting == "array":
        opts.warnings.append(f"{where} ignored: task groups (job arrays) are not supported yet")
    elif setting == "dependency":
        opts.warnings.append(f"{where} ignored: dependencies are not supported yet")


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
) -> SubmitOptions:
    """The options a script's ``#LATTICE`` and ``#SBATCH`` directives ask for.

    ``partition_map`` maps Slurm partitions to vClusters (default: same name);
    ``qos_map`` maps QOS names to preemption classes (default :data:`DEFAULT_QOS_MAP`).
    """
    partitions = dict(partition_map or {})
    qos = {**DEFAULT_QOS_MAP, **(qos_map or {})}
    sbatch = SubmitOptions()
    native = SubmitOptions()
    tasks = _SlurmTasks()
    for number, kind, rest in iter_directives(text):
        try:
            tokens = shlex.split(rest, comments=True)
        except ValueError as exc:
            raise DirectiveError(f"cannot read #{kind} line: {exc}", line=number) from None
        if kind == "LATTICE":
            for option, value, stray in _split_options(tokens, set(_LATTICE_OPTS), set()):
                if stray is not None:
                    raise DirectiveError(
                        f"unexpected #LATTICE argument {stray!r}",
                        line=number,
                        hint="Write directives as #LATTICE --flag=value.",
                    )
                _apply_lattice(native, option, value, number)
        else:
            takes = set(_SBATCH_OPTS) - _SBATCH_FLAGS
            for option, value, stray in _split_options(tokens, takes, _SBATCH_FLAGS):
                if stray is not None:
                    sbatch.warnings.append(
                        f"line {number}: unexpected #SBATCH argument {stray!r} ignored"
                    )
                    continue
                _apply_sbatch(sbatch, tasks, option, value, number, partitions, qos)
    if tasks.ntasks is not None and sbatch.nodes is None:
        if tasks.per_node:
            sbatch.nodes = max(1, math.ceil(tasks.ntasks / tasks.per_node))
        else:
            sbatch.warnings.append(
                f"#SBATCH --ntasks={tasks.ntasks} without --nodes or --ntasks-per-node:"
                " Lattice allocates whole nodes, so 1 node is requested; set --nodes"
            )
    return merge(sbatch, native)


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
