"""RM-Replay inputs: JSON-lines traces, node inventories and weight profiles."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from lattice_common.types import CostWeights, NodeState
from lattice_scheduler.profiles import WEIGHT_PROFILES
from rm_replay.inventory import (
    build_nodes,
    inventory_from_mapping,
    inventory_summary,
    load_inventory,
)
from rm_replay.model import (
    CancelEvent,
    CompleteEvent,
    InventoryError,
    ReplayInputError,
    SubmitEvent,
    TraceError,
    WeightsError,
)
from rm_replay.trace import (
    dump_trace_line,
    load_trace,
    parse_duration_value,
    parse_trace_line,
    parse_ts,
    read_trace,
    write_trace,
)
from rm_replay.weights import ANY_VCLUSTER, load_weights, weights_for, weights_from_yaml_data

T0 = 1_772_323_200.0  # 2026-03-01T00:00:00Z

# --------------------------------------------------------------------------- trace lines


def test_the_tuning_guides_example_lines() -> None:
    sub = parse_trace_line(
        '{"ts": "2026-03-01T00:00:01Z", "type": "submit", "alloc": {"nodes": 64, '
        '"gpu_type": "GH200", "walltime": "72h", "tenant": "physics", "priority": 4}}',
        1,
    )
    assert sub == SubmitEvent(
        t=T0 + 1,
        id="line-1",
        tenant="physics",
        nodes=64,
        walltime=72 * 3600.0,
        gpu_type="GH200",
        preemption_class=4,
    )
    done = parse_trace_line(
        '{"ts": "2026-03-01T00:00:05Z", "type": "complete", "alloc_id": "abc-123", '
        '"duration": "68h", "exit": 0}',
        2,
    )
    assert done == CompleteEvent(t=T0 + 5, id="abc-123", duration=68 * 3600.0, exit=0)


def test_submit_fields_and_aliases() -> None:
    ev = parse_trace_line(
        '{"ts": 100, "type": "submit", "alloc_id": "j1", "alloc": {"tenant": "bio", '
        '"user": "ann", "vcluster": "ml-training", "gpus": 4, "memory_gb": 512, '
        '"features": ["nvme_scratch", "require_conformance"], "topology": "tight", '
        '"runtime": "1.5h", "exit": 3, "name": "train"}}'
    )
    assert isinstance(ev, SubmitEvent)
    assert (ev.id, ev.t, ev.user, ev.vcluster, ev.gpus_per_node, ev.memory_gb) == (
        "j1",
        100.0,
        "ann",
        "ml-training",
        4,
        512,
    )
    assert ev.features == ("nvme_scratch", "require_conformance")
    assert (ev.topology, ev.runtime, ev.exit, ev.name) == ("tight", 5400.0, 3, "train")
    assert ev.preemption_class == 5  # default
    nested = parse_trace_line(
        '{"ts": 0, "type": "submit", "alloc": {"id": "x", "tenant": "t", '
        '"constraints": {"gpu_type": "A100", "gpu_count": 8, "features": "a,b"}}}'
    )
    assert isinstance(nested, SubmitEvent)
    assert (nested.gpu_type, nested.gpus_per_node, nested.features) == ("A100", 8, ("a", "b"))


def test_sensitive_jobs_are_class_10() -> None:
    ev = parse_trace_line(
        '{"ts": 0, "type": "submit", "alloc": {"id": "s", "tenant": "hospital", "sensitive": true, "priority": 2}}'
    )
    assert isinstance(ev, SubmitEvent)
    assert ev.sensitive and ev.preemption_class == 10


@pytest.mark.parametrize(
    ("text", "seconds"),
    [
        (90, 90.0),
        (1.5, 1.5),
        ("90s", 90.0),
        ("30m", 1800.0),
        ("72h", 259200.0),
        ("1d", 86400.0),
        ("1.5h", 5400.0),
        ("01:02:03", 3723.0),
        ("1-00:00:00", 86400.0),
        ("0", 0.0),
        ("0s", 0.0),
    ],
)
def test_durations(text: object, seconds: float) -> None:
    assert parse_duration_value(text) == seconds


@pytest.mark.parametrize("bad", ["soon", "-5m", "1e400", True, None, [], -1, math.inf, "99999999d"])
def test_bad_durations(bad: object) -> None:
    with pytest.raises(TraceError):
        parse_duration_value(bad)


def test_timestamps() -> None:
    assert parse_ts("2026-03-01T00:00:00Z") == T0
    assert parse_ts("2026-03-01T01:00:00+01:00") == T0
    assert parse_ts("2026-03-01T00:00:00") == T0  # no offset: UTC
    assert parse_ts(12.5) == 12.5
    for bad in ("yesterday", True, None, "", 1e300, math.nan):
        with pytest.raises(TraceError):
            parse_ts(bad)


def test_blank_comment_and_meta_lines_are_skipped() -> None:
    assert parse_trace_line("") is None
    assert parse_trace_line("   \n") is None
    assert parse_trace_line("# a comment") is None
    assert parse_trace_line('{"type": "meta", "name": "x"}') is None


@pytest.mark.parametrize(
    ("line", "needle"),
    [
        ("{not json", "not valid JSON"),
        ("[1, 2]", "JSON object"),
        ('{"ts": 0, "type": "kill", "alloc_id": "a"}', "unknown event type"),
        ('{"ts": 0, "type": "cancel"}', '"alloc_id"'),
        ('{"ts": 0, "type": "cancel", "alloc_id": ""}', "alloc_id must not be empty"),
        ('{"type": "cancel", "alloc_id": "a"}', 'missing "ts"'),
        ('{"type": "submit", "alloc": {"tenant": "t"}}', 'missing "ts"'),
        ('{"ts": 0, "type": "submit", "alloc": {"nodes": 2}}', "tenant"),
        ('{"ts": 0, "type": "submit", "alloc": {"tenant": "t", "nodes": 0}}', "nodes"),
        ('{"ts": 0, "type": "submit", "alloc": {"tenant": "t", "nodes": "many"}}', "nodes"),
        ('{"ts": 0, "type": "submit", "alloc": {"tenant": "t", "priority": 11}}', "priority"),
        ('{"ts": 0, "type": "submit", "alloc": {"tenant": "t", "walltime": "soon"}}', "walltime"),
        ('{"ts": 0, "type": "submit", "alloc": {"tenant": "t", "topology": "ring"}}', "topology"),
        ('{"ts": 0, "type": "submit", "alloc": "x"}', "alloc"),
        ('{"ts": 0, "type": "complete", "alloc_id": "a"}', "duration"),
        ('{"ts": 0, "type": "complete", "duration": 5}', "alloc_id"),
    ],
)
def test_malformed_lines_name_the_problem_and_the_line(line: str, needle: str) -> None:
    with pytest.raises(TraceError) as e:
        parse_trace_line(line, 7)
    assert needle in str(e.value)
    assert e.value.line == 7
    assert "line 7" in str(e.value)


def test_every_trace_error_renders_a_hint() -> None:
    with pytest.raises(TraceError) as e:
        parse_trace_line('{"ts": 0, "type": "submit", "alloc": {"tenant": "t", "nodes": "x"}}', 3)
    assert "Hint:" in e.value.render()


def test_round_trip_through_the_writer(tmp_path: Path) -> None:
    events = [
        SubmitEvent(
            t=T0,
            id="a",
            tenant="t",
            nodes=2,
            walltime=7200,
            gpu_type="GH200",
            gpus_per_node=4,
            features=("x",),
            user="u",
            vcluster="hpc",
            preemption_class=3,
            runtime=3600,
            exit=1,
        ),
        SubmitEvent(
            t=T0 + 0.5, id="b", tenant="t", walltime=61, sensitive=True, preemption_class=10
        ),
        CompleteEvent(t=T0 + 99, id="b", duration=60.25, exit=0),
    ]
    path = tmp_path / "t.jsonl"
    write_trace(path, events)
    assert load_trace(path) == events
    assert '"walltime":"2h"' in dump_trace_line(events[0])


def test_load_trace_reports_the_file_and_line(tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl"
    path.write_text(
        '{"ts": 0, "type": "submit", "alloc": {"id": "a", "tenant": "t"}}\n\n'
        '{"ts": 1, "type": "submit", "alloc": {"id": "b", "tenant": "t", "nodes": -1}}\n'
    )
    with pytest.raises(TraceError) as e:
        load_trace(path)
    assert str(e.value).startswith(f"{path}:3: ")


@pytest.mark.parametrize(
    ("lines", "needle"),
    [
        (
            ['{"ts": 0, "type": "submit", "alloc": {"id": "a", "tenant": "t"}}'] * 2,
            "submitted twice",
        ),
        (
            [
                '{"ts": 0, "type": "submit", "alloc": {"id": "a", "tenant": "t"}}',
                *['{"ts": 1, "type": "complete", "alloc_id": "a", "duration": 1}'] * 2,
            ],
            "completes twice",
        ),
    ],
)
def test_inconsistent_traces(tmp_path: Path, lines: list[str], needle: str) -> None:
    path = tmp_path / "t.jsonl"
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(TraceError, match=needle):
        load_trace(path)


def test_completions_without_a_submission_are_left_out(tmp_path: Path) -> None:
    """A captured trace starts with work already running: its completions come
    without submissions. A completion may also come before its submission."""
    path = tmp_path / "t.jsonl"
    path.write_text(
        '{"ts": 0, "type": "complete", "alloc_id": "old", "duration": 5}\n'
        '{"ts": 1, "type": "complete", "alloc_id": "b", "duration": 7}\n'
        '{"ts": 0, "type": "submit", "alloc": {"id": "b", "tenant": "t"}}\n'
    )
    events, orphans = read_trace(path)
    assert orphans == ["old"]
    assert [(type(e).__name__, e.id) for e in events] == [
        ("CompleteEvent", "b"),
        ("SubmitEvent", "b"),
    ]
    assert load_trace(path) == events


def test_cancel_lines() -> None:
    assert parse_trace_line(
        '{"ts": "2026-03-01T00:10:00Z", "type": "cancel", "alloc_id": "def-456"}', 4
    ) == CancelEvent(t=T0 + 600, id="def-456")
    # the same aliases as a complete event: "id", or an "alloc" object with one
    assert parse_trace_line('{"ts": 5, "type": "cancel", "id": "x"}') == CancelEvent(t=5, id="x")
    assert parse_trace_line('{"ts": 5, "type": "cancel", "alloc": {"id": "x"}}') == CancelEvent(
        t=5, id="x"
    )


def test_a_cancel_without_alloc_id_renders_the_cancel_format(tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl"
    path.write_text(
        '{"ts": 0, "type": "submit", "alloc": {"id": "a", "tenant": "t"}}\n'
        '{"ts": 9, "type": "cancel"}\n'
    )
    with pytest.raises(TraceError) as e:
        load_trace(path)
    out = e.value.render()
    assert out.startswith(f'Error: {path}:2: cancel event has no "alloc_id"')
    assert (
        '\nHint: A cancel event names a submitted allocation: {"ts": ..., "type": "cancel"' in out
    )


def test_cancels_round_trip_through_the_writer(tmp_path: Path) -> None:
    events = [
        SubmitEvent(t=T0, id="a", tenant="t", walltime=3600),
        SubmitEvent(t=T0 + 1, id="b", tenant="t", walltime=60),
        CancelEvent(t=T0 + 30, id="a"),
        CancelEvent(t=T0 + 1.5, id="b"),  # not whole seconds: written as a number
    ]
    path = tmp_path / "t.jsonl"
    write_trace(path, events)
    assert load_trace(path) == events
    lines = path.read_text().splitlines()
    assert lines[2] == '{"ts":"2026-03-01T00:00:30Z","type":"cancel","alloc_id":"a"}'
    assert lines[3] == f'{{"ts":{T0 + 1.5},"type":"cancel","alloc_id":"b"}}'
    assert parse_trace_line(dump_trace_line(events[2])) == events[2]


@pytest.mark.parametrize(
    ("lines", "bad_line", "needle"),
    [
        (  # no submit at all
            ['{"ts": 10, "type": "cancel", "alloc_id": "ghost"}'],
            1,
            "cancel of allocation 'ghost', which the trace never submits",
        ),
        (  # a submit of another allocation
            [
                '{"ts": 0, "type": "submit", "alloc": {"id": "a", "tenant": "t"}}',
                "",
                '{"ts": 10, "type": "cancel", "alloc_id": "b"}',
            ],
            3,
            "cancel of allocation 'b', which the trace never submits",
        ),
        (  # earlier than its submission (wherever the lines are)
            [
                '{"ts": "2026-03-01T00:00:05Z", "type": "cancel", "alloc_id": "a"}',
                '{"ts": "2026-03-01T00:01:00Z", "type": "submit", '
                '"alloc": {"id": "a", "tenant": "t", "walltime": 60}}',
            ],
            1,
            "allocation 'a' is cancelled at 2026-03-01T00:00:05Z, before its submission at "
            "2026-03-01T00:01:00Z",
        ),
        (
            [
                '{"ts": 0, "type": "submit", "alloc": {"id": "a", "tenant": "t"}}',
                '{"ts": 5, "type": "cancel", "alloc_id": "a"}',
                '{"ts": 6, "type": "cancel", "alloc_id": "a"}',
            ],
            3,
            "allocation 'a' is cancelled twice",
        ),
    ],
)
def test_inconsistent_cancels_name_the_file_and_line(
    tmp_path: Path, lines: list[str], bad_line: int, needle: str
) -> None:
    path = tmp_path / "t.jsonl"
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(TraceError) as e:
        load_trace(path)
    assert str(e.value) == f"{path}:{bad_line}: {needle}"
    assert e.value.line == bad_line
    assert "\nHint: " in e.value.render()


def test_a_cancel_at_its_submit_time_and_next_to_a_complete_is_fine(tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl"
    path.write_text(
        '{"ts": 0, "type": "submit", "alloc": {"id": "a", "tenant": "t", "walltime": 60}}\n'
        '{"ts": 0, "type": "cancel", "alloc_id": "a"}\n'
        '{"ts": 1, "type": "submit", "alloc": {"id": "b", "tenant": "t"}}\n'
        '{"ts": 9, "type": "complete", "alloc_id": "b", "duration": 30}\n'
        '{"ts": 5, "type": "cancel", "alloc_id": "b"}\n'
    )
    events, orphans = read_trace(path)
    assert orphans == []
    assert [type(e).__name__ for e in events] == [
        "SubmitEvent",
        "CancelEvent",
        "SubmitEvent",
        "CompleteEvent",
        "CancelEvent",
    ]


_json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8),
    lambda c: st.lists(c, max_size=3) | st.dictionaries(st.text(max_size=8), c, max_size=4),
    max_leaves=12,
)
_keys = st.sampled_from(
    [
        "ts",
        "type",
        "alloc",
        "alloc_id",
        "id",
        "tenant",
        "nodes",
        "walltime",
        "duration",
        "exit",
        "priority",
        "gpus",
        "features",
        "runtime",
        "sensitive",
        "topology",
        "constraints",
        "x",
    ]
)
_shaped = st.fixed_dictionaries(
    {
        "ts": _json_values | st.just("2026-03-01T00:00:00Z"),
        "type": st.sampled_from(["submit", "complete", "cancel", "meta", "x"]),
    },
    optional={
        "alloc": st.dictionaries(_keys, _json_values, max_size=8),
        "alloc_id": _json_values,
        "duration": _json_values,
        "exit": _json_values,
    },
)


@settings(max_examples=300, deadline=None)
@given(
    st.one_of(
        st.text(max_size=200),
        st.binary(max_size=100),
        _json_values.map(str),
        _shaped.map(lambda d: __import__("json").dumps(d, allow_nan=True)),
    )
)
def test_fuzz_any_line_parses_or_raises_a_trace_error(line: str | bytes) -> None:
    try:
        ev = parse_trace_line(line, 1)
    except TraceError as e:
        assert isinstance(e, ValueError) and e.line == 1 and e.message
        return
    assert ev is None or isinstance(ev, SubmitEvent | CompleteEvent | CancelEvent)
    if isinstance(ev, CancelEvent):
        assert ev.id and parse_trace_line(dump_trace_line(ev)) == ev
    if isinstance(ev, SubmitEvent):
        assert ev.nodes >= 1 and 0 <= ev.preemption_class <= 10 and math.isfinite(ev.t)
        assert parse_trace_line(dump_trace_line(ev)) == ev


# --------------------------------------------------------------------------- inventory

INVENTORY = """
name: mini
node_classes:
  - name: gh
    count: 10
    gpu_type: GH200
    gpus: 4
    memory_gb: 480
    features: [nvme_scratch]
    groups: 2
    conformance: {gh-a: 0.8, gh-b: 0.2}
  - name: cpu
    count: 4
    memory_gb: 256
    groups: [7]
    vcluster: interactive
    state: Down
