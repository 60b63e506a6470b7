"""Validation of user submissions, before anything is stored.

A pure function from the request body (a dict, as a user or the SDK sent it) and the
known tenants/vClusters to an AllocationSpec, or a ValidationError/NotFound with a hint.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Mapping
from typing import Any

import msgspec
from lattice_common import promql
from lattice_common.dag import DependencyCondition
from lattice_common.duration import parse_duration
from lattice_common.errors import NotFound, ValidationError
from lattice_common.image_ref import ImageRefError, parse_image_ref
from lattice_common.types import (
    CHECKPOINT_MODES,
    CHECKPOINT_PROTOCOLS,
    AllocationSpec,
    Constraints,
    Dependency,
    ExposedPort,
    LifecycleType,
    LivenessProbeSpec,
    RequeuePolicy,
    ScalingSpec,
)
from lattice_common.uenv_registry import UenvError, check_view_name, format_ref, parse_ref

MAX_NODES_PER_ALLOCATION = 100_000
MAX_REQUEUE_LIMIT = 100


def validate_submission(
    body: Mapping[str, Any],
    *,
    user: str,
    tenants: Collection[str],
    vclusters: Collection[str],
    default_tenant: str = "",
    default_vcluster: str = "",
    check_names: bool = True,
) -> AllocationSpec:
    if not isinstance(body, Mapping):
        raise ValidationError("the request body must be a JSON object describing the allocation")
    _check_text(body)
    entrypoint = str(body.get("entrypoint") or "").strip()
    if not entrypoint:
        raise ValidationError(
            "empty entrypoint: nothing to run",
            hint="Give a script (`lattice submit job.sh`) or a command after `--` "
            "(`lattice submit -- echo hello`).",
        )
    raw_nodes = body.get("nodes", 1)
    min_nodes = 0
    if isinstance(raw_nodes, Mapping):  # the Intent API's range form {min, max}
        if "max" not in raw_nodes:
            raise ValidationError(
                "nodes must be a whole number or a range {min, max}",
                hint="e.g. nodes: 4, or nodes: {min: 2, max: 8}.",
            )
        min_nodes = _int(raw_nodes.get("min", 1), "nodes.min")
        raw_nodes = raw_nodes["max"]
    elif body.get("min_nodes") not in (None, "", 0):
        min_nodes = _int(body["min_nodes"], "min_nodes")
    if body.get("max_nodes") not in (None, "", 0):  # reactive bounds: max_nodes is `nodes`
        raw_nodes = body["max_nodes"]
    nodes = _int(raw_nodes, "nodes")
    if min_nodes and not 1 <= min_nodes <= nodes:
        raise ValidationError(
            f"node range must satisfy 1 <= min ({min_nodes}) <= max ({nodes})",
            hint="e.g. --min-nodes=2 --nodes=8 (or nodes: {min: 2, max: 8}).",
        )
    if nodes < 1:
        raise ValidationError(
            f"nodes must be at least 1 (got {nodes})",
            details={"nodes": nodes},
            hint="Ask for one or more nodes, e.g. --nodes=1.",
        )
    if nodes > MAX_NODES_PER_ALLOCATION:
        raise ValidationError(f"nodes must be at most {MAX_NODES_PER_ALLOCATION} (got {nodes})")
    pclass = _int(body.get("preemption_class", 5), "preemption_class")
    if not 0 <= pclass <= 10:
        raise ValidationError(
            f"preemption class must be between 0 and 10 (got {pclass})",
            details={"preemption_class": pclass},
            hint="0 is best-effort, 5 is the default, 10 is reserved for sensitive claims.",
        )
    try:
        lifecycle = LifecycleType(str(body.get("lifecycle") or "bounded").lower())
    except ValueError:
        raise ValidationError(
            f"unknown lifecycle {body.get('lifecycle')!r}",
            hint="Use bounded (batch), unbounded (service) or reactive.",
        ) from None
    walltime_seconds = 0
    if body.get("walltime_seconds") not in (None, "", 0):
        walltime_seconds = _int(body["walltime_seconds"], "walltime_seconds")
        if walltime_seconds <= 0:
            raise ValidationError(
                "walltime must be greater than zero", hint="Pass e.g. --walltime=2h."
            )
    raw_wall = body.get("walltime")
    if raw_wall not in (None, ""):  # the human form wins over walltime_seconds
        walltime_seconds = parse_duration(str(raw_wall))
    if walltime_seconds > MAX_WALLTIME_SECONDS:
        raise ValidationError(
            f"walltime must be at most {MAX_WALLTIME_SECONDS // 86400} days",
            details={"walltime_seconds": walltime_seconds},
            hint="Use an unbounded (service) allocation for work without an end.",
        )
    scaling = _scaling(body.get("scaling"), lifecycle, min_nodes, nodes)
    if lifecycle == LifecycleType.BOUNDED and walltime_seconds <= 0:
        raise ValidationError(
            "walltime is required for a bounded (batch) allocation",
            hint="Pass --walltime, e.g. --walltime=2h or --walltime=01:30:00.",
        )
    tenant = str(body.get("tenant") or default_tenant or "")
    if not tenant:
        raise ValidationError(
            "no tenant given",
            details={"available": ", ".join(sorted(tenants)) or "(none)"},
            hint="Pass --tenant or set LATTICE_TENANT.",
        )
    if check_names and tenant not in tenants:
        raise NotFound(
            f'unknown tenant "{tenant}"',
            details={"available": ", ".join(sorted(tenants)) or "(none)"},
            hint="Pick one of the available tenants with --tenant.",
        )
    vcluster = str(body.get("vcluster") or default_vcluster or "")
    if not vcluster or (check_names and vcluster not in vclusters):
        raise NotFound(
            f'unknown vCluster "{vcluster}"' if vcluster else "no vCluster given",
            details={"available": ", ".join(sorted(vclusters)) or "(none)"},
            hint="Pick one of the available vClusters with --vcluster.",
        )
    try:
        requeue = RequeuePolicy(str(body.get("requeue_policy") or "on_node_failure"))
    except ValueError:
        raise ValidationError(
            f"unknown requeue policy {body.get('requeue_policy')!r}",
            hint="Use never, on_node_failure or always.",
        ) from None
    max_requeue = _int(body.get("max_requeue", 3), "max_requeue")
    if not 0 <= max_requeue <= MAX_REQUEUE_LIMIT:
        raise ValidationError(f"max_requeue must be between 0 and {MAX_REQUEUE_LIMIT}")
    try:
        constraints = msgspec.convert(body.get("constraints") or {}, Constraints)
        env = msgspec.convert(body.get("env") or {}, dict[str, str])
        tags = msgspec.convert(body.get("tags") or {}, dict[str, str])
    except msgspec.ValidationError as e:
        raise ValidationError(f"invalid field: {e}") from None
    uenv, view = _uenv_and_view(body.get("uenv"), body.get("view"))
    image = _image(body.get("image"))
    for key in ("gpu_count", "memory_gb"):
        val = getattr(constraints, key)
        if not 0 <= val <= INT32_MAX:
            raise ValidationError(
                f"constraint {key} must be between 0 and {INT32_MAX} (got {val})",
                hint=f"Give {key} as a whole number, e.g. {key}=4.",
            )
    return AllocationSpec(
        entrypoint=entrypoint,
        tenant=tenant,
        vcluster=vcluster,
        nodes=nodes,
        walltime_seconds=walltime_seconds,
        lifecycle=lifecycle,
        preemption_class=pclass,
        name=str(body.get("name") or "")[:256],
        project=str(body.get("project") or ""),
        user=user,
        constraints=constraints,
        env=env,
        submit_dir=str(body.get("submit_dir") or ""),
        uenv=uenv,
        view=view,
        image=image,
        requeue_policy=requeue,
        max_requeue=max_requeue,
        tags=tags,
        request_id=str(body.get("request_id") or "")[:128],
        min_nodes=min_nodes if min_nodes != nodes else 0,
        wait_for_capacity=_bool(body.get("wait_for_capacity", False), "wait_for_capacity"),
        depends_on=_dependencies(body.get("depends_on")),
        liveness_probe=_liveness_probe(body.get("liveness_probe")),
        expose=_expose(body.get("expose")),
        scaling=scaling,
        **_checkpoint(body.get("checkpoint"), body.get("checkpoint_protocol")),
    )


def _checkpoint(raw: Any, raw_protocol: Any) -> dict[str, str]:
    """``checkpoint`` (auto | manual | none, or a protocol name as ``--checkpoint=signal``
    gives it, or the YAML form ``{strategy, protocol}``) and ``checkpoint_protocol``
    (signal | shmem | grpc). A protocol alone means ``auto``; a strategy other than
    none without a protocol uses ``signal`` (the legacy-compatible one)."""
    if isinstance(raw, dict):
        raw_protocol = raw.get("protocol", raw_protocol)
        raw = raw.get("strategy")
    mode = str(raw or "").strip().lower()
    protocol = str(raw_protocol or "").strip().lower()
    hint = "Use --checkpoint=signal|shmem|grpc (the protocol) or checkpoint: auto|manual|none."
    if mode in CHECKPOINT_PROTOCOLS:
        if protocol and protocol != mode:
            raise ValidationError(
                f"checkpoint protocol given twice: {mode!r} and {protocol!r}", hint=hint
            )
        mode, protocol = "auto", mode
    if mode and mode not in CHECKPOINT_MODES:
        raise ValidationError(f"unknown checkpoint strategy {mode!r}", hint=hint)
    if protocol and protocol not in CHECKPOINT_PROTOCOLS:
        raise ValidationError(f"unknown checkpoint protocol {protocol!r}", hint=hint)
    if not mode:
        mode = "auto" if protocol else "none"
    if mode == "none":
        if protocol:
            raise ValidationError(
                f"checkpoint: none cannot have a protocol ({protocol!r})", hint=hint
            )
        return {"checkpoint": "none", "checkpoint_protocol": ""}
    return {"checkpoint": mode, "checkpoint_protocol": protocol or "signal"}


_SCALING_HINT = (
    "e.g. --lifecycle reactive --min-nodes 2 --max-nodes 4 --scale-metric cpu_utilization "
    "--scale-target 0.8 (scaling: {metric, target, evaluation_interval, scale_up_window, "
    "scale_down_window, scale_down_threshold, cooldown})."
)
_SCALING_SECONDS = ("evaluation_interval", "scale_up_window", "scale_down_window", "cooldown")
MAX_SCALING_SECONDS = 86400


def _scaling(raw: Any, lifecycle: LifecycleType, min_nodes: int, nodes: int) -> ScalingSpec | None:
    """A reactive allocation's scaling settings (spec: Autoscaling): bounds from the node
    range (min_nodes < max_nodes), the metric (a name or ``name{label="value"}``), a
    positive target, scale_down_threshold in (0, 1), durations as seconds or 30s/2m/1h
    (evaluation_interval at least 1 s, all at most a day). Defaults: the
    specification's."""
    if lifecycle != LifecycleType.REACTIVE:
        if raw not in (None, {}):
            raise ValidationError(
                "scaling settings are only for reactive allocations",
                hint="Add --lifecycle reactive (with --min-nodes and --max-nodes), or "
                "leave out the --scale-* options.",
            )
        return None
    if not min_nodes or min_nodes >= nodes:
        raise ValidationError(
            f"a reactive allocation scales between min_nodes and max_nodes: it needs "
            f"1 <= min_nodes < max_nodes (got min {min_nodes or 'none'}, max {nodes})",
            hint=_SCALING_HINT,
        )
    if raw is None:
        raw = {}
    if not isinstance(raw, Mapping):
        raise ValidationError("scaling must be an object", hint=_SCALING_HINT)
    allowed = {"metric", "target", "scale_down_threshold", "cooldown_period", *_SCALING_SECONDS}
    unknown = sorted(set(map(str, raw)) - allowed)
    if unknown:
        raise ValidationError(
            f"unknown scaling setting {unknown[0]!r}",
            details={"allowed": ", ".join(sorted(allowed))},
            hint=_SCALING_HINT,
        )
    out: dict[str, Any] = {}
    metric = str(raw.get("metric") or "cpu_utilization").strip()
    try:
        name, matchers = promql.parse_metric_ref(metric)
        promql.metric_selector(name, matchers)
    except ValueError as e:
        raise ValidationError(
            f"invalid scaling metric {metric!r}: {e}",
            hint="Name a metric (cpu_utilization, gpu_utilization, queue_depth) or a TSDB "
            'series with label matchers, e.g. custom_metric{job="my-inference"}.',
        ) from None
    out["metric"] = metric[:512]
    if raw.get("target") not in (None, ""):
        out["target"] = _float(raw["target"], "scaling target")
        if out["target"] <= 0:
            raise ValidationError(
                f"scaling target must be greater than zero (got {out['target']:g})",
                hint="e.g. --scale-target 0.8 (80 % utilisation).",
            )
    if raw.get("scale_down_threshold") not in (None, ""):
        thr = _float(raw["scale_down_threshold"], "scale_down_threshold")
        if not 0 < thr < 1:
            raise ValidationError(
                f"scale_down_threshold must be between 0 and 1 (got {thr:g})",
                hint="It is a fraction of the target: 0.5 scales down below half the target.",
            )
        out["scale_down_threshold"] = thr
    if raw.get("cooldown") in (None, "") and raw.get("cooldown_period") not in (None, ""):
        raw = {**raw, "cooldown": raw["cooldown_period"]}
    for key in _SCALING_SECONDS:
        if raw.get(key) in (None, ""):
            continue
        seconds = _seconds(raw[key], key)
        least = 1.0 if key == "evaluation_interval" else 0.0
        if not least <= seconds <= MAX_SCALING_SECONDS:
            raise ValidationError(
                f"{key} must be between {least:g} s and {MAX_SCALING_SECONDS} s "
                f"(got {seconds:g} s)",
                hint=_SCALING_HINT,
            )
        out[key] = seconds
    return ScalingSpec(**out)


