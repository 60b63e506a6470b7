from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from lattice_common.errors import ValidationError
from lattice_common.taskgroup import MAX_TASKS, parse_task_group


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("0-99%20", (0, 99, 1, 20)),
        ("5", (5, 5, 1, 0)),
        ("1-9:2", (1, 9, 2, 0)),
        ("0-9:3%2", (0, 9, 3, 2)),
    ],
)
def test_examples(text: str, expected: tuple[int, int, int, int]) -> None:
    assert parse_task_group(text) == expected


@pytest.mark.parametrize("text", ["", "9-3", "0-9%0", "0-9:0", "a-b", "-1-3", "0-99999", "1,2,3"])
def test_rejections_have_a_hint(text: str) -> None:
    with pytest.raises(ValidationError) as e:
        parse_task_group(text)
    assert e.value.hint


@settings(max_examples=300)
@given(st.text(max_size=20))
def test_fuzz_only_validation_errors(text: str) -> None:
    try:
        start, end, step, conc = parse_task_group(text)
    except ValidationError:
        return
    assert 0 <= start <= end and step >= 1 and conc >= 0
    assert len(range(start, end + 1, step)) <= MAX_TASKS


@given(st.integers(0, 5000), st.integers(0, 5000), st.integers(1, 50), st.integers(1, 100))
def test_round_trip(start: int, length: int, step: int, conc: int) -> None:
    end = start + length
    assert parse_task_group(f"{start}-{end}:{step}%{conc}") == (start, end, step, conc)