tenants:
  physics: {fair_share_target: 0.6, max_nodes: 8}
vclusters:
  interactive: {scheduler_type: interactive-fifo}
  hpc: {backfill_depth: 3, allow_borrowing: false}
"""


def test_inventory_yaml(tmp_path: Path) -> None:
    path = tmp_path / "inv.yaml"
    path.write_text(INVENTORY)
    inv = load_inventory(path)
    nodes = build_nodes(inv)
    assert len(nodes) == 14
    gh = [n for n in nodes.values() if n.id.startswith("gh-")]
    assert [n.id for n in gh][:3] == ["gh-0", "gh-1", "gh-2"]
    assert {n.group for n in gh} == {0, 1} and sum(n.group == 0 for n in gh) == 5
    assert all(n.capabilities.gpu_type == "GH200" and n.capabilities.gpu_count == 4 for n in gh)
    confs = [n.conformance_group for n in gh]
    assert confs.count("gh-a") == 8 and confs.count("gh-b") == 2
    cpu = [n for n in nodes.values() if n.id.startswith("cpu-")]
    assert {(n.group, n.home_vcluster, n.state) for n in cpu} == {
        (7, "interactive", NodeState.DOWN)
    }
    assert {t.name: t.max_nodes for t in inv.tenants} == {"physics": 8}
    vcs = {v.name: v for v in inv.vclusters}
    assert vcs["interactive"].scheduler_type == "interactive-fifo"
    assert (vcs["hpc"].backfill_depth, vcs["hpc"].allow_borrowing) == (3, False)
    s = inventory_summary(inv)
    assert (s["nodes"], s["gpus"], s["groups"], s["conformance_groups"]) == (14, 40, 3, 3)
    assert build_nodes(inv) == nodes  # deterministic


def test_group_size_and_defaults() -> None:
    inv = inventory_from_mapping(
        {"nodes": [{"name": "a", "count": 300, "group_size": 128}, {"name": "b", "count": 2}]}
    )
    nodes = build_nodes(inv)
    assert sorted({n.group for n in nodes.values() if n.id.startswith("a-")}) == [0, 1, 2]
    assert {n.group for n in nodes.values() if n.id.startswith("b-")} == {3}
    assert nodes["a-000"].id == "a-000" and nodes["b-1"].conformance_group == "b-conf"


@pytest.mark.parametrize(
    ("data", "needle"),
    [
        ([], "mapping"),
        ({"name": "x"}, "node_classes"),
        ({"node_classes": [{"name": "a"}]}, "no count"),
        ({"node_classes": [{"name": "a", "count": 0}]}, "count"),
        ({"node_classes": [{"name": "a", "count": 2, "gpus": "four"}]}, "gpus"),
        ({"node_classes": [{"name": "a", "count": 2, "colour": "red"}]}, "unknown key"),
        ({"node_classes": [{"name": "a", "count": 2, "state": "Sleepy"}]}, "node state"),
        ({"node_classes": [{"name": "a", "count": 2, "groups": "x"}]}, "groups"),
        ({"node_classes": [{"name": "a", "count": 2}, {"name": "a", "count": 1}]}, "same name"),
        ({"node_classes": [{"name": "a", "count": 2}], "tenants": {"t": {"share": 1}}}, "tenant"),
        (
            {
                "node_classes": [{"name": "a", "count": 2}],
                "vclusters": {"v": {"scheduler_type": "x"}},
            },
            "scheduler_type",
        ),
    ],
)
def test_bad_inventories(data: object, needle: str) -> None:
    with pytest.raises(InventoryError, match=needle) as e:
        inventory_from_mapping(data)
    assert isinstance(e.value, ReplayInputError) and e.value.hint


def test_bad_inventory_yaml_names_the_file(tmp_path: Path) -> None:
    path = tmp_path / "inv.yaml"
    path.write_text("node_classes: [\n")
    with pytest.raises(InventoryError) as e:
        load_inventory(path)
    assert str(path) in str(e.value) and "YAML" in str(e.value)


# --------------------------------------------------------------------------- weights


def test_weights_in_the_tuning_guide_shape(tmp_path: Path) -> None:
    path = tmp_path / "baseline.yaml"
    path.write_text(
        "hpc-batch:\n  priority: 0.20\n  wait_time: 0.25\n  fair_share: 0.25\n  topology: 0.15\n"
        "  data_readiness: 0.10\n  backlog: 0.05\n  energy: 0.00\n  checkpoint: 0.00\n"
        "  conformance: 0.10\n"
    )
    w = load_weights(path)
    assert w == {
        "hpc-batch": CostWeights(
            priority=0.2,
            wait_time=0.25,
            fair_share=0.25,
            topology=0.15,
            data_readiness=0.1,
            backlog=0.05,
            energy=0.0,
            checkpoint_efficiency=0.0,
            conformance=0.1,
        )
    }


def test_weights_as_rendered_flat_in_the_guide() -> None:
    flat = {"hpc-batch": None, "priority": 0.15, "fair_share": 0.35, "checkpoint": 0.0}
    w = weights_from_yaml_data(flat)["hpc-batch"]
    assert (w.priority, w.fair_share, w.checkpoint_efficiency) == (0.15, 0.35, 0.0)
    assert w.wait_time == CostWeights().wait_time


def test_w_keys_profiles_and_fallbacks() -> None:
    w = weights_from_yaml_data(
        {
            "a": {"w1": 0.5, "w8": 0.25, "w9": 0},
            "b": "ml-training",
            "c": {"profile": "service", "energy": 0.0},
            ANY_VCLUSTER: {"priority": 1.0},
        }
    )
    assert (w["a"].priority, w["a"].checkpoint_efficiency, w["a"].conformance) == (0.5, 0.25, 0.0)
    assert w["b"] == WEIGHT_PROFILES["ml-training"]
    assert w["c"].energy == 0.0 and w["c"].conformance == WEIGHT_PROFILES["service"].conformance
    assert weights_for("zzz", w).priority == 1.0
    assert weights_for("hpc-batch", {}) == WEIGHT_PROFILES["hpc-batch"]
    assert weights_for("zzz", {}) == CostWeights()
    assert weights_from_yaml_data({"priority": 0.9}) == {ANY_VCLUSTER: CostWeights(priority=0.9)}


@pytest.mark.parametrize(
    ("data", "needle"),
    [
        ({}, "non-empty"),
        ({"hpc": {"priorty": 0.2}}, "unknown cost weight"),
        ({"hpc": {"priority": -1}}, ">= 0"),
        ({"hpc": {"priority": "high"}}, "number"),
        ({"hpc": "fastest"}, "unknown profile"),
        ({"hpc": {"priority": 0.2}, "wait_time": 0.3}, "top level"),
    ],
)
def test_bad_weights(data: object, needle: str) -> None:
    with pytest.raises(WeightsError, match=needle) as e:
        weights_from_yaml_data(data)
    assert e.value.hint