def _float(v: Any, field: str) -> float:
    try:
        x = float(str(v).strip()) if not isinstance(v, bool) else math.nan
    except (TypeError, ValueError):
        x = math.nan
    if not math.isfinite(x):
        raise ValidationError(f"{field} must be a number (got {v!r})", hint=_SCALING_HINT)
    return x


def _seconds(v: Any, field: str) -> float:
    """A duration: a number of seconds, or text like 90s, 2m, 1h."""
    if isinstance(v, int | float) and not isinstance(v, bool):
        return float(v)
    text = str(v).strip()
    try:
        return float(text)
    except ValueError:
        return float(parse_duration(text, field=field))


def _uenv_and_view(raw_uenv: Any, raw_view: Any) -> tuple[str, str]:
    """``uenv`` as ``name/version[:tag]`` and ``view`` (one word, only with a uenv).
    Whether the uenv exists is the registry's to say (AllocationOps.resolve_uenv)."""
    uenv = str(raw_uenv or "").strip()
    view = str(raw_view or "").strip()
    try:
        if uenv:
            uenv = format_ref(*parse_ref(uenv))
        if view:
            check_view_name(view)
    except UenvError as e:
        raise ValidationError(e.message, hint=e.hint) from None
    if view and not uenv:
        raise ValidationError(
            f"view {view!r} given without a uenv",
            hint="A view is one of a uenv's environments: add --uenv=NAME/VERSION[:TAG] "
            "(e.g. --uenv=prgenv-gnu/24.11:v1 --view=default), or leave out --view.",
        )
    return uenv, view


