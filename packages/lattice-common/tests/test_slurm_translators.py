"""Slurm translators: examples from Slurm's documentation plus hypothesis properties."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from lattice_common.errors import ValidationError
from lattice_common.slurm import (
    MAX_HOSTS,
    NO_ARRAY_INDEX,
    ArraySpec,
    DependencyClause,
    SlurmSyntaxError,
    compress_hostlist,
    expand_hostlist,
    expand_output_pattern,
    hostname_sort_key,
    parse_array,
    parse_dependency,
    slurm_env_nodelist,
    split_job_ref,
    to_depends_on,
    to_task_group,
)


def test_error_type_is_value_error_and_validation_error() -> None:
    with pytest.raises(ValueError) as exc:
        expand_hostlist("n[1-")
    assert isinstance(exc.value, ValidationError)
    assert exc.value.hint


# --------------------------------------------------------------------------- hostlist


@pytest.mark.parametrize(
    ("text", "names"),
    [
        (
            "node[001-003,007],gpu[1-2]",
            ["node001", "node002", "node003", "node007", "gpu1", "gpu2"],
        ),
        ("tux[1,3-4]", ["tux1", "tux3", "tux4"]),
        ("lx[10-11]", ["lx10", "lx11"]),
        ("n[8-10]", ["n8", "n9", "n10"]),
        ("n[08-10]", ["n08", "n09", "n10"]),
        ("rack[1-2]-node[01-02]", ["rack1-node01", "rack1-node02", "rack2-node01", "rack2-node02"]),
        ("a b\tc", ["a", "b", "c"]),
        ("nid001234", ["nid001234"]),
        ("n1,n1", ["n1", "n1"]),
        ("", []),
        (" , ", []),
        ("[1-2]", ["1", "2"]),
    ],
)
def test_expand_examples(text: str, names: list[str]) -> None:
    assert expand_hostlist(text) == names


@pytest.mark.parametrize(
    "text",
    ["n[1-", "n1]", "n[]", "n[a-b]", "n[3-1]", "n[1-2:2]", "n[[1]]", "n[1,,2]", "n[0-100000]"],
)
def test_expand_rejects(text: str) -> None:
    with pytest.raises(SlurmSyntaxError):
        expand_hostlist(text)


def test_expand_cap_is_checked_before_generating() -> None:
    assert len(expand_hostlist(f"n[1-{MAX_HOSTS}]")) == MAX_HOSTS
    for text in ["n[0-999999999999999999]", "a[0-999]b[0-999]", "a[1-60000],b[1-60000]"]:
        with pytest.raises(SlurmSyntaxError, match="more than"):
            expand_hostlist(text)
    with pytest.raises(SlurmSyntaxError, match="more than 5 names"):
        expand_hostlist("n[1-10]", limit=5)
    with pytest.raises(SlurmSyntaxError, match="18 digits"):
        expand_hostlist("n[" + "9" * 5000 + "]")


def test_huge_numeric_suffixes_stay_plain_names() -> None:
    names = ["n" + "1" * 5000, "n" + "1" * 5000 + "2", "n1"]
    assert compress_hostlist(names) == ",".join(names)
    assert compress_hostlist(names, sort=True).startswith("n1,n111")
    assert expand_hostlist(compress_hostlist(names)) == names


@pytest.mark.parametrize(
    ("names", "text"),
    [
        (
            ["node001", "node002", "node003", "node007", "gpu1", "gpu2"],
            "node[001-003,007],gpu[1-2]",
        ),
        (["nid9", "nid10"], "nid[9-10]"),
        (["nid09", "nid10"], "nid[09-10]"),
        (["nid1", "nid01"], "nid[1,01]"),
        (["nid1", "nid3", "nid2"], "nid[1,3,2]"),  # order kept, like scontrol show hostlist
        (["node1", "gpu1", "node2"], "node1,gpu1,node2"),
        (["login", "node1", "node2"], "login,node[1-2]"),
        (["a1", "a2"], "a1,a2"),  # bracketed form would be longer
        ([], ""),
    ],
)
def test_compress_examples(names: list[str], text: str) -> None:
    assert compress_hostlist(names) == text


def test_compress_sorted_and_env_nodelist() -> None:
    names = ["nid10", "nid2", "login", "nid1", "nid2", "nid003"]
    assert compress_hostlist(names, sort=True) == "login,nid[1-2,003,10]"
    assert slurm_env_nodelist(["x1000c0s0b0n3", "x1000c0s0b0n1", "x1000c0s0b0n2"]) == (
        "x1000c0s0b0n[1-3]"
    )


@pytest.mark.parametrize("bad", ["", "a,b", "n[1]", "a b", "tab\t", "nl\n", "\x00"])
def test_compress_rejects_unrepresentable_names(bad: str) -> None:
    with pytest.raises(SlurmSyntaxError):
        compress_hostlist(["ok1", bad])


_PREFIXES = st.sampled_from(["node", "gpu", "n", "nid", "rack1-n", "x1000c0s", "a.b-", ""])


@st.composite
def host_names(draw: st.DrawFn) -> str:
    prefix = draw(_PREFIXES)
    if draw(st.integers(0, 9)) == 0:
        return prefix + draw(st.sampled_from(["login", "head", "-mgmt"]))
    number = draw(st.integers(0, 1200))
    width = draw(st.integers(1, 4))
    return prefix + str(number).zfill(width)


@st.composite
def clustered_names(draw: st.DrawFn) -> list[str]:
    """Runs of consecutive numbers, as real allocations have, mixed with strays."""
    out: list[str] = []
    for _ in range(draw(st.integers(0, 6))):
        if draw(st.booleans()):
            prefix, start = draw(_PREFIXES), draw(st.integers(0, 1000))
            width = draw(st.integers(1, 4))
            out += [
                prefix + str(n).zfill(width) for n in range(start, start + draw(st.integers(1, 30)))
            ]
        else:
            out += draw(st.lists(host_names(), max_size=5))
    return out


@settings(max_examples=300)
@given(st.one_of(st.lists(host_names(), max_size=40), clustered_names()))
def test_compress_round_trips_in_order(names: list[str]) -> None:
    text = compress_hostlist(names)
    assert expand_hostlist(text) == names
    assert len(text) <= len(",".join(names))


@settings(max_examples=200)
@given(st.one_of(st.lists(host_names(), max_size=40), clustered_names()))
def test_compress_sorted_round_trips_as_a_set(names: list[str]) -> None:
    expected = sorted(set(names), key=hostname_sort_key)
    assert expand_hostlist(compress_hostlist(names, sort=True)) == expected
    assert expand_hostlist(slurm_env_nodelist(names)) == expected


_HOSTLIST_CHARS = st.text(alphabet="[]-,0123456789ab \t", max_size=40)


@settings(max_examples=500)
@given(st.one_of(st.text(max_size=40), _HOSTLIST_CHARS))
def test_expand_random_text_only_raises_slurm_errors(text: str) -> None:
    try:
        names = expand_hostlist(text)
    except SlurmSyntaxError:
        return
    assert len(names) <= MAX_HOSTS
    if names and all(n.isprintable() for n in names):
        assert expand_hostlist(compress_hostlist(names)) == names


@settings(max_examples=300)
@given(st.lists(st.text(max_size=12), max_size=10), st.booleans())
def test_compress_random_names_only_raises_slurm_errors(names: list[str], sort: bool) -> None:
    try:
        text = compress_hostlist(names, sort=sort)
    except SlurmSyntaxError:
        return
    assert len(text) <= len(",".join(names))


# --------------------------------------------------------------------------- arrays


@pytest.mark.parametrize(
    ("text", "indices", "throttle"),
    [
        ("0-31", tuple(range(32)), None),
        ("1,3,5,7", (1, 3, 5, 7), None),
        ("1-7:2", (1, 3, 5, 7), None),
        ("0-15%4", tuple(range(16)), 4),
        ("0-15:2%4", (0, 2, 4, 6, 8, 10, 12, 14), 4),
        ("5", (5,), None),
        ("3,1-2,2", (1, 2, 3), None),
        ("0-1000", tuple(range(1001)), None),
    ],
)
def test_parse_array_examples(text: str, indices: tuple[int, ...], throttle: int | None) -> None:
    assert parse_array(text) == ArraySpec(indices, throttle)


@pytest.mark.parametrize(
    "text", ["", "0-1001", "5-1", "0-9:0", "0-9%0", "0-9%", "a", "1,,2", "-1", "1:2", "0-9%2%3"]
)
def test_parse_array_rejects(text: str) -> None:
    with pytest.raises(SlurmSyntaxError):
        parse_array(text)


def test_parse_array_site_limit() -> None:
    assert parse_array("0-4999", max_array_size=5000).indices[-1] == 4999
    with pytest.raises(SlurmSyntaxError, match="MaxArraySize"):
        parse_array("5000", max_array_size=5000)


@pytest.mark.parametrize(
    ("text", "group"),
    [
        ("0-99%20", (0, 99, 1, 20)),
        ("0-15:4", (0, 12, 4, 0)),
        ("7", (7, 7, 1, 0)),
        ("1,3,5", (1, 5, 2, 0)),
        ("4-6,1-3%2", (1, 6, 1, 2)),
    ],
)
def test_to_task_group(text: str, group: tuple[int, int, int, int]) -> None:
    assert to_task_group(parse_array(text)) == group


def test_to_task_group_rejects_uneven_sets_and_task_group_limits() -> None:
    with pytest.raises(SlurmSyntaxError, match="evenly spaced") as exc:
        to_task_group(parse_array("1,2,5"))
    assert "task group" in exc.value.hint
    with pytest.raises(SlurmSyntaxError, match="at most"):
        to_task_group(parse_array("0-20000", max_array_size=30000))


_ITEMS = st.tuples(st.integers(0, 1000), st.integers(0, 200), st.integers(1, 50))


@settings(max_examples=300)
@given(st.lists(_ITEMS, min_size=1, max_size=8), st.none() | st.integers(1, 500))
def test_parse_array_gives_the_generated_set(items, throttle) -> None:
    parts, expected = [], set()
    for start, length, step in items:
        end = min(start + length, 1000)
        if start == end and step == 1:
            parts.append(str(start))
        elif step == 1:
            parts.append(f"{start}-{end}")
        else:
            parts.append(f"{start}-{end}:{step}")
        expected.update(range(start, end + 1, step))
    text = ",".join(parts) + (f"%{throttle}" if throttle else "")
    spec = parse_array(text)
    assert spec.indices == tuple(sorted(expected))
    assert spec.throttle == throttle


@settings(max_examples=500)
@given(st.one_of(st.text(max_size=30), st.text(alphabet="0123456789-:,%", max_size=30)))
def test_parse_array_random_text_only_raises_slurm_errors(text: str) -> None:
    try:
        spec = parse_array(text)
    except SlurmSyntaxError:
        return
    assert spec.indices and all(0 <= i <= 1000 for i in spec.indices)
    try:
        start, end, step, _conc = to_task_group(spec)
    except SlurmSyntaxError:
        return
    assert tuple(range(start, end + 1, step)) == spec.indices


# --------------------------------------------------------------------------- dependencies


def test_parse_dependency_examples() -> None:
    assert parse_dependency("afterok:123:456,afterany:789") == [
        DependencyClause("success", ("123", "456")),
        DependencyClause("any", ("789",)),
    ]
    assert parse_dependency("afternotok:a1b2c3d4") == [DependencyClause("failure", ("a1b2c3d4",))]
    assert parse_dependency("aftercorr:123") == [DependencyClause("corresponding", ("123",))]
    assert parse_dependency("singleton") == [DependencyClause("mutex", ())]
    assert parse_dependency("AfterOK:123_4") == [DependencyClause("success", ("123_4",))]
    assert parse_dependency("123") == [DependencyClause("any", ("123",))]
    assert parse_dependency("afterok:1?") == [DependencyClause("success", ("1",))]


@pytest.mark.parametrize(
    ("text", "match"),
    [
        ("after:123", "'after' is not supported"),
        ("afterburstbuffer:123", "not supported"),
        ("expand:123", "not supported"),
        ("afterok:1?afterany:2", "any one suffices"),
        ("afterok:1,afterok:2?afterany:3", "mixes"),
        ("after:123+5", "not supported"),
        ("afterok:123+5", "time delays"),
        ("afterfoo:1", "unknown dependency type"),
        ("afterok", "names no job"),
        ("afterok:", "invalid job id"),
        ("singleton:1", "takes no job ids"),
        ("afterok:1,", "empty clause"),
        ("", "empty"),
    ],
)
def test_parse_dependency_rejects_with_hint(text: str, match: str) -> None:
    with pytest.raises(SlurmSyntaxError, match=match) as exc:
        parse_dependency(text)
    assert exc.value.hint


def test_to_depends_on_and_split_job_ref() -> None:
    clauses = parse_dependency("afterok:1:2,singleton")
    assert to_depends_on(clauses, mutex_name="train") == [
        {"ref": "1", "condition": "success"},
        {"ref": "2", "condition": "success"},
        {"ref": "train", "condition": "mutex"},
    ]
    with pytest.raises(SlurmSyntaxError):
        to_depends_on(clauses)
    assert split_job_ref("123_4") == ("123", 4)
    assert split_job_ref("a1b2-c3") == ("a1b2-c3", None)


_DEP_WORDS = st.sampled_from(
    ["afterok", "afterany", "after", "singleton", "aftercorr", ":", ",", "?", "+", "1", "a_2"]
)


@settings(max_examples=500)
@given(st.one_of(st.text(max_size=40), st.lists(_DEP_WORDS, max_size=10).map("".join)))
def test_parse_dependency_random_text_only_raises_slurm_errors(text: str) -> None:
    try:
        clauses = parse_dependency(text)
    except SlurmSyntaxError:
        return
    for clause in clauses:
        assert clause.condition in {"success", "failure", "any", "corresponding", "mutex"}
        for ref in clause.refs:
            split_job_ref(ref)


# --------------------------------------------------------------------------- patterns


@pytest.mark.parametrize(
    ("template", "expected"),
    [
        ("slurm-%j.out", "slurm-128.out"),
        ("job%4j.out", "job0128.out"),
        ("job%2j-%2t.out", "job128-00.out"),
        ("%x-%u-%N.log", "train-alice-nid001.log"),
        ("%A_%a", f"128_{NO_ARRAY_INDEX}"),
        ("%n.%s.%J.%b", "0.batch.128.4"),
        ("100%%", "100%"),
        ("%q-%4q-%", "%q-%4q-%"),
        ("%123j", "0000000128"),
        ("%4N", "nid001"),
        ("out\\%j", "out%j"),
        ("a\\\\b%j", "a\\b%j"),
    ],
)
def test_pattern_examples(template: str, expected: str) -> None:
    got = expand_output_pattern(
        template, job_id=128, job_name="train", user="alice", node="nid001.cluster"
    )
    assert got == expected


def test_pattern_array_fields() -> None:
    got = expand_output_pattern("slurm-%A_%4a.out", job_id="131", array_job_id=130, array_index=7)
    assert got == "slurm-130_0007.out"


@settings(max_examples=500)
@given(
    st.one_of(st.text(max_size=40), st.text(alphabet="%0123456789jJAabntxuNsq\\", max_size=40)),
    st.one_of(st.integers(0, 10**12), st.text(max_size=10)),
    st.none() | st.integers(0, 4_000_000),
)
def test_pattern_random_templates_never_raise(template: str, job_id, index) -> None:
    got = expand_output_pattern(template, job_id=job_id, array_index=index, node="n1")
    assert isinstance(got, str)
    if "%" not in template and "\\" not in template:
        assert got == template
