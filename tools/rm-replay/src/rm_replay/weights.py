"""Weight profiles per vCluster, in the Performance Tuning Guide's YAML shape::

    # profiles/baseline.yaml
    hpc-batch:
      priority: 0.20
      wait_time: 0.25
      fair_share: 0.25
      topology: 0.15
      data_readiness: 0.10
      backlog: 0.05
      energy: 0.00
      checkpoint: 0.00
      conformance: 0.10

Keys are the ``CostWeights`` field names (``checkpoint_efficiency`` for w8), their
aliases in ``lattice_common.types.WEIGHT_ALIASES`` (the guide's ``checkpoint``, as
above, and ``data_ready``; dashes for underscores), read by
``lattice_scheduler.profiles.weights_from_mapping``, or ``w1`` .. ``w9``. Written
weights (``sim_config``, generated profiles) use the field names. Also accepted:

* a profile name instead of a mapping (``ml-training: ml-training``), or a
  ``profile:`` key inside one (its values are the base; the other keys override);
* keys left out keep the balanced baseline (``CostWeights()``), or the profile's;
* a ``"*"`` section: the weights of every vCluster the file does not name;
* a file whose top level is weights (no vCluster): those weights for every vCluster
  (stored under ``"*"``);
* the guide as rendered without indentation (``hpc-batch:`` followed by unindented
  ``priority: 0.20`` lines): each empty ``name:`` opens that vCluster's section.

vClusters the file does not name get ``"*"`` when present, else the named profile of
their name (``hpc-batch``, ``ml-training``, ``service``, ``sensitive``,
``interactive``), else the balanced baseline: :func:`weights_for`.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml
from lattice_common.types import CostWeights
from lattice_scheduler.profiles import (
    SCHEDULER_TYPE_PROFILES,
    WEIGHT_KEYS,
    WEIGHT_NAMES,
    WEIGHT_PROFILES,
    profile_for_scheduler_type,
    weights_as_mapping,
    weights_from_mapping,
)

from rm_replay.model import WeightsError

__all__ = ["ANY_VCLUSTER", "W_KEYS", "load_weights", "weights_for", "weights_from_yaml_data"]

ANY_VCLUSTER = "*"
W_KEYS = {f"w{i}": name for i, name in enumerate(WEIGHT_NAMES, start=1)}
_HINT = (
    "A weights file maps vCluster names to weights, e.g. 'hpc-batch: {priority: 0.2, "
    "wait_time: 0.25, ...}'. Weight keys: "
    + ", ".join(sorted(set(WEIGHT_KEYS) | set(W_KEYS)))
    + "."
)


def _is_weight_key(k: Any) -> bool:
    key = str(k).strip().lower().replace("-", "_")
    return key in WEIGHT_KEYS or key in W_KEYS


def _profile(name: Any, vc: str) -> CostWeights:
    key = str(name).strip().lower()
    if key not in WEIGHT_PROFILES and key not in SCHEDULER_TYPE_PROFILES and key != "baseline":
        raise WeightsError(
            f"vCluster {vc!r}: unknown profile {name!r}",
            hint=f"Profiles: {', '.join(sorted(WEIGHT_PROFILES))}, baseline.",
        )
    return profile_for_scheduler_type(key)


def _section(vc: str, raw: Any) -> CostWeights:
    if isinstance(raw, str):
        return _profile(raw, vc)
    if raw is None:
        raise WeightsError(f"vCluster {vc!r} has no weights", hint=_HINT)
    if not isinstance(raw, dict):
        raise WeightsError(f"vCluster {vc!r}: weights must be a mapping", hint=_HINT)
    base = CostWeights()
    values: dict[str, Any] = {}
    for k, v in raw.items():
        key = str(k).strip().lower().replace("-", "_")
        if key == "profile":
            base = _profile(v, vc)
            continue
        if isinstance(v, bool) or not isinstance(v, int | float):
            raise WeightsError(
                f"vCluster {vc!r}: weight {k!r} must be a number, got {v!r}", hint=_HINT
            )
        values[W_KEYS.get(key, key)] = v
    try:
        return weights_from_mapping(values, base=base)
    except (ValueError, OverflowError) as e:
        raise WeightsError(f"vCluster {vc!r}: {e}", hint=_HINT) from None


def weights_from_yaml_data(data: Any) -> dict[str, CostWeights]:
    """vCluster -> CostWeights from parsed YAML (see the module docstring)."""
    if not isinstance(data, dict) or not data:
        raise WeightsError("the weights file must be a non-empty mapping", hint=_HINT)
    keys = list(data)
    if all(_is_weight_key(k) or str(k).strip().lower() == "profile" for k in keys):
        return {ANY_VCLUSTER: _section(ANY_VCLUSTER, data)}
    # the guide rendered flat: "hpc-batch:" (null) then its weight keys unindented
    flat = any(data[k] is None and not _is_weight_key(k) for k in keys) and any(
        _is_weight_key(k) for k in keys
    )
    out: dict[str, CostWeights] = {}
    if flat:
        sections: dict[str, dict[str, Any]] = {}
        current: str | None = None
        for k in keys:
            if _is_weight_key(k) or str(k).strip().lower() == "profile":
                if current is None:
                    raise WeightsError(f"weight {k!r} before any vCluster name", hint=_HINT)
                sections[current][k] = data[k]
            elif data[k] is None:
                current = str(k)
                sections[current] = {}
            else:
                current = None
                out[str(k)] = _section(str(k), data[k])
        for vc, values in sections.items():
            out[vc] = _section(vc, values)
        return out
    for k in keys:
        if _is_weight_key(k):
            raise WeightsError(
                f"weight {k!r} at the top level next to vCluster sections", hint=_HINT
            )
        vc = str(k).strip()
        if not vc:
            raise WeightsError("empty vCluster name", hint=_HINT)
        out[vc] = _section(vc, data[k])
    return out


def load_weights(path: str | Path) -> dict[str, CostWeights]:
    """vCluster -> CostWeights from a weight profile YAML file."""
    p = Path(path)
    try:
        data = yaml.safe_load(p.read_text(encoding="utf-8"))
    except yaml.YAMLError as e:
        raise WeightsError(
            f"not valid YAML: {e}".replace("\n", " "), hint=_HINT, path=str(p)
        ) from None
    except UnicodeDecodeError:
        raise WeightsError("not UTF-8 text", hint=_HINT, path=str(p)) from None
    try:
        return weights_from_yaml_data(data)
    except WeightsError as e:
        raise e.at(path=str(p)) from None


def weights_for(vcluster: str, weights: Mapping[str, CostWeights]) -> CostWeights:
    """The weights a vCluster replays with (see the module docstring)."""
    w = weights.get(vcluster)
    if w is not None:
        return w
    w = weights.get(ANY_VCLUSTER)
    if w is not None:
        return w
    return profile_for_scheduler_type(vcluster)


def describe(weights: Mapping[str, CostWeights]) -> dict[str, dict[str, float]]:
    """Each profile as a weights mapping (for ``sim_config``)."""
    return {vc: weights_as_mapping(w) for vc, w in sorted(weights.items())}
