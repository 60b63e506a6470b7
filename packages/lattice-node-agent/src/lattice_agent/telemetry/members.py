"""Which processes belong to an allocation on this node, for the telemetry sources that
attribute per process (eBPF, the file-access audit, NVML): its cgroup scope's
``cgroup.procs`` when the scope exists, else every process whose process group is one of
the target's (``Target.pgids``: the batch script's, launched ranks', attach sessions')."""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

from lattice_agent.telemetry.proc import parse_stat
from lattice_agent.telemetry.samples import Target

__all__ = ["by_process_group", "members", "scope_pids", "target_pids"]


def scope_pids(t: Target) -> list[int] | None:
    """The processes of the target's cgroup scope (None: it has none, or it is gone)."""
    if t.scope is None:
        return None
    for d in t.scope.dirs.values():
        try:
            text = (d / "cgroup.procs").read_text()
        except OSError:
            continue
        return [int(x) for x in text.split() if x.isdigit()]
    return None


def by_process_group(proc: Path | str = "/proc") -> dict[int, list[int]]:
    """Every process on the node by process group (one pass over /proc)."""
    root = Path(proc)
    out: dict[int, list[int]] = {}
    try:
        names = os.listdir(root)
    except OSError:
        return out
    for name in names:
        if not name.isdigit():
            continue
        try:
            with open(root / name / "stat", "rb") as f:
                info = parse_stat(int(name), f.read())
        except OSError:
            continue
        if info is not None:
            out.setdefault(info.pgrp, []).append(info.pid)
    return out


def target_pids(t: Target, groups: dict[int, list[int]]) -> list[int]:
    """The target's processes: its scope's, else its process groups' in ``groups``."""
    pids = scope_pids(t)
    return pids if pids is not None else [p for g in t.pgids for p in groups.get(g, ())]


def members(targets: Sequence[Target], proc: Path | str = "/proc") -> dict[str, list[int]]:
    """Each target's processes; /proc is scanned once, and only when a target has no
    scope."""
    out: dict[str, list[int]] = {}
    groups: dict[int, list[int]] | None = None
    for t in targets:
        pids = scope_pids(t)
        if pids is None:
            if groups is None:
                groups = by_process_group(proc)
            pids = [p for g in t.pgids for p in groups.get(g, ())]
        out[t.alloc_id] = pids
    return out
