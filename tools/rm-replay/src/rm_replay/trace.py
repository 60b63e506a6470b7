"""Workload traces as JSON lines, in the Performance Tuning Guide's format.

One event per line::

    {"ts": "2026-03-01T00:00:01Z", "type": "submit", "alloc": {"id": "abc-123",
     "nodes": 64, "gpu_type": "GH200", "walltime": "72h", "tenant": "physics",
     "priority": 4}}
    {"ts": "2026-03-01T00:00:05Z", "type": "complete", "alloc_id": "abc-123",
     "duration": "68h", "exit": 0}
    {"ts": "2026-03-01T00:10:00Z", "type": "cancel", "alloc_id": "def-456"}

* ``ts``: ISO 8601 (``Z`` or an offset; no offset = UTC) or a number of seconds since
  the Unix epoch.
* submit ``alloc`` keys: ``id`` (or a top-level ``alloc_id``; without either the
  allocation is named ``line-<N>`` and cannot be completed by a later event),
  ``tenant`` (required), ``nodes`` (default 1; or a range ``{"min": 2, "max": 8}``,
  also ``min_nodes``), ``walltime``, ``gpu_type``,
  ``gpus`` / ``gpu_count`` / ``gpus_per_node``, ``memory_gb``, ``features``,
  ``topology`` (``tight`` / ``any``), ``user``, ``vcluster``, ``priority`` or
  ``preemption_class`` (0..10, default 5), ``sensitive`` (true: class 10), ``name``,
  ``checkpoint`` (``none``, ``auto``, ``manual``, ``signal``, ``shmem``, ``grpc``; not
  given = checkpointable), ``lifecycle`` (``reactive``: an autoscaled service, with a
  node range, a ``load`` profile ``[[seconds after submit, value], ...]`` and optional
  ``scaling`` settings as a submission's, e.g. ``{"target": 0.8, "cooldown": 180}``),
  and optionally the outcome inline: ``runtime`` / ``duration`` and ``exit``. A
  ``constraints`` object (``gpu_type``, ``gpu_count``, ``features``, ``memory_gb``,
  ``topology``) is read too. Other keys are ignored.
* complete: ``alloc_id`` (or ``id``), ``duration`` (required), ``exit`` (default 0).
* cancel: ``alloc_id`` (or ``id``; required): the user cancelled the allocation at
  ``ts``, before it ever started in the captured system (one cancelled while running
  has a complete event instead). Its submission must be in the trace, no later than
  ``ts``, and an allocation is cancelled at most once. (May be combined with a
  complete event or an inline runtime for the same allocation: that is how long it
  runs if the replay starts it before the cancel.)
* durations: a number of seconds, ``90s`` / ``30m`` / ``72h`` / ``1d`` (decimals allowed:
  ``1.5h``), or ``HH:MM:SS`` / ``D-HH:MM:SS`` / ``MM:SS``.
* blank lines and lines starting with ``#`` are skipped; ``"type": "meta"`` lines too;
  completions of allocations the trace never submits are left out (a captured trace
  begins with work that was already running).

Every problem raises :class:`rm_replay.model.TraceError` (a ``ValueError``) naming
the line.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Iterator, Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import msgspec
from lattice_common.duration import parse_duration
from lattice_common.errors import LatticeError
from lattice_common.types import ScalingSpec

from rm_replay.model import CancelEvent, CompleteEvent, SubmitEvent, TraceError, TraceEvent

__all__ = [
    "MAX_NODES",
    "MAX_SECONDS",
    "dump_trace_line",
    "format_seconds",
    "format_ts",
    "iter_trace",
    "load_trace",
    "parse_duration_value",
    "parse_trace_line",
    "parse_ts",
    "read_trace",
    "write_trace",
]

MAX_NODES = 1_000_000
MAX_GPUS = 4096
MAX_MEMORY_GB = 1 << 30
MAX_SECONDS = 100 * 365 * 86400.0  # durations beyond a century are typos
MAX_TS = 253402300799.0  # 9999-12-31T23:59:59Z
_MIN_TS = -62135596800.0  # 0001-01-01T00:00:00Z
MAX_CLASS = 10
_MAX_ID = 256

_DURATION_HINT = "Use seconds (a number) or a duration like 90s, 30m, 1.5h, 72h, 1d or HH:MM:SS."
_TS_HINT = 'Use an ISO 8601 time ("2026-03-01T00:00:01Z") or seconds since the Unix epoch.'
_LINE_HINT = (
    'Each line is one JSON object: {"ts": ..., "type": "submit", "alloc": {...}}, '
    '{"ts": ..., "type": "complete", "alloc_id": ..., "duration": ..., "exit": 0} or '
    '{"ts": ..., "type": "cancel", "alloc_id": ...}.'
)
_CANCEL_HINT = (
    'A cancel event names a submitted allocation: {"ts": ..., "type": "cancel", '
    '"alloc_id": "<the id of its submit event>"}, no earlier than that submission.'
)
_DECIMAL_UNIT = re.compile(r"^([0-9]+(?:\.[0-9]+)?)\s*([smhd])$")
_UNIT = {"s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}
_ZERO = re.compile(r"^0+(?:\.0+)?\s*[smhd]?$")
_decoder = msgspec.json.Decoder()


# --------------------------------------------------------------------------- values


_INT_TEXT = re.compile(r"^-?[0-9]{1,18}$")


def _finite(x: float, what: str) -> float:
    try:
        f = float(x)
    except (OverflowError, ValueError):
        f = math.inf
    if not math.isfinite(f):
        raise TraceError(f"{what} must be a finite number, got {x!r}")
    return f


def parse_duration_value(value: Any, what: str = "duration") -> float:
    """Seconds from a trace duration (see the module docstring); >= 0."""
    if isinstance(value, bool):
        raise TraceError(f"{what} must be a duration, got {value!r}", hint=_DURATION_HINT)
    if isinstance(value, int | float):
        seconds = _finite(value, what)
    elif isinstance(value, str):
        s = value.strip().lower()
        m = _DECIMAL_UNIT.match(s)
        if _ZERO.match(s):
            seconds = 0.0
        elif m:
            seconds = float(m.group(1)) * _UNIT[m.group(2)]
        else:
            try:
                seconds = float(parse_duration(s, field=what))
            except LatticeError:
                raise TraceError(f"invalid {what} {value!r}", hint=_DURATION_HINT) from None
    else:
        raise TraceError(f"{what} must be a duration, got {value!r}", hint=_DURATION_HINT)
    if not 0.0 <= seconds <= MAX_SECONDS:
        raise TraceError(
            f"{what} out of range: {value!r} ({seconds:g} s)",
            hint="Durations are between 0 and 100 years.",
        )
    return seconds


def parse_ts(value: Any) -> float:
    """Seconds since the Unix epoch from an ISO 8601 string or a number."""
    if isinstance(value, bool):
        raise TraceError(f"invalid ts {value!r}", hint=_TS_HINT)
    if isinstance(value, int | float):
        t = _finite(value, "ts")
    elif isinstance(value, str):
        s = value.strip()
        try:
            dt = datetime.fromisoformat(s)
        except (ValueError, OverflowError):
            raise TraceError(f"invalid ts {value!r}", hint=_TS_HINT) from None
        if dt.tzinfo is None:
            dt = dt.replace(tzinfo=UTC)
        try:
            t = dt.timestamp()
        except (OverflowError, ValueError, OSError):
            raise TraceError(f"ts out of range: {value!r}", hint=_TS_HINT) from None
    else:
        raise TraceError(f"invalid ts {value!r}", hint=_TS_HINT)
    if not _MIN_TS <= t <= MAX_TS:  # also rejects NaN
        raise TraceError(f"ts out of range: {value!r}", hint=_TS_HINT)
    return t


def _int(value: Any, what: str, lo: int, hi: int) -> int:
    if isinstance(value, bool):
        raise TraceError(f"{what} must be an integer, got {value!r}")
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, str) and _INT_TEXT.match(value.strip()):
        value = int(value.strip())
    if not isinstance(value, int):
        raise TraceError(f"{what} must be an integer, got {value!r}")
    if not lo <= value <= hi:
        raise TraceError(f"{what} must be between {lo} and {hi}, got {value}")
    return value


def _str(value: Any, what: str, *, required: bool = False) -> str:
    if value is None and not required:
        return ""
    if isinstance(value, bool) or not isinstance(value, str | int):
        raise TraceError(f"{what} must be a string, got {value!r}")
    s = str(value).strip()
    if required and not s:
        raise TraceError(f"{what} must not be empty")
    if len(s) > _MAX_ID:
        raise TraceError(f"{what} is longer than {_MAX_ID} characters")
    return s


def _exit(value: Any) -> int:
    if value is None:
        return 0
    if isinstance(value, str):
        s = value.strip().lower()
        if s in ("", "0", "ok", "success", "completed"):
            return 0
        if _INT_TEXT.match(s) and len(s) < 11:
            return int(s)
        return 1  # "failed", "timeout", "walltime_exceeded", ...: any failure
    return _int(value, "exit", -(2**31), 2**31 - 1)


def _features(value: Any) -> tuple[str, ...]:
    if value is None:
        return ()
    if isinstance(value, str):
        value = [f for f in value.split(",") if f.strip()]
    if not isinstance(value, list) or not all(isinstance(f, str) for f in value):
        raise TraceError(f"features must be a list of strings, got {value!r}")
    return tuple(f.strip() for f in value if f.strip())


def _first(d: dict[str, Any], *keys: str) -> Any:
    for k in keys:
        if k in d and d[k] is not None:
            return d[k]
    return None


# --------------------------------------------------------------------------- lines


def _submit(obj: dict[str, Any], t: float, line_no: int) -> SubmitEvent:
    alloc = obj.get("alloc", obj.get("allocation"))
    if alloc is None:
        alloc = {k: v for k, v in obj.items() if k not in ("ts", "type")}
    if not isinstance(alloc, dict):
        raise TraceError('"alloc" must be an object', hint=_LINE_HINT)
    cons = alloc.get("constraints")
    if cons is None:
        cons = {}
    if not isinstance(cons, dict):
        raise TraceError('"constraints" must be an object', hint=_LINE_HINT)
    merged = {**cons, **{k: v for k, v in alloc.items() if k != "constraints"}}
    aid = _first(merged, "id", "alloc_id")
    if aid is None:
        aid = obj.get("alloc_id")
    aid = _str(aid, "alloc id") if aid is not None else ""
    if not aid:
        aid = f"line-{line_no}"
    tenant = _str(merged.get("tenant"), "tenant", required=True)
    wt = merged.get("walltime")
    walltime = 0.0 if wt is None else parse_duration_value(wt, "walltime")
    rt = _first(merged, "runtime", "duration")
    runtime = None if rt is None else parse_duration_value(rt, "runtime")
    pc = _first(merged, "preemption_class", "priority")
    sensitive = merged.get("sensitive", False)
    if not isinstance(sensitive, bool):
        raise TraceError(f"sensitive must be true or false, got {sensitive!r}")
    pclass = 5 if pc is None else _int(pc, "priority", 0, MAX_CLASS)
    if sensitive:
        pclass = MAX_CLASS
    topology = _str(merged.get("topology"), "topology").lower()
    if topology not in ("", "tight", "any", "pack"):
        raise TraceError(
            f"topology must be tight, any or empty, got {topology!r}",
            hint='"tight": as few dragonfly groups as the idle cluster allows; "any": no packing.',
        )
    nodes_raw = merged.get("nodes", 1)
    min_raw = merged.get("min_nodes")
    if isinstance(nodes_raw, dict):  # the API's node range {min, max}
        if set(nodes_raw) - {"min", "max"} or "max" not in nodes_raw:
            raise TraceError(f"nodes must be a count or {{min, max}}, got {nodes_raw!r}")
        min_raw = nodes_raw.get("min", min_raw)
        nodes_raw = nodes_raw["max"]
    nodes = _int(nodes_raw, "nodes", 1, MAX_NODES)
    min_nodes = 0 if min_raw is None else _int(min_raw, "min_nodes", 0, nodes)
    checkpoint = _str(merged.get("checkpoint"), "checkpoint").lower()
    if checkpoint not in CHECKPOINT_VALUES:
        raise TraceError(
            f"checkpoint must be one of {', '.join(sorted(CHECKPOINT_VALUES - {''}))}, "
            f"got {checkpoint!r}",
            hint='"none": preemption stops it without a checkpoint; a protocol or "auto": '
            "it checkpoints when asked.",
        )
    lifecycle = _str(merged.get("lifecycle"), "lifecycle").lower()
    if lifecycle not in ("", "bounded", "unbounded", "reactive"):
        raise TraceError(f"lifecycle must be bounded, unbounded or reactive, got {lifecycle!r}")
    reactive = lifecycle == "reactive"
    load = _load(merged.get("load")) if reactive else ()
    scaling = _scaling(merged.get("scaling")) if reactive else None
    if reactive and not 0 < min_nodes < nodes:
        raise TraceError(
            "a reactive allocation needs a node range",
            hint='Give "nodes": {"min": 2, "max": 8}: it starts at min and scales up to max.',
        )
    return SubmitEvent(
        t=t,
        id=aid,
        tenant=tenant,
        nodes=nodes,
        min_nodes=min_nodes,
        walltime=walltime,
        gpu_type=_str(merged.get("gpu_type"), "gpu_type"),
        gpus_per_node=_int(
            _first(merged, "gpus_per_node", "gpus", "gpu_count") or 0, "gpus", 0, MAX_GPUS
        ),
        memory_gb=_int(merged.get("memory_gb") or 0, "memory_gb", 0, MAX_MEMORY_GB),
        features=_features(merged.get("features")),
        topology="" if topology == "pack" else topology,
        user=_str(merged.get("user"), "user"),
        vcluster=_str(merged.get("vcluster"), "vcluster"),
        preemption_class=pclass,
        sensitive=sensitive,
        runtime=runtime,
        exit=_exit(merged.get("exit")),
        name=_str(merged.get("name"), "name"),
        checkpoint=checkpoint,
        reactive=reactive,
        load=load,
        scaling=scaling,
    )


#: a submission's ``checkpoint``: the modes and the protocols ("" = not said)
CHECKPOINT_VALUES = frozenset({"", "none", "auto", "manual", "signal", "shmem", "grpc"})


def _load(value: Any) -> tuple[tuple[float, float], ...]:
    """A reactive allocation's metric: ``[[seconds after submit, value], ...]``, times
    ascending from 0 (a step function: each value holds until the next)."""
    hint = 'e.g. "load": [[0, 0.9], [3600, 0.1]] (the metric from 0 s, then from 1 h)'
    if not isinstance(value, list) or not value:
        raise TraceError("a reactive allocation needs a load profile", hint=hint)
    out: list[tuple[float, float]] = []
    for step in value:
        if (
            not isinstance(step, list | tuple)
            or len(step) != 2
            or not all(isinstance(x, int | float) and not isinstance(x, bool) for x in step)
            or not all(math.isfinite(x) and x >= 0 for x in step)
        ):
            raise TraceError(f"load steps are [seconds, value] pairs >= 0, got {step!r}", hint=hint)
        if out and step[0] <= out[-1][0]:
            raise TraceError("load step times must ascend", hint=hint)
        out.append((float(step[0]), float(step[1])))
    if out[0][0] != 0:
        raise TraceError("the load profile must start at 0 s", hint=hint)
    return tuple(out)


def _scaling(value: Any) -> ScalingSpec | None:
    if value is None:
        return None
    try:
        spec = msgspec.convert(value, ScalingSpec, strict=False)
    except msgspec.ValidationError as e:
        raise TraceError(
            f"scaling: {e}",
            hint="Keys as a submission's: metric, target, evaluation_interval, "
            "scale_up_window, scale_down_window, scale_down_threshold, cooldown.",
        ) from None
    if not spec.evaluation_interval >= 1:
        raise TraceError("scaling.evaluation_interval must be at least 1 s")
    return spec


def _event_alloc_id(obj: dict[str, Any], kind: str) -> str:
    aid = _first(obj, "alloc_id", "id")
    if aid is None and isinstance(obj.get("alloc"), dict):
        aid = _first(obj["alloc"], "id", "alloc_id")
    if aid is None:
        raise TraceError(
            f'{kind} event has no "alloc_id"',
            hint=_CANCEL_HINT
            if kind == "cancel"
            else 'Add "alloc_id": the id of the allocation\'s submit event.',
        )
    return _str(aid, "alloc_id", required=True)


def _complete(obj: dict[str, Any], t: float) -> CompleteEvent:
    aid = _event_alloc_id(obj, "complete")
    dur = obj.get("duration")
    if dur is None:
        raise TraceError(
            f"complete event for {aid!r} has no duration",
            hint='Add "duration": the actual run time (e.g. "68h" or seconds).',
        )
    return CompleteEvent(
        t=t, id=aid, duration=parse_duration_value(dur, "duration"), exit=_exit(obj.get("exit"))
    )


def _cancel(obj: dict[str, Any], t: float) -> CancelEvent:
    return CancelEvent(t=t, id=_event_alloc_id(obj, "cancel"))


def parse_trace_line(line: str | bytes, line_no: int = 0) -> TraceEvent | None:
    """One trace line -> an event, or None for a blank, comment or meta line.
    Raises :class:`TraceError` (with ``line`` = ``line_no``) for anything else."""
    try:
        return _parse_line(line, line_no)
    except TraceError as e:
        raise e.at(line=line_no or None) from None


def _parse_line(line: str | bytes, line_no: int) -> TraceEvent | None:
    if isinstance(line, bytes):
        try:
            line = line.decode("utf-8")
        except UnicodeDecodeError:
            raise TraceError("not UTF-8 text", hint=_LINE_HINT) from None
    s = line.strip()
    if not s or s.startswith("#"):
        return None
    try:
        obj = _decoder.decode(s)
    except (msgspec.DecodeError, UnicodeEncodeError, RecursionError) as e:
        raise TraceError(f"not valid JSON ({e})", hint=_LINE_HINT) from None
    if not isinstance(obj, dict):
        raise TraceError("a trace line must be a JSON object", hint=_LINE_HINT)
    kind = obj.get("type", obj.get("event"))
    if kind == "meta":
        return None
    if kind not in ("submit", "complete", "cancel"):
        raise TraceError(
            f'unknown event type {kind!r} (expected "submit", "complete" or "cancel")',
            hint=_LINE_HINT,
        )
    ts = _first(obj, "ts", "t", "time")
    if ts is None:
        raise TraceError('missing "ts"', hint=_TS_HINT)
    t = parse_ts(ts)
    if kind == "submit":
        return _submit(obj, t, line_no)
    return _complete(obj, t) if kind == "complete" else _cancel(obj, t)


def _iter_numbered(
    lines: Iterable[str | bytes], path: str | None
) -> Iterator[tuple[int, TraceEvent]]:
    for n, line in enumerate(lines, 1):
        try:
            ev = parse_trace_line(line, n)
        except TraceError as e:
            raise e.at(path=path) from None
        if ev is not None:
            yield n, ev


def iter_trace(lines: Iterable[str | bytes], *, path: str | None = None) -> Iterator[TraceEvent]:
    """Events from trace lines (numbered from 1 in errors)."""
    for _, ev in _iter_numbered(lines, path):
        yield ev


def load_trace(path: str | Path) -> list[TraceEvent]:
    """Every event of a JSON-lines trace file, in file order (see :func:`read_trace`;
    completions of allocations the trace never submits are left out)."""
    return read_trace(path)[0]


def read_trace(path: str | Path) -> tuple[list[TraceEvent], list[str]]:
    """(events, ids of the completions left out) of a JSON-lines trace file.

    Checked for consistency (:func:`check_trace`): submit ids are unique, no allocation
    completes or is cancelled twice, and every cancel names an allocation submitted
    in the trace no later than the cancel (errors name the cancel's line). A
    completion whose allocation the trace never submits is left out rather than an
    error: a captured trace (``scheduling.trace_capture``) starts with the work already
    running when capture began, whose submissions it does not have."""
    p = Path(path)
    with p.open("rb") as f:
        numbered = list(_iter_numbered(f, str(p)))
    events = [ev for _, ev in numbered]
    orphans = check_trace(events, path=str(p), line_numbers=[n for n, _ in numbered])
    if orphans:
        drop = set(orphans)
        events = [e for e in events if not (isinstance(e, CompleteEvent) and e.id in drop)]
    return events, orphans


def check_trace(
    events: Iterable[TraceEvent],
    *,
    path: str | None = None,
    line_numbers: Sequence[int] | None = None,
) -> list[str]:
    """Raise :class:`TraceError` for duplicate submit ids, repeated completions or
    cancels, and cancels of allocations the trace never submits or submits only after
    the cancel; return the ids of completions whose allocation is never submitted.
    ``line_numbers``: each event's line, to name it in the error."""
    events = list(events)
    seen: dict[str, float] = {}
    done: set[str] = set()
    cancelled: set[str] = set()
    for ev in events:
        if isinstance(ev, SubmitEvent):
            if ev.id in seen:
                raise TraceError(
                    f"allocation {ev.id!r} is submitted twice",
                    hint="Allocation ids must be unique within a trace.",
                    path=path,
                )
            seen[ev.id] = ev.t
    orphans: list[str] = []
    for i, ev in enumerate(events):
        if isinstance(ev, CancelEvent):
            line = line_numbers[i] if line_numbers is not None else None
            if ev.id not in seen:
                raise TraceError(
                    f"cancel of allocation {ev.id!r}, which the trace never submits",
                    hint=_CANCEL_HINT,
                    path=path,
                    line=line,
                )
            if ev.t < seen[ev.id]:
                raise TraceError(
                    f"allocation {ev.id!r} is cancelled at {format_ts(ev.t)}, before its "
                    f"submission at {format_ts(seen[ev.id])}",
                    hint=_CANCEL_HINT,
                    path=path,
                    line=line,
                )
            if ev.id in cancelled:
                raise TraceError(
                    f"allocation {ev.id!r} is cancelled twice",
                    hint="Keep one cancel event per allocation.",
                    path=path,
                    line=line,
                )
            cancelled.add(ev.id)
        elif isinstance(ev, CompleteEvent):
            if ev.id in done:
                raise TraceError(
                    f"allocation {ev.id!r} completes twice",
                    hint="Keep one complete event per allocation.",
                    path=path,
                )
            done.add(ev.id)
            if ev.id not in seen:
                orphans.append(ev.id)
    return orphans


# --------------------------------------------------------------------------- writing


def format_ts(t: float) -> str | float:
    """ISO 8601 UTC for whole seconds, else the number itself (round-trips exactly)."""
    if float(t).is_integer() and _MIN_TS <= t <= MAX_TS:
        return datetime.fromtimestamp(t, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    return t


def format_seconds(seconds: float) -> str | float:
    """``72h`` / ``30m`` / ``90s`` / ``2d`` when exact, else the number of seconds."""
    if float(seconds).is_integer() and seconds > 0:
        s = int(seconds)
        for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
            if s % size == 0:
                return f"{s // size}{unit}"
        return f"{s}s"
    return seconds


def _event_obj(ev: TraceEvent) -> dict[str, Any]:
    if isinstance(ev, CancelEvent):
        return {"ts": format_ts(ev.t), "type": "cancel", "alloc_id": ev.id}
    if isinstance(ev, CompleteEvent):
        return {
            "ts": format_ts(ev.t),
            "type": "complete",
            "alloc_id": ev.id,
            "duration": format_seconds(ev.duration) if ev.duration else 0,
            "exit": ev.exit,
        }
    alloc: dict[str, Any] = {"id": ev.id, "tenant": ev.tenant, "nodes": ev.nodes}
    if ev.min_nodes:
        alloc["min_nodes"] = ev.min_nodes
    if ev.walltime:
        alloc["walltime"] = format_seconds(ev.walltime)
    for key, value in (
        ("gpu_type", ev.gpu_type),
        ("gpus", ev.gpus_per_node),
        ("memory_gb", ev.memory_gb),
        ("features", list(ev.features)),
        ("topology", ev.topology),
        ("user", ev.user),
        ("vcluster", ev.vcluster),
        ("name", ev.name),
    ):
        if value:
            alloc[key] = value
    alloc["priority"] = ev.preemption_class
    if ev.sensitive:
        alloc["sensitive"] = True
    if ev.checkpoint:
        alloc["checkpoint"] = ev.checkpoint
    if ev.reactive:
        alloc["lifecycle"] = "reactive"
        alloc["load"] = [list(step) for step in ev.load]
        if ev.scaling is not None:
            alloc["scaling"] = msgspec.to_builtins(ev.scaling)
    if ev.runtime is not None:
        alloc["runtime"] = format_seconds(ev.runtime) if ev.runtime else 0
        alloc["exit"] = ev.exit
    return {"ts": format_ts(ev.t), "type": "submit", "alloc": alloc}


_line_encoder = msgspec.json.Encoder()


def dump_trace_line(ev: TraceEvent) -> str:
    """One event as a trace line (no newline), readable back by :func:`parse_trace_line`."""
    return _line_encoder.encode(_event_obj(ev)).decode()


def write_trace(path: str | Path, events: Iterable[TraceEvent]) -> None:
    """Write events as a JSON-lines trace."""
    with Path(path).open("w", encoding="utf-8") as f:
        for ev in events:
            f.write(dump_trace_line(ev))
            f.write("\n")