def _image(raw: Any) -> str:
    """``image`` as a validated OCI reference (whether it exists is for the nodes'
    prologue to find out: they pull it)."""
    image = str(raw or "").strip()
    if not image:
        return ""
    try:
        parse_image_ref(image)
    except ImageRefError as e:
        raise ValidationError(
            str(e), hint="e.g. --image=registry.example.org/ml/pytorch:2.4"
        ) from None
    return image


MAX_EXPOSED_PORTS = 64
MAX_PROBE_SECONDS = 86400


def _port(v: Any, field: str) -> int:
    port = _int(v, field)
    if not 1 <= port <= 65535:
        raise ValidationError(f"{field} must be between 1 and 65535 (got {port})")
    return port


def _liveness_probe(raw: Any) -> LivenessProbeSpec | None:
    """``liveness_probe``: {probe_type: tcp|http, port, path, period_secs,
    initial_delay_secs, failure_threshold, timeout_secs}; unset numbers take the
    specification's defaults (30, 10, 3, 5)."""
    if raw in (None, "", {}):
        return None
    if not isinstance(raw, Mapping):
        raise ValidationError(
            "liveness_probe must be an object",
            hint="e.g. liveness_probe: {probe_type: http, port: 8080, path: /healthz}",
        )
    default = LivenessProbeSpec()
    probe_type = str(raw.get("probe_type") or default.probe_type).strip().lower()
    if probe_type not in ("tcp", "http"):
        raise ValidationError(
            f"unknown liveness probe type {raw.get('probe_type')!r}", hint="Use tcp or http."
        )
    path = str(raw.get("path") or default.path)
    if not path.startswith("/"):
        raise ValidationError(f"liveness probe path must start with / (got {path!r})")

    def seconds(key: str, low: int) -> int:
        v = raw.get(key)
        n = getattr(default, key) if v in (None, "") else _int(v, f"liveness_probe.{key}")
        if not low <= n <= MAX_PROBE_SECONDS:
            raise ValidationError(
                f"liveness_probe.{key} must be between {low} and {MAX_PROBE_SECONDS} (got {n})"
            )
        return n

    return LivenessProbeSpec(
        probe_type=probe_type,
        port=_port(raw.get("port"), "liveness_probe.port"),
        path=path[:1024],
        period_secs=seconds("period_secs", 1),
        initial_delay_secs=seconds("initial_delay_secs", 0),
        failure_threshold=seconds("failure_threshold", 1),
        timeout_secs=seconds("timeout_secs", 1),
    )


