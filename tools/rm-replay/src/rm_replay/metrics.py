"""Scheduling-outcome metrics of one RM-Replay run (pure: no I/O, no clock).

Everything is computed from a ``SimulationResult`` (``rm_replay.model``): the job
records (submit / start / end, nodes, GPUs, flags), the utilization samples and the
per-cycle statistics. :func:`metrics_dict` returns a plain, deterministic dict (fixed
key order, floats rounded to 6 decimals) that ``report.py`` writes as ``metrics.json``
and that ``compare.py`` and ``regress.py`` read back.

Definitions (the Testing Strategy's "Evaluate" list and the Tuning Guide's report)
---------------------------------------------------------------------------------
Time window.  The run spans ``[t0, t_end]``: ``t0`` is the first submission,
``t_end = t0 + result.makespan`` (the engine's makespan: last end minus first
submit), or the replay's ``end_time`` when it was stopped (``max_time``) with work
unfinished.

Job intervals.  A job holds ``nodes`` whole nodes while it runs (and checkpoints).
Without preemption that is ``[start, end]`` (``end`` missing: until ``t_end``). A
preempted and requeued job reports its first ``start``, its ``last_start`` and the
node-seconds it held over all its runs: the earlier runs are taken as one interval
from ``start`` of the held time beyond the last run (exact for one preemption).
Intervals serve the time-resolved metrics (fairness window, ramp-up, idle time);
totals use the engine's exact ``node_seconds`` / ``gpu_seconds``.

Cancelled before start.  A job the trace's cancel event removed from the queue
before it ever started in the replay (state ``cancelled``, no ``start``): the user
withdrew it, so it is no starvation. It is left out of the wait statistics (overall,
per class, sensitive), SLO compliance and bounded slowdown, and counted in
``jobs.cancelled_before_start``, next to ``never_started`` (``total`` = ``started`` +
``never_started`` + ``cancelled_before_start``). It holds no nodes; it counts as
waiting from its submission to the cancel (its ``end``) for the idle-while-pending
sweep, and its fairness demand is capped at that time. A job cancelled after it
started is an ordinary started job (its wait is ``start - submit``).

* **Utilization**: node-hours (GPU-hours) used / available: used = sum of the jobs'
  ``node_seconds`` (``gpu_seconds``), available = inventory nodes (GPUs) x makespan.
* **Wait**: ``start - submit`` (the first start). A job that never started (and was
  not cancelled before it started) is *censored*: its wait counts as ``window end -
  submit`` (a lower bound), so starvation shows in the tail instead of vanishing;
  ``never_started`` counts them. p50 / p95 / p99 by linear interpolation, overall and
  per preemption class.
* **Bounded slowdown**: ``max(1, (wait + run) / max(run, 10 s))`` per finished job
  (``run`` = ``end - start``), mean / p50 / p99 / max.
* **Makespan**: ``result.makespan``.
* **Fairness**, over a window: the submission window ``[first submit, last submit]``
  (``fairness_window="submission"``, the default: while work is still arriving; over
  the whole run every job eventually runs, so every tenant's share would simply be its
  share of the demand) or the whole run (``"makespan"``). Per tenant: *used* = its
  node-hours inside the window; *share* = used / all tenants' used; *target* =
  ``fair_share_targets[tenant]`` normalised over the tenants that submitted work (no
  targets at all: equal; a tenant without a target is listed, not scored); *demand* =
  node-hours its jobs submitted in the window could have run inside it (runtime capped
  at walltime, at the time from submission to the window's end: a job submitted an
  hour before the end cannot have been owed six hours of it, and for a cancelled job
  at the time from submission to its ``end``); *fair
  share* = the demand-aware entitlement (:func:`entitlements`): the node-hours used in
  the window divided by weighted water-filling with the targets as weights, no tenant
  above its demand, so capacity a tenant does not ask for goes to the others and is
  not counted as unfair. When every tenant asks for at least its target, fair share
  = target. **Max share deviation** = ``max |share - fair share|`` (absolute, a
  fraction; the report prints percentage points); ``max_target_deviation`` is the same
  against the raw targets. **Jain's index** over ``x_i = share_i / fair_share_i``:
  ``(sum x)^2 / (n * sum x^2)`` in ``(0, 1]``, 1 = every tenant exactly at its fair
  share.
* **Backfill**: backfill jobs = jobs with ``backfilled``. *Backfill effectiveness* =
  the share of the idle node-time that backfilled jobs filled:
  ``BF / (BF + idle_while_pending)``, where BF = node-hours run by backfilled jobs and
  idle_while_pending = node-hours of idle nodes while at least one submitted job was
  waiting (from the job records; idleness with an empty queue is not a backfill
  opportunity). In words: of all node-time that was free while work waited -- the
  holes a backfilling scheduler can fill, counting those it did fill -- the fraction
  that backfilled jobs filled. 0 when there were no such holes.
* **SLO compliance**: share of submitted jobs (not counting those cancelled before
  they started) whose wait <= ``slo_wait_s`` (default 1 h); a never-started job
  counts as a miss.
* **Preemptions per hour**: sum of ``preempted_count`` / makespan in hours.
* **Checkpoint success rate**: sum of ``checkpoints_succeeded`` / sum of
  ``checkpoints_attempted`` (``None`` when none were attempted). **Lost node-hours**:
  sum of ``lost_node_seconds`` / 3600, the work of runs that preemption stopped
  without a usable checkpoint (to be computed again). **Autoscaling**: reactive
  allocations that scaled, and their scale-ups / scale-downs.
* **Ramp-up time**: from ``t0`` to the first instant the busy nodes reach
  ``ramp_target`` (default 80 %) of the inventory (``None`` if never).
* **Sensitive wait**: wait statistics of jobs with ``sensitive`` (the regression
  threshold is a max wait of 0).
* **Cycle latency** (wall clock, ``CycleStat.duration_s``): p50 / p99 / max. Not
  deterministic, so only in :func:`wall_metrics` (``report.py`` writes it to
  ``timing.json`` and shows it in ``report.txt``), never in :func:`metrics_dict`.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

DEFAULT_SLO_WAIT_S = 3600.0
DEFAULT_RAMP_TARGET = 0.80
SLOWDOWN_TAU_S = 10.0
METRICS_VERSION = 1
_EPS = 1e-9


# -- small numeric helpers -------------------------------------------------------------


def percentile(values: Sequence[float], q: float) -> float | None:
    """The q-th percentile (0..100) with linear interpolation between closest ranks
    (numpy's default); ``None`` for no values."""
    if not values:
        return None
    xs = sorted(values)
    if len(xs) == 1:
        return float(xs[0])
    pos = (len(xs) - 1) * min(100.0, max(0.0, q)) / 100.0
    lo = math.floor(pos)
    hi = math.ceil(pos)
    return float(xs[lo] + (xs[hi] - xs[lo]) * (pos - lo))


def jain_index(values: Iterable[float]) -> float:
    """Jain's fairness index ``(sum x)^2 / (n * sum x^2)`` of non-negative values.

    In ``[1/n, 1]`` whenever some value is positive; 1.0 for equal values, for an empty
    sequence and for all zeros (nobody got anything: equally so)."""
    xs = [float(x) for x in values]
    if any(x < 0 or not math.isfinite(x) for x in xs):
        raise ValueError("Jain's index needs finite, non-negative values")
    n = len(xs)
    sq = sum(x * x for x in xs)
    if n == 0 or sq <= 0.0:
        return 1.0
    return min(1.0, sum(xs) ** 2 / (n * sq))


def rnd(x: float | None, digits: int = 6) -> float | None:
    """Round for deterministic output; ``None`` / NaN / inf -> ``None``; no ``-0.0``."""
    if x is None:
        return None
    x = float(x)
    if not math.isfinite(x):
        return None
    r = round(x, digits)
    return 0.0 if r == 0 else r


def _stats(values: Sequence[float]) -> dict[str, Any]:
    return {
        "count": len(values),
        "mean_s": rnd(sum(values) / len(values)) if values else None,
        "p50_s": rnd(percentile(values, 50)),
        "p95_s": rnd(percentile(values, 95)),
        "p99_s": rnd(percentile(values, 99)),
        "max_s": rnd(max(values)) if values else None,
    }


# -- reading the result (duck-typed on the model's Structs) ---------------------------


def _get(obj: Any, name: str, default: Any = None) -> Any:
    if isinstance(obj, Mapping):
        return obj.get(name, default)
    return getattr(obj, name, default)


def capacity(result: Any) -> tuple[int, int]:
    """(nodes, GPUs) of the inventory: from the samples, else ``inventory_summary``."""
    samples = _get(result, "samples") or []
    if samples:
        s = samples[0]
        return int(_get(s, "total_nodes", 0) or 0), int(_get(s, "total_gpus", 0) or 0)
    inv = _get(result, "inventory_summary") or {}
    nodes = _get(inv, "total_nodes", None)
    if nodes is None:
        nodes = _get(inv, "nodes", 0)
    gpus = _get(inv, "total_gpus", None)
    if gpus is None:
        gpus = _get(inv, "gpus", 0)
    if isinstance(nodes, Sequence | Mapping):
        nodes = len(nodes)
    return int(nodes or 0), int(gpus or 0)


def window(result: Any) -> tuple[float, float]:
    """``(t0, t_end)`` of the run: the first submission to ``t0 + makespan``, or to the
    replay's ``end_time`` when it stopped later (``max_time`` with work unfinished)."""
    jobs = _get(result, "jobs") or []
    t0 = min((float(j.submit) for j in jobs), default=float(_get(result, "start_time", 0.0) or 0.0))
    makespan = float(_get(result, "makespan", 0.0) or 0.0)
    t_end = t0 + max(0.0, makespan)
    end_time = float(_get(result, "end_time", 0.0) or 0.0)
    if jobs and end_time > t_end and any(j.end is None for j in jobs):
        t_end = end_time
    return t0, t_end


def job_intervals(job: Any, t_end: float) -> list[tuple[float, float]]:
    """The intervals a job held its nodes (see the module docstring)."""
    raw = _get(job, "intervals", None)
    if raw is None:
        raw = _get(job, "run_intervals", None)
    out: list[tuple[float, float]] = []
    if raw:
        for iv in raw:
            s, e = (iv[0], iv[1]) if isinstance(iv, Sequence) else (iv.start, iv.end)
            e = t_end if e is None else e
            if e > s:
                out.append((float(s), float(e)))
        return out
    start = _get(job, "start")
    if start is None:
        return out
    start = float(start)
    end = _get(job, "end")
    end = t_end if end is None else float(end)
    last = _get(job, "last_start")
    last = start if last is None else float(last)
    nodes = int(_get(job, "nodes", 0) or 0)
    held = float(_get(job, "node_seconds", 0.0) or 0.0)
    if last > start and nodes > 0 and held > 0:
        # preempted and restarted: the earlier runs (checkpoint included) are the
        # held time beyond the last run, placed from the first start on
        earlier = min(last - start, max(0.0, held / nodes - max(0.0, end - last)))
        if earlier > 0:
            out.append((start, start + earlier))
        if end > last:
            out.append((last, end))
        return out
    if end > start:
        out.append((start, end))
    return out


def _held_seconds(job: Any, t_end: float) -> tuple[float, float]:
    """(node-seconds, GPU-seconds) a job held: the engine's exact ``node_seconds`` /
    ``gpu_seconds`` when it reports them, else from :func:`job_intervals`."""
    ns = float(_get(job, "node_seconds", 0.0) or 0.0)
    gs = float(_get(job, "gpu_seconds", 0.0) or 0.0)
    if ns > 0:
        return ns, gs
    length = sum(e - s for s, e in job_intervals(job, t_end))
    nodes = int(job.nodes)
    return length * nodes, length * nodes * int(_get(job, "gpus_per_node", 0) or 0)


def cancelled_before_start(job: Any) -> bool:
    """The job was cancelled (the trace's cancel event) before it ever started."""
    return _get(job, "state") == "cancelled" and _get(job, "start") is None


def job_wait(job: Any, t_end: float) -> tuple[float, bool]:
    """(wait seconds, censored): ``start - submit``, or ``t_end - submit`` if never
    started (for a job cancelled before it started: its time in the queue, ``end -
    submit``; :func:`metrics_dict` leaves such jobs out of the wait statistics)."""
    start = _get(job, "start")
    if start is None:
        end = _get(job, "end")
        if cancelled_before_start(job) and end is not None:
            return max(0.0, min(float(end), t_end) - float(job.submit)), True
        return max(0.0, t_end - float(job.submit)), True
    return max(0.0, float(start) - float(job.submit)), False


def _overlap(a: float, b: float, lo: float, hi: float) -> float:
    return max(0.0, min(b, hi) - max(a, lo))


def _sweep_events(jobs: Sequence[Any], t_end: float) -> list[tuple[float, int, int]]:
    """(time, delta busy nodes, delta waiting jobs), sorted; at equal times ends and
    dequeues come first. A job waits from its submission to its first run and between
    runs (requeued after a preemption)."""
    events: list[tuple[float, int, int]] = []
    for j in jobs:
        n = int(j.nodes)
        ivs = job_intervals(j, t_end)
        prev = float(j.submit)
        for s, e in ivs:
            events.append((s, n, 0))
            events.append((e, -n, 0))
            if s > prev:
                events.append((prev, 0, 1))
                events.append((s, 0, -1))
            prev = e
        stop = t_end
        if not ivs and cancelled_before_start(j) and j.end is not None:
            stop = min(t_end, float(j.end))  # waited until the cancel
        if not ivs and stop > prev:
            events.append((prev, 0, 1))
            events.append((stop, 0, -1))
    events.sort(key=lambda ev: (ev[0], ev[1] > 0, ev[2] > 0))
    return events


def idle_while_pending_node_s(
    jobs: Sequence[Any], total_nodes: int, t0: float, t_end: float
) -> float:
    """Node-seconds of idle nodes while at least one submitted job was waiting."""
    busy = 0
    pending = 0
    last = t0
    idle = 0.0
    for t, d_busy, d_pend in _sweep_events(jobs, t_end):
        t = min(max(t, t0), t_end)
        if pending > 0 and t > last:
            idle += max(0, total_nodes - busy) * (t - last)
        last = max(last, t)
        busy += d_busy
        pending += d_pend
    return idle


def ramp_up_s(
    jobs: Sequence[Any], total_nodes: int, t0: float, t_end: float, target: float
) -> float | None:
    """Seconds from ``t0`` until busy nodes first reach ``target`` x ``total_nodes``."""
    if total_nodes <= 0:
        return None
    need = target * total_nodes - _EPS
    busy = 0
    events = sorted(
        ((t, d) for t, d, _ in _sweep_events(jobs, t_end) if d != 0),
        key=lambda ev: (ev[0], ev[1] > 0),
    )
    i = 0
    while i < len(events):
        t = events[i][0]
        while i < len(events) and events[i][0] == t:
            busy += events[i][1]
            i += 1
        if busy >= need:
            return max(0.0, t - t0)
    return None


# -- the metrics ----------------------------------------------------------------------


def _class_key(c: Any) -> tuple[int, str]:
    try:
        return (int(c), str(c))
    except (TypeError, ValueError):
        return (1 << 30, str(c))


def entitlements(
    targets: Mapping[str, float], demand: Mapping[str, float], capacity: float
) -> dict[str, float]:
    """Demand-aware fair shares: ``capacity`` divided by weighted water-filling (weights
    = ``targets``), nobody getting more than its ``demand``; what a capped tenant leaves
    goes to the others in proportion to their targets. Tenants with a zero target get
    only what the others cannot use, equally. Returns amounts (same unit as inputs)."""
    names = sorted(targets)
    alloc = dict.fromkeys(names, 0.0)
    left = max(0.0, capacity)
    active = [t for t in names if targets[t] > 0 and demand.get(t, 0.0) > 0]
    while active and left > _EPS:
        wsum = sum(targets[t] for t in active)
        capped = [
            t for t in active if demand.get(t, 0.0) - alloc[t] <= left * targets[t] / wsum + _EPS
        ]
        if not capped:
            for t in active:
                alloc[t] += left * targets[t] / wsum
            left = 0.0
            break
        for t in capped:
            left -= demand[t] - alloc[t]
            alloc[t] = demand[t]
        active = [t for t in active if t not in capped]
    rest = [t for t in names if targets[t] <= 0 and demand.get(t, 0.0) > 0]
    while rest and left > _EPS:
        each = left / len(rest)
        capped = [t for t in rest if demand[t] - alloc[t] <= each + _EPS]
        if not capped:
            for t in rest:
                alloc[t] += each
            break
        for t in capped:
            left -= demand[t] - alloc[t]
            alloc[t] = demand[t]
        rest = [t for t in rest if t not in capped]
    return alloc


def fairness(result: Any, *, mode: str = "submission") -> dict[str, Any]:
    """Tenants' shares vs their fair shares, Jain's index, max deviation (module
    docstring)."""
    jobs = _get(result, "jobs") or []
    t0, t_end = window(result)
    if mode == "submission" and jobs:
        lo = min(float(j.submit) for j in jobs)
        hi = max(float(j.submit) for j in jobs)
        if hi - lo <= 0:
            lo, hi = t0, t_end
    else:
        lo, hi = t0, t_end
    used: dict[str, float] = {}
    demand: dict[str, float] = {}
    for j in jobs:
        ns = sum(_overlap(s, e, lo, hi) for s, e in job_intervals(j, t_end)) * int(j.nodes)
        used[j.tenant] = used.get(j.tenant, 0.0) + ns
        if lo <= float(j.submit) <= hi:
            run = float(j.runtime or 0.0)
            if j.walltime:
                run = min(run, float(j.walltime))
            if _get(j, "state") == "cancelled" and j.end is not None:
                run = min(run, max(0.0, float(j.end) - float(j.submit)))
            # what the job could have run inside the window had it started at once
            run = min(run, hi - float(j.submit))
            demand[j.tenant] = demand.get(j.tenant, 0.0) + run * int(j.nodes)
    tenants = sorted(used)
    raw_targets = {t: float(v) for t, v in (_get(result, "fair_share_targets") or {}).items()}
    if not any(raw_targets.get(t, 0.0) > 0 for t in tenants):
        raw_targets = dict.fromkeys(tenants, 1.0)
    scored = [t for t in tenants if raw_targets.get(t, 0.0) > 0]
    tsum = sum(raw_targets[t] for t in scored)
    total = sum(used[t] for t in scored)
    fair = entitlements({t: raw_targets[t] for t in scored}, demand, total)
    rows: dict[str, Any] = {}
    xs: list[float] = []
    max_dev = 0.0
    max_target_dev = 0.0
    for t in tenants:
        if t in scored and total > 0:
            share = used[t] / total
            target = raw_targets[t] / tsum
            fair_share = fair.get(t, 0.0) / total
            dev = abs(share - fair_share)
            max_dev = max(max_dev, dev)
            max_target_dev = max(max_target_dev, abs(share - target))
            if fair_share > 0:
                xs.append(share / fair_share)
        else:
            share = target = fair_share = dev = None
        rows[t] = {
            "node_hours": rnd(used[t] / 3600.0),
            "demand_node_hours": rnd(demand.get(t, 0.0) / 3600.0),
            "target": rnd(target),
            "fair_share": rnd(fair_share),
            "share": rnd(share),
            "deviation": rnd(dev),
        }
    return {
        "window": mode,
        "window_start_s": rnd(lo),
        "window_end_s": rnd(hi),
        "jain_index": rnd(jain_index(xs)),
        "max_share_deviation": rnd(max_dev),
        "max_target_deviation": rnd(max_target_dev),
        "tenants": rows,
    }


def metrics_dict(
    result: Any,
    *,
    slo_wait_s: float = DEFAULT_SLO_WAIT_S,
    ramp_target: float = DEFAULT_RAMP_TARGET,
    fairness_window: str = "submission",
) -> dict[str, Any]:
    """All deterministic metrics of ``result`` as a JSON-ready dict (module docstring
    for the definitions). Same result -> same dict, key order included."""
    jobs = list(_get(result, "jobs") or [])
    jobs.sort(key=lambda j: (float(j.submit), str(j.id)))
    total_nodes, total_gpus = capacity(result)
    t0, t_end = window(result)
    makespan = t_end - t0
    hours = makespan / 3600.0

    # utilization
    node_s = 0.0
    gpu_s = 0.0
    bf_node_s = 0.0
    for j in jobs:
        ns, gs = _held_seconds(j, t_end)
        node_s += ns
        gpu_s += gs
        if j.backfilled:
            bf_node_s += ns
    node_avail = total_nodes * makespan
    gpu_avail = total_gpus * makespan

    # waits
    waits: list[float] = []
    by_class: dict[Any, list[float]] = {}
    sens: list[float] = []
    never = 0
    withdrawn = 0
    slo_ok = 0
    for j in jobs:
        if cancelled_before_start(j):
            withdrawn += 1
            continue
        w, censored = job_wait(j, t_end)
        never += censored
        waits.append(w)
        by_class.setdefault(j.preemption_class, []).append(w)
        if j.sensitive:
            sens.append(w)
        if not censored and w <= slo_wait_s + _EPS:
            slo_ok += 1

    # bounded slowdown over finished jobs
    slow: list[float] = []
    for j in jobs:
        if j.start is None or j.end is None:
            continue
        run = max(0.0, float(j.end) - float(j.start))
        wait = float(j.start) - float(j.submit)
        slow.append(max(1.0, (wait + run) / max(run, SLOWDOWN_TAU_S)))

    states: dict[str, int] = {}
    for j in jobs:
        states[j.state] = states.get(j.state, 0) + 1
    preempted = sum(int(j.preempted_count or 0) for j in jobs)
    ck_att = sum(int(j.checkpoints_attempted or 0) for j in jobs)
    ck_ok = sum(int(j.checkpoints_succeeded or 0) for j in jobs)
    lost_s = sum(float(_get(j, "lost_node_seconds", 0.0) or 0.0) for j in jobs)
    ups = sum(int(_get(j, "scale_ups", 0) or 0) for j in jobs)
    downs = sum(int(_get(j, "scale_downs", 0) or 0) for j in jobs)
    reactive = sum(1 for j in jobs if _get(j, "scale_ups", 0) or _get(j, "scale_downs", 0))
    idle_pending = idle_while_pending_node_s(jobs, total_nodes, t0, t_end)
    bf_den = bf_node_s + idle_pending
    n_bf = sum(1 for j in jobs if j.backfilled)
    cycles = list(_get(result, "cycles") or [])

    return {
        "metrics_version": METRICS_VERSION,
        "run": {
            "trace": _get(result, "trace_name"),
            "policy": _get(result, "policy"),
            "seed": _get(result, "seed"),
            "nodes": total_nodes,
            "gpus": total_gpus,
            "t0_s": rnd(t0),
            "makespan_s": rnd(makespan),
        },
        "jobs": {
            "total": len(jobs),
            "started": len(jobs) - never - withdrawn,
            "never_started": never,
            "cancelled_before_start": withdrawn,
            "states": {k: states[k] for k in sorted(states)},
        },
        "utilization": {
            "node_hours_used": rnd(node_s / 3600.0),
            "node_hours_available": rnd(node_avail / 3600.0),
            "node_utilization": rnd(node_s / node_avail if node_avail > 0 else 0.0),
            "gpu_hours_used": rnd(gpu_s / 3600.0),
            "gpu_hours_available": rnd(gpu_avail / 3600.0),
            "gpu_utilization": rnd(gpu_s / gpu_avail if gpu_avail > 0 else None),
        },
        "wait": {
            "overall": _stats(waits),
            "by_class": {str(c): _stats(by_class[c]) for c in sorted(by_class, key=_class_key)},
        },
        "slowdown": {
            "tau_s": SLOWDOWN_TAU_S,
            "count": len(slow),
            "mean": rnd(sum(slow) / len(slow)) if slow else None,
            "p50": rnd(percentile(slow, 50)),
            "p99": rnd(percentile(slow, 99)),
            "max": rnd(max(slow)) if slow else None,
        },
        "fairness": fairness(result, mode=fairness_window),
        "backfill": {
            "jobs": n_bf,
            "share_of_jobs": rnd(n_bf / len(jobs) if jobs else 0.0),
            "node_hours": rnd(bf_node_s / 3600.0),
            "idle_node_hours_while_pending": rnd(idle_pending / 3600.0),
            "effectiveness": rnd(bf_node_s / bf_den if bf_den > 0 else 0.0),
        },
        "slo": {
            "target_wait_s": rnd(slo_wait_s),
            "compliant_jobs": slo_ok,
            "compliance": rnd(slo_ok / (len(jobs) - withdrawn) if len(jobs) > withdrawn else 1.0),
        },
        "preemption": {
            "total": preempted,
            "jobs_preempted": sum(1 for j in jobs if (j.preempted_count or 0) > 0),
            "per_hour": rnd(preempted / hours if hours > 0 else 0.0),
        },
        "checkpoint": {
            "attempted": ck_att,
            "succeeded": ck_ok,
            "success_rate": rnd(ck_ok / ck_att if ck_att else None),
            # work done again: runs stopped by preemption without a usable checkpoint
            "lost_node_hours": rnd(lost_s / 3600.0),
        },
        "autoscaling": {"allocations_scaled": reactive, "scale_ups": ups, "scale_downs": downs},
        "sensitive": {"jobs": len(sens), **_stats(sens)},
        "ramp_up": {
            "target_utilization": rnd(ramp_target),
            "ramp_up_s": rnd(ramp_up_s(jobs, total_nodes, t0, t_end, ramp_target)),
        },
        "scheduling": {
            "cycles": len(cycles),
            "placed": sum(int(_get(c, "placed", 0) or 0) for c in cycles),
            "backfilled": sum(int(_get(c, "backfilled", 0) or 0) for c in cycles),
            "max_pending": max((int(_get(c, "pending", 0) or 0) for c in cycles), default=0),
        },
    }


def wall_metrics(result: Any) -> dict[str, Any]:
    """Wall-clock metrics (not deterministic): scheduling-cycle latency."""
    durs = [float(_get(c, "duration_s", 0.0) or 0.0) for c in (_get(result, "cycles") or [])]
    out = wall_metrics_from_durations(durs)
    out["replay_wall_s"] = rnd(_get(result, "wall_time_s", None))
    return out


def wall_metrics_from_durations(durations: Sequence[float]) -> dict[str, Any]:
    """Cycle-latency percentiles of per-cycle wall times (seconds)."""
    durs = [float(d) for d in durations]
    return {
        "cycles": len(durs),
        "cycle_latency_p50_s": rnd(percentile(durs, 50)),
        "cycle_latency_p99_s": rnd(percentile(durs, 99)),
        "cycle_latency_max_s": rnd(max(durs)) if durs else None,
        "cycle_time_total_s": rnd(sum(durs)),
    }
