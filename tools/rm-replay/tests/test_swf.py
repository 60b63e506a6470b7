"""Standard Workload Format import: the documented field mapping, skips and errors."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from rm_replay.model import SubmitEvent, SwfError, TraceError
from rm_replay.swf import SWF_FIELDS, load_swf, parse_swf, parse_swf_line

# job submit wait run alloc_p cpu mem req_p req_t req_mem status uid gid exe queue part prec think
LINE = "7 100 5 3600 128 -1 -1 130 7200 -1 1 12 3 4 2 1 -1 -1"


def test_field_mapping() -> None:
    ev = parse_swf_line(LINE, cores_per_node=64, queue_map={2: "ml-training"})
    assert ev == SubmitEvent(
        t=100.0,
        id="7",
        tenant="g3",
        user="u12",
        nodes=3,  # ceil(130 requested processors / 64)
        walltime=7200.0,
        vcluster="ml-training",
        runtime=3600.0,
        exit=0,
        name="exe4",
    )


def test_options_and_fallbacks() -> None:
    # requested processors unknown -> allocated; requested time unknown -> run time;
    # unmapped queue -> the default vCluster; tenant by user; failed status -> exit 1
    line = "8 50 0 600 64 -1 -1 -1 -1 -1 0 5 -1 -1 9 -1 -1 -1"
    ev = parse_swf_line(line, cores_per_node=32, tenant_by="user", default_vcluster="hpc")
    assert isinstance(ev, SubmitEvent)
    assert (ev.nodes, ev.walltime, ev.vcluster, ev.tenant, ev.exit, ev.name) == (
        2,
        600.0,
        "hpc",
        "u5",
        1,
        "",
    )
    unknown_group = parse_swf_line(line, cores_per_node=32)
    assert isinstance(unknown_group, SubmitEvent) and unknown_group.tenant == "unknown"
    one_core = parse_swf_line("9 0 0 10 1 -1 -1 1 60 -1 -1 1 1 -1 -1 -1 -1 -1", cores_per_node=64)
    assert isinstance(one_core, SubmitEvent) and one_core.nodes == 1 and one_core.exit == 0


@pytest.mark.parametrize(
    ("line", "why"),
    [
        ("1 0 0 -1 4 -1 -1 4 60 -1 1 1 1 -1 -1 -1 -1 -1", "unknown run time"),
        ("1 0 0 10 -1 -1 -1 -1 60 -1 1 1 1 -1 -1 -1 -1 -1", "no processor count"),
        ("1 0 0 0 4 -1 -1 4 60 -1 5 1 1 -1 -1 -1 -1 -1", "cancelled before it started"),
    ],
)
def test_jobs_that_cannot_be_replayed_are_skipped(line: str, why: str) -> None:
    assert parse_swf_line(line, cores_per_node=4) == why


def test_comments_header_and_skips(tmp_path: Path) -> None:
    path = tmp_path / "w.swf"
    path.write_text(
        "; Version: 2.2\n"
        "; UnixStartTime: 1772323200\n"
        ";\n"
        f"{LINE}\n"
        "\n"
        "8 200 0 -1 4 -1 -1 4 60 -1 1 1 1 -1 -1 -1 -1 -1\n"
        "9 300 0 10 4 -1 -1 4 60 -1 1 1 1 -1 -1 -1 -1 -1\n"
    )
    parsed = parse_swf(path.read_text().splitlines(), cores_per_node=64, path=str(path))
    assert parsed.unix_start_time == 1772323200.0
    assert [e.id for e in parsed.events] == ["7", "9"]
    assert parsed.events[0].t == 1772323200.0 + 100
    assert parsed.skipped == [(6, "8", "unknown run time")]
    assert load_swf(path, cores_per_node=64) == parsed.events


@pytest.mark.parametrize(
    ("line", "needle"),
    [
        ("1 2 3", "expected 18 fields, found 3"),
        (LINE + " 5", "expected 18 fields, found 19"),
        (LINE.replace("3600", "1h"), "run_time is not a number"),
        (LINE.replace("7 100", "7.5 100"), "job number"),
        (LINE.replace("7 100", "7 -100"), "submit time"),
        (LINE.replace("3600", "1e300"), "out of range"),
    ],
)
def test_bad_lines(line: str, needle: str) -> None:
    with pytest.raises(SwfError, match=needle) as e:
        parse_swf_line(line, cores_per_node=64, line_no=12)
    assert e.value.line == 12 and "SWF" in e.value.render()


def test_errors_name_file_and_line(tmp_path: Path) -> None:
    path = tmp_path / "w.swf"
    path.write_text(f"; header\n{LINE}\n1 2 3\n")
    with pytest.raises(SwfError) as e:
        load_swf(path, cores_per_node=64)
    assert str(e.value).startswith(f"{path}:3: expected 18 fields")


def test_duplicate_job_numbers(tmp_path: Path) -> None:
    path = tmp_path / "w.swf"
    path.write_text(f"{LINE}\n{LINE}\n")
    with pytest.raises(TraceError, match="twice"):
        load_swf(path, cores_per_node=64)


def test_bad_options() -> None:
    with pytest.raises(SwfError, match="cores_per_node"):
        parse_swf([LINE], cores_per_node=0)
    with pytest.raises(SwfError, match="tenant_by"):
        parse_swf([LINE], cores_per_node=1, tenant_by="project")


_number = st.one_of(
    st.integers(-5, 10**6).map(str),
    st.floats(allow_nan=True, allow_infinity=True).map(repr),
    st.sampled_from(["-1", "0", "1", "5", "1e9", "1.5", ".5", "x", "--1", "1e"]),
)


@settings(max_examples=300, deadline=None)
@given(
    st.one_of(
        st.text(max_size=120),
        st.lists(_number, min_size=16, max_size=20).map(" ".join),
        st.lists(_number, min_size=18, max_size=18).map("\t".join),
    ),
    st.integers(1, 256),
)
def test_fuzz_any_line_parses_skips_or_raises_an_swf_error(line: str, cores: int) -> None:
    try:
        ev = parse_swf_line(line, cores_per_node=cores, line_no=3)
    except SwfError as e:
        assert isinstance(e, ValueError) and e.line == 3 and e.message
        return
    assert ev is None or isinstance(ev, (str, SubmitEvent))
    if isinstance(ev, SubmitEvent):
        assert ev.nodes >= 1 and ev.walltime >= 0 and ev.runtime is not None and ev.runtime >= 0
        assert len(line.split()) == len(SWF_FIELDS)