def _expose(raw: Any) -> list[ExposedPort]:
    """``expose``: [{name, port, protocol}] (connectivity.expose); a bare port number
    or "name:port" text is accepted too (``--expose=8080`` names it ``port-8080``)."""
    if raw in (None, "", []):
        return []
    if not isinstance(raw, list) or len(raw) > MAX_EXPOSED_PORTS:
        raise ValidationError(
            f"expose must be a list of at most {MAX_EXPOSED_PORTS} {{name, port}} entries",
            hint="e.g. expose: [{name: api, port: 8080}]",
        )
    out: list[ExposedPort] = []
    for item in raw:
        if isinstance(item, Mapping):
            name, port, protocol = item.get("name"), item.get("port"), item.get("protocol")
        elif isinstance(item, int | str) and not isinstance(item, bool):
            name, _, port = str(item).rpartition(":")
            protocol = ""
        else:
            raise ValidationError(f"invalid exposed port {item!r}", hint="Give {name, port}.")
        number = _port(port, "expose.port")
        name = str(name or f"port-{number}").strip()
        if not name or len(name) > 253 or any(ch.isspace() or ch == "/" for ch in name):
            raise ValidationError(
                f"invalid service name {name!r}",
                hint="A service name has no spaces or slashes, e.g. api or metrics.",
            )
        out.append(ExposedPort(name=name, port=number, protocol=str(protocol or "")[:32]))
    return out


