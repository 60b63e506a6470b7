"""Submissions of reactive allocations (spec: Autoscaling): bounds from the node range,
the scaling settings with the specification's defaults, and clear refusals."""

from __future__ import annotations

from typing import Any

import pytest
from lattice_api.validation import validate_submission
from lattice_common.errors import ValidationError
from lattice_common.types import LifecycleType, ScalingSpec


def validate(**kw: Any):  # type: ignore[no-untyped-def]
    body = {"entrypoint": "serve.sh", "tenant": "physics", "vcluster": "svc", **kw}
    return validate_submission(body, user="alice", tenants=["physics"], vclusters=["svc"])


def refused(**kw: Any) -> ValidationError:
    with pytest.raises(ValidationError) as ei:
        validate(**kw)
    assert ei.value.hint
    return ei.value


def test_reactive_with_bounds_gets_the_specs_defaults() -> None:
    spec = validate(lifecycle="reactive", min_nodes=2, max_nodes=4, nodes=1)
    assert (spec.lifecycle, spec.min_nodes, spec.nodes) == (LifecycleType.REACTIVE, 2, 4)
    assert spec.walltime_seconds == 0  # unbounded in time, like a service
    assert spec.scaling == ScalingSpec()
    assert (spec.scaling.evaluation_interval, spec.scaling.scale_up_window) == (60, 120)
    assert (spec.scaling.scale_down_window, spec.scaling.cooldown) == (300, 180)
    assert spec.scaling.scale_down_threshold == 0.5


def test_settings_as_numbers_or_durations() -> None:
    spec = validate(
        lifecycle="reactive",
        nodes={"min": 1, "max": 8},
        scaling={
            "metric": 'queue_depth{job="inference"}',
            "target": "100",
            "evaluation_interval": 30,
            "scale_up_window": "90s",
            "scale_down_window": "10m",
            "scale_down_threshold": 0.25,
            "cooldown_period": "5m",
        },
    )
    assert spec.scaling == ScalingSpec(
        metric='queue_depth{job="inference"}',
        target=100.0,
        evaluation_interval=30.0,
        scale_up_window=90.0,
        scale_down_window=600.0,
        scale_down_threshold=0.25,
        cooldown=300.0,
    )


@pytest.mark.parametrize(
    ("body", "words"),
    [
        ({"lifecycle": "reactive", "nodes": 4}, "1 <= min_nodes < max_nodes"),
        ({"lifecycle": "reactive", "min_nodes": 3, "max_nodes": 3}, "1 <= min_nodes < max_nodes"),
        ({"walltime": "1h", "scaling": {"target": 0.8}}, "only for reactive allocations"),
        (
            {"lifecycle": "reactive", "min_nodes": 1, "max_nodes": 2, "scaling": {"target": 0}},
            "greater than zero",
        ),
        (
            {"lifecycle": "reactive", "min_nodes": 1, "max_nodes": 2, "scaling": {"target": "x"}},
            "must be a number",
        ),
        (
            {
                "lifecycle": "reactive",
                "min_nodes": 1,
                "max_nodes": 2,
                "scaling": {"scale_down_threshold": 1.5},
            },
            "between 0 and 1",
        ),
        (
            {
                "lifecycle": "reactive",
                "min_nodes": 1,
                "max_nodes": 2,
                "scaling": {"evaluation_interval": 0},
            },
            "evaluation_interval must be between 1 s",
        ),
        (
            {"lifecycle": "reactive", "min_nodes": 1, "max_nodes": 2, "scaling": {"cooldwn": 1}},
            "unknown scaling setting 'cooldwn'",
        ),
        (
            {
                "lifecycle": "reactive",
                "min_nodes": 1,
                "max_nodes": 2,
                "scaling": {"metric": 'x{a="b"} or vector(1)'},
            },
            "invalid scaling metric",
        ),
        (
            {
                "lifecycle": "reactive",
                "min_nodes": 1,
                "max_nodes": 2,
                "scaling": {"metric": "rate(x[5m])"},
            },
            "invalid scaling metric",
        ),
    ],
)
def test_bad_settings_are_refused_with_a_hint(body: dict[str, Any], words: str) -> None:
    assert words in refused(**body).message
