"""Submission settings and the parsing of their values: the pure core of ``lattice submit``.

:class:`SubmitOptions` holds what one source (flags, ``#LATTICE`` or ``#SBATCH``
directives) asks for, and :func:`merge` lets a later source win. The ``parse_*`` functions
check one value each (node counts, walltimes, ``--constraint`` expressions, ``--env
KEY=VALUE``, Slurm ``--gres``/``--mem``) and raise only :class:`DirectiveError` (a
``ValueError``) with a hint. Script directives are read by :mod:`lattice_cli.directives`.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Any

REQUEUE_POLICIES = ("never", "on_node_failure", "always")
CONSTRAINT_KEYS = ("gpu_type", "gpu_count", "memory_gb", "topology", "features")
_INT_KEYS = ("gpu_count", "memory_gb")
WORD = re.compile(r"[A-Za-z0-9_.\-/]+\Z")
_ENV_KEY = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")


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
    view: str | None = None  # a view of the uenv (its environment variables)
    image: str | None = None  # OCI image registry/name:tag
    submit_dir: str | None = None
    tags: dict[str, str] = field(default_factory=dict)
    dependency: str | None = None  # Slurm --dependency text (checked when read)
    task_group: str | None = None  # START-END[:STEP][%N] (from --array or --task-group)
    lifecycle: str | None = None  # bounded | unbounded | reactive
    min_nodes: int | None = None  # node range / reactive lower bound
    max_nodes: int | None = None  # reactive upper bound (sent as nodes)
    # reactive scaling settings (ScalingSpec field -> value); merged key by key
    scaling: dict[str, Any] = field(default_factory=dict)
    # --checkpoint: a protocol (signal | shmem | grpc) or a strategy (auto | manual | none)
    checkpoint: str | None = None
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
    "view",
    "image",
    "submit_dir",
    "dependency",
    "task_group",
    "lifecycle",
    "min_nodes",
    "max_nodes",
    "checkpoint",
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
    out.scaling = {**base.scaling, **override.scaling}
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


CHECKPOINT_VALUES = ("signal", "shmem", "grpc", "auto", "manual", "none")


def parse_checkpoint(text: str) -> str:
    """``--checkpoint``: how the job is asked to checkpoint before preemption (signal,
    shmem, grpc), or a strategy (auto, manual, none)."""
    value = str(text).strip().lower()
    if value not in CHECKPOINT_VALUES:
        raise DirectiveError(
            f"unknown checkpoint {text!r}",
            hint="Use --checkpoint=signal|shmem|grpc (how the job is asked) or --checkpoint=none.",
        )
    return value


def checkpoint_fields(value: str | None) -> dict[str, str]:
    """The spec fields of a ``--checkpoint`` value: a protocol or a strategy."""
    if not value:
        return {}
    if value in ("signal", "shmem", "grpc"):
        return {"checkpoint_protocol": value}
    return {"checkpoint": value}


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


LIFECYCLES = ("bounded", "unbounded", "reactive")
#: --scale-* options -> ScalingSpec fields (the server checks the values' ranges)
SCALE_OPTIONS = {
    "--scale-metric": "metric",
    "--scale-target": "target",
    "--scale-interval": "evaluation_interval",
    "--scale-up-window": "scale_up_window",
    "--scale-down-window": "scale_down_window",
    "--scale-down-threshold": "scale_down_threshold",
    "--scale-cooldown": "cooldown",
}


def parse_lifecycle(text: str) -> str:
    value = str(text).strip().lower()
    if value not in LIFECYCLES:
        raise DirectiveError(
            f"unknown lifecycle {text!r}",
            hint="Use bounded (batch, the default), unbounded (service) or reactive "
            "(autoscaling between --min-nodes and --max-nodes).",
        )
    return value


def parse_scale_value(option: str, text: str) -> Any:
    """One ``--scale-*`` value: the metric as text, target and threshold as numbers,
    durations as the user wrote them (seconds, or 30s, 2m, 1h; the server parses)."""
    key = SCALE_OPTIONS[option]
    value = str(text).strip()
    if key == "metric":
        return text_value(value, option)
    if key in ("target", "scale_down_threshold"):
        try:
            number = float(value)
        except ValueError:
            number = math.nan
        if not math.isfinite(number) or number <= 0:
            raise DirectiveError(
                f"{option} must be a positive number, not {text!r}",
                hint="e.g. --scale-target 0.8 (80 % utilisation), --scale-down-threshold 0.25.",
            )
        return number
    if not value or any(c.isspace() for c in value) or len(value) > 32 or not value.isprintable():
        raise DirectiveError(
            f"invalid {option} {text!r}", hint="Give seconds or a duration like 30s, 2m, 1h."
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


def text_value(text: str, what: str) -> str:
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
        elif WORD.match(item):
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
            if not WORD.match(feature):
                raise DirectiveError(f"invalid feature name {feature!r} in {item!r}")
            features = out.setdefault("features", [])
            if feature not in features:
                features.append(feature)
    else:
        if not WORD.match(value):
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
            if not WORD.match(rest[0]):
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


def parse_expose(text: str) -> dict[str, Any]:
    """``--expose NAME:PORT`` (or ``PORT``) as the API's ``expose`` entry."""
    name, _, port = text.strip().rpartition(":")
    number = parse_positive_int(port, "exposed port")
    if number > 65535:
        raise DirectiveError(f"exposed port {number} is not a port (1-65535)")
    return {"name": name or f"port-{number}", "port": number}


def parse_liveness(
    text: str,
    *,
    period_secs: int | None = None,
    failure_threshold: int | None = None,
    initial_delay_secs: int | None = None,
) -> dict[str, Any]:
    """``--liveness http:PORT/PATH`` or ``tcp:PORT`` as the API's ``liveness_probe``."""
    kind, sep, rest = text.strip().partition(":")
    kind = kind.lower()
    hint = "Give http:PORT/PATH or tcp:PORT, e.g. http:8080/healthz."
    if not sep or kind not in ("http", "tcp"):
        raise DirectiveError(f"invalid liveness probe {text!r}", hint=hint)
    port, slash, path = rest.partition("/")
    probe: dict[str, Any] = {"probe_type": kind, "port": parse_positive_int(port, "probe port")}
    if kind == "http":
        probe["path"] = "/" + path if slash else "/"
    elif slash:
        raise DirectiveError(f"a tcp probe has no path ({text!r})", hint=hint)
    extra = {
        "period_secs": period_secs,
        "failure_threshold": failure_threshold,
        "initial_delay_secs": initial_delay_secs,
    }
    probe.update({k: v for k, v in extra.items() if v is not None})
    return probe
