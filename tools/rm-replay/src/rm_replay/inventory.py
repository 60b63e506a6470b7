"""The simulated cluster: node inventory YAML -> ``lattice_common.types.Node`` records.

Format (every key but ``node_classes`` / ``count`` is optional)::

    name: alps-mini
    node_classes:                  # also accepted: "nodes" or "classes"
      - name: gh200                # node ids: <prefix or name>-<index>, zero-padded
        count: 512
        gpu_type: GH200
        gpus: 4                    # GPUs per node (alias gpu_count)
        cpu_cores: 288
        memory_gb: 480
        features: [nvme_scratch]   # node features, e.g. single_numa, cxl_memory_gb=2048
        groups: 4                  # dragonfly groups: a count (new groups after the
                                   # previous class's) or a list of group ids;
                                   # or group_size: 128 (nodes per new group)
        conformance: {gh-a: 0.9, gh-b: 0.1}   # fingerprint -> share (or a list of
                                   # fingerprints with equal shares, or one string)
        vcluster: ""               # home pool; "" = shared by every vCluster
        state: Ready               # e.g. Down for nodes out of service
      - name: cpu
        count: 256
        memory_gb: 256
    tenants:                       # optional; tenants only in the trace share the rest
      physics: {fair_share_target: 0.4, burst_allowance: 1.5, max_nodes: 300}
    vclusters:                     # optional; scheduler settings per vCluster
      interactive: {scheduler_type: interactive-fifo}
      hpc-batch: {backfill_depth: 20, allow_borrowing: true}

Nodes of a class are spread over its groups contiguously in id order (group ``g`` gets
nodes ``[i*count/G, (i+1)*count/G)``); fingerprints are interleaved over the class by
a golden-ratio sequence, so every group gets roughly the class's mix. Building is
deterministic.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml
from lattice_common.types import Node, NodeCapabilities, NodeState, SchedulerType

from rm_replay.model import Inventory, InventoryError, NodeClass, TenantSpec, VClusterSpec

__all__ = [
    "build_nodes",
    "inventory_from_mapping",
    "inventory_summary",
    "load_inventory",
]

_HINT = "See the inventory format in tools/rm-replay/README.md (node_classes: a list of classes with count, gpu_type, gpus, groups, conformance)."
_CLASS_KEYS = {
    "name",
    "count",
    "gpu_type",
    "gpus",
    "gpu_count",
    "cpu_cores",
    "memory_gb",
    "features",
    "groups",
    "group_size",
    "conformance",
    "conformance_groups",
    "vcluster",
    "home_vcluster",
    "state",
    "prefix",
}
_TENANT_KEYS = {
    "fair_share_target",
    "fair_share",
    "burst_allowance",
    "max_nodes",
    "max_concurrent_allocations",
    "gpu_hours_budget",
    "node_hours_budget",
}
_VC_KEYS = {"scheduler_type", "scheduler", "backfill_depth", "allow_borrowing"}
_GOLDEN = 0.6180339887498949
MAX_INVENTORY_NODES = 1_000_000


def _int(v: Any, what: str, lo: int = 0, hi: int = 10**9) -> int:
    if isinstance(v, bool) or not isinstance(v, int):
        raise InventoryError(f"{what} must be an integer, got {v!r}", hint=_HINT)
    if not lo <= v <= hi:
        raise InventoryError(f"{what} must be between {lo} and {hi}, got {v}", hint=_HINT)
    return v


def _float(v: Any, what: str, lo: float = 0.0, hi: float = math.inf) -> float:
    if isinstance(v, bool) or not isinstance(v, int | float):
        raise InventoryError(f"{what} must be a number, got {v!r}", hint=_HINT)
    f = float(v)
    if not (math.isfinite(f) and lo <= f <= hi):
        raise InventoryError(f"{what} must be between {lo:g} and {hi:g}, got {v!r}", hint=_HINT)
    return f


def _opt_int(v: Any, what: str) -> int | None:
    return None if v is None else _int(v, what)


def _opt_float(v: Any, what: str) -> float | None:
    return None if v is None else _float(v, what)


def _name(v: Any, what: str) -> str:
    if isinstance(v, bool) or not isinstance(v, str | int):
        raise InventoryError(f"{what} must be a string, got {v!r}", hint=_HINT)
    s = str(v).strip()
    if not s:
        raise InventoryError(f"{what} must not be empty", hint=_HINT)
    return s


def _conformance(v: Any, cname: str) -> tuple[tuple[str, float], ...]:
    if v is None:
        return ()
    if isinstance(v, str):
        return ((v, 1.0),)
    if isinstance(v, list):
        names = [_name(x, f"class {cname!r} conformance fingerprint") for x in v]
        return tuple((n, 1.0) for n in names)
    if isinstance(v, dict):
        out = tuple(
            (_name(k, f"class {cname!r} conformance fingerprint"), _float(s, f"share of {k!r}"))
            for k, s in v.items()
        )
        if out and sum(s for _, s in out) <= 0:
            raise InventoryError(f"class {cname!r}: conformance shares add up to 0", hint=_HINT)
        return out
    raise InventoryError(
        f"class {cname!r}: conformance must be a name, a list of names or name: share",
        hint=_HINT,
    )


def _node_class(raw: Any, index: int, next_group: int) -> tuple[NodeClass, int]:
    if not isinstance(raw, dict):
        raise InventoryError(f"node class #{index + 1} must be a mapping", hint=_HINT)
    unknown = sorted(str(k) for k in raw if k not in _CLASS_KEYS)
    cname = _name(raw.get("name", f"class{index}"), f"node class #{index + 1} name")
    if unknown:
        raise InventoryError(
            f"node class {cname!r}: unknown key(s) {', '.join(unknown)}",
            hint=f"Known keys: {', '.join(sorted(_CLASS_KEYS))}.",
        )
    if "count" not in raw:
        raise InventoryError(f"node class {cname!r} has no count", hint=_HINT)
    count = _int(raw["count"], f"class {cname!r} count", 1, MAX_INVENTORY_NODES)
    groups_raw = raw.get("groups")
    if groups_raw is not None and "group_size" in raw:
        raise InventoryError(f"class {cname!r}: give groups or group_size, not both", hint=_HINT)
    if "group_size" in raw:
        size = _int(raw["group_size"], f"class {cname!r} group_size", 1)
        n = math.ceil(count / size)
        groups = tuple(range(next_group, next_group + n))
    elif groups_raw is None:
        groups = (next_group,)
    elif isinstance(groups_raw, int) and not isinstance(groups_raw, bool):
        n = _int(groups_raw, f"class {cname!r} groups", 1, count)
        groups = tuple(range(next_group, next_group + n))
    elif isinstance(groups_raw, list) and groups_raw:
        groups = tuple(_int(g, f"class {cname!r} group id", 0, 10**6) for g in groups_raw)
        if len(set(groups)) != len(groups):
            raise InventoryError(f"class {cname!r}: a group id is listed twice", hint=_HINT)
    else:
        raise InventoryError(
            f"class {cname!r}: groups must be a count or a list of group ids", hint=_HINT
        )
    features = raw.get("features") or []
    if isinstance(features, str):
        features = [features]
    if not isinstance(features, list) or not all(isinstance(f, str) for f in features):
        raise InventoryError(f"class {cname!r}: features must be a list of strings", hint=_HINT)
    state = str(raw.get("state", "Ready"))
    try:
        NodeState.parse(state)
    except ValueError:
        raise InventoryError(
            f"class {cname!r}: unknown node state {state!r}",
            hint=f"One of: {', '.join(s.value for s in NodeState)}.",
        ) from None
    gpus = raw.get("gpus", raw.get("gpu_count", 0))
    conf = raw.get("conformance", raw.get("conformance_groups"))
    vc = raw.get("vcluster", raw.get("home_vcluster", "")) or ""
    cls = NodeClass(
        name=cname,
        count=count,
        gpu_type=str(raw.get("gpu_type") or ""),
        gpus=_int(gpus, f"class {cname!r} gpus", 0, 4096),
        cpu_cores=_int(raw.get("cpu_cores", 0), f"class {cname!r} cpu_cores", 0, 1 << 20),
        memory_gb=_int(raw.get("memory_gb", 0), f"class {cname!r} memory_gb", 0, 1 << 30),
        features=tuple(f.strip() for f in features if f.strip()),
        groups=groups,
        conformance=_conformance(conf, cname),
        vcluster=str(vc),
        state=state,
        prefix=str(raw.get("prefix") or cname),
    )
    return cls, max(next_group, max(groups) + 1)


def inventory_from_mapping(data: Any) -> Inventory:
    """An :class:`Inventory` from parsed YAML (see the module docstring)."""
    if not isinstance(data, dict):
        raise InventoryError("the inventory must be a YAML mapping", hint=_HINT)
    classes_raw = data.get("node_classes", data.get("nodes", data.get("classes")))
    if not isinstance(classes_raw, list) or not classes_raw:
        raise InventoryError("the inventory has no node_classes list", hint=_HINT)
    classes: list[NodeClass] = []
    next_group = 0
    for i, raw in enumerate(classes_raw):
        cls, next_group = _node_class(raw, i, next_group)
        classes.append(cls)
    names = [c.name for c in classes]
    if len(set(names)) != len(names):
        raise InventoryError("two node classes have the same name", hint=_HINT)
    prefixes = [c.prefix for c in classes]
    if len(set(prefixes)) != len(prefixes):
        raise InventoryError("two node classes have the same id prefix", hint=_HINT)
    total = sum(c.count for c in classes)
    if total > MAX_INVENTORY_NODES:
        raise InventoryError(f"{total} nodes is more than {MAX_INVENTORY_NODES}", hint=_HINT)
    tenants: list[TenantSpec] = []
    traw = data.get("tenants") or {}
    if not isinstance(traw, dict):
        raise InventoryError("tenants must be a mapping of name -> settings", hint=_HINT)
    for name, t in traw.items():
        t = t or {}
        if not isinstance(t, dict) or any(k not in _TENANT_KEYS for k in t):
            raise InventoryError(
                f"tenant {name!r}: settings must be a mapping with keys from "
                f"{', '.join(sorted(_TENANT_KEYS))}",
                hint=_HINT,
            )
        share = t.get("fair_share_target", t.get("fair_share"))
        tenants.append(
            TenantSpec(
                name=_name(name, "tenant name"),
                fair_share_target=None
                if share is None
                else _float(share, "fair_share_target", 0, 1),
                burst_allowance=_float(t.get("burst_allowance", 0.0), "burst_allowance", 0, 100),
                max_nodes=_opt_int(t.get("max_nodes"), f"tenant {name!r} max_nodes"),
                max_concurrent_allocations=_opt_int(
                    t.get("max_concurrent_allocations"),
                    f"tenant {name!r} max_concurrent_allocations",
                ),
                gpu_hours_budget=_opt_float(t.get("gpu_hours_budget"), "gpu_hours_budget"),
                node_hours_budget=_opt_float(t.get("node_hours_budget"), "node_hours_budget"),
            )
        )
    vclusters: list[VClusterSpec] = []
    vraw = data.get("vclusters") or {}
    if not isinstance(vraw, dict):
        raise InventoryError("vclusters must be a mapping of name -> settings", hint=_HINT)
    for name, v in vraw.items():
        v = v or {}
        if not isinstance(v, dict) or any(k not in _VC_KEYS for k in v):
            raise InventoryError(
                f"vCluster {name!r}: settings must be a mapping with keys from "
                f"{', '.join(sorted(_VC_KEYS))}",
                hint=_HINT,
            )
        st = str(v.get("scheduler_type", v.get("scheduler", "hpc-backfill")))
        try:
            SchedulerType(st)
        except ValueError:
            raise InventoryError(
                f"vCluster {name!r}: unknown scheduler_type {st!r}",
                hint=f"One of: {', '.join(s.value for s in SchedulerType)}.",
            ) from None
        allow = v.get("allow_borrowing", True)
        if not isinstance(allow, bool):
            raise InventoryError(f"vCluster {name!r}: allow_borrowing must be true or false")
        depth = v.get("backfill_depth")
        vclusters.append(
            VClusterSpec(
                name=_name(name, "vCluster name"),
                scheduler_type=st,
                backfill_depth=None if depth is None else _int(depth, "backfill_depth", 0, 10_000),
                allow_borrowing=allow,
            )
        )
    return Inventory(
        name=str(data.get("name") or ""),
        node_classes=tuple(classes),
        tenants=tuple(tenants),
        vclusters=tuple(vclusters),
    )


def load_inventory(path: str | Path) -> Inventory:
    """Read and validate an inventory YAML file."""
    p = Path(path)
    try:
        data = yaml.safe_load(p.read_text(encoding="utf-8"))
    except yaml.YAMLError as e:
        raise InventoryError(
            f"not valid YAML: {e}".replace("\n", " "), hint=_HINT, path=str(p)
        ) from None
    except UnicodeDecodeError:
        raise InventoryError("not UTF-8 text", hint=_HINT, path=str(p)) from None
    try:
        inv = inventory_from_mapping(data)
    except InventoryError as e:
        raise e.at(path=str(p)) from None
    if not inv.name:
        inv = Inventory(
            name=p.stem,
            node_classes=inv.node_classes,
            tenants=inv.tenants,
            vclusters=inv.vclusters,
        )
    return inv


def _fingerprints(cls: NodeClass) -> list[str]:
    """Each node's conformance fingerprint (golden-ratio interleaving of the shares)."""
    conf = cls.conformance or ((f"{cls.name}-conf", 1.0),)
    total = sum(s for _, s in conf)
    bounds: list[tuple[float, str]] = []
    acc = 0.0
    for name, share in conf:
        acc += share / total
        bounds.append((acc, name))
    out: list[str] = []
    for i in range(cls.count):
        x = (i * _GOLDEN) % 1.0
        for b, name in bounds:
            if x < b:
                out.append(name)
                break
        else:
            out.append(bounds[-1][1])
    return out