MAX_DEPENDENCIES = 1000


def _dependencies(raw: Any) -> list[Dependency]:
    """``depends_on``: [{ref, condition}] (also ``{ref: condition}`` entries), conditions
    by their Lattice or Slurm names (afterok, afternotok, afterany, aftercorr, singleton)."""
    if raw in (None, "", []):
        return []
    if not isinstance(raw, list) or len(raw) > MAX_DEPENDENCIES:
        raise ValidationError(
            f"depends_on must be a list of at most {MAX_DEPENDENCIES} {{ref, condition}} entries",
            hint="e.g. depends_on: [{ref: a1b2c3d4, condition: success}]",
        )
    out: list[Dependency] = []
    for item in raw:
        if isinstance(item, dict) and "ref" in item:
            ref, cond = item.get("ref"), item.get("condition") or "success"
        elif isinstance(item, dict) and len(item) == 1:
            ((ref, cond),) = item.items()
        else:
            raise ValidationError(f"invalid dependency {item!r}", hint="Give {ref, condition}.")
        if not isinstance(ref, str) or not ref.strip():
            raise ValidationError(f"dependency without an allocation id: {item!r}")
        out.append(Dependency(ref.strip(), DependencyCondition.parse(cond).value))
    return out


INT32_MAX = 2**31 - 1
MAX_WALLTIME_SECONDS = 366 * 86400


def _bool(v: Any, field: str) -> bool:
    if v is None or isinstance(v, bool):
        return bool(v)
    raise ValidationError(
        f"{field} must be true or false (got {v!r})",
        details={field: v},
        hint=f"Give {field} as a JSON boolean, e.g. {field}: true.",
    )


def _int(v: Any, field: str) -> int:
    hint = f"Give {field} as a whole number, e.g. {field}=4."
    if isinstance(v, bool):
        raise ValidationError(f"{field} must be a whole number", hint=hint)
    try:
        n = int(str(v).strip())
    except (TypeError, ValueError):
        raise ValidationError(
            f"{field} must be a whole number (got {v!r})", details={field: v}, hint=hint
        ) from None
    if abs(n) > INT32_MAX:
        raise ValidationError(f"{field} is out of range (got {n})", hint=hint)
    return n


def _check_text(body: Mapping[str, Any]) -> None:
    """Reject text that cannot be stored (lone surrogates from JSON escapes)."""

    def walk(x: Any) -> None:
        if isinstance(x, str):
            try:
                x.encode("utf-8")
            except UnicodeEncodeError:
                raise ValidationError(
                    "the request contains text that is not valid UTF-8",
                    hint="Remove unpaired \\uD800-\\uDFFF escapes from the request.",
                ) from None
        elif isinstance(x, Mapping):
            for k, val in x.items():
                walk(k)
                walk(val)
        elif isinstance(x, list | tuple):
            for val in x:
                walk(val)

    walk(body)