def build_nodes(inventory: Inventory) -> dict[str, Node]:
    """The inventory's nodes, keyed (and ordered) by id."""
    nodes: list[Node] = []
    for cls in inventory.node_classes:
        width = len(str(cls.count - 1))
        fps = _fingerprints(cls)
        groups = cls.groups
        state = NodeState.parse(cls.state)
        for i in range(cls.count):
            g = groups[i * len(groups) // cls.count]
            nid = f"{cls.prefix}-{i:0{width}d}"
            nodes.append(
                Node(
                    id=nid,
                    hostname=nid,
                    state=state,
                    capabilities=NodeCapabilities(
                        cpu_cores=cls.cpu_cores,
                        memory_gb=cls.memory_gb,
                        gpu_type=cls.gpu_type,
                        gpu_count=cls.gpus,
                        features=list(cls.features),
                    ),
                    group=g,
                    conformance_group=fps[i],
                    home_vcluster=cls.vcluster,
                )
            )
    nodes.sort(key=lambda n: n.id)
    out = {n.id: n for n in nodes}
    if len(out) != len(nodes):
        raise InventoryError("two nodes got the same id; give the classes distinct prefixes")
    return out


def inventory_summary(
    inventory: Inventory, nodes: Mapping[str, Node] | None = None
) -> dict[str, Any]:
    """A JSON-ready description for reports: totals and one line per class."""
    nodes = build_nodes(inventory) if nodes is None else nodes
    groups = sorted({n.group for n in nodes.values()})
    confs = sorted({n.conformance_group for n in nodes.values()})
    return {
        "name": inventory.name,
        "nodes": len(nodes),
        "gpus": sum(n.capabilities.gpu_count for n in nodes.values()),
        "groups": len(groups),
        "conformance_groups": len(confs),
        "classes": [
            {
                "name": c.name,
                "count": c.count,
                "gpu_type": c.gpu_type,
                "gpus": c.gpus,
                "cpu_cores": c.cpu_cores,
                "memory_gb": c.memory_gb,
                "features": list(c.features),
                "groups": list(c.groups),
                "conformance": {k: v for k, v in c.conformance},
                "vcluster": c.vcluster,
                "state": c.state,
            }
            for c in inventory.node_classes
        ],
    }
