"""Walltime parsing: the spec's examples, Slurm's forms, and properties over random input."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st
from lattice_common.duration import format_duration, parse_duration
from lattice_common.errors import ValidationError


@pytest.mark.parametrize(
    ("text", "seconds"),
    [
        ("72h", 72 * 3600),
        ("30m", 30 * 60),
        ("90s", 90),
        ("1d", 86400),
        ("01:30:00", 5400),
        ("2-00:00:00", 2 * 86400),
        ("1-12:00:00", 86400 + 12 * 3600),
        ("1-12", 86400 + 12 * 3600),  # D-HH
        ("1-02:30", 86400 + 2 * 3600 + 30 * 60),  # D-HH:MM
        ("05:30", 330),  # MM:SS
        ("30", 30 * 60),  # bare number = minutes, as Slurm's --time=30
        ("100:00:00", 100 * 3600),  # hours may exceed 24 without a day part
        ("  72H ", 72 * 3600),  # case and surrounding blanks do not matter
    ],
)
def test_accepted_forms(text: str, seconds: int) -> None:
    assert parse_duration(text) == seconds


@pytest.mark.parametrize(
    "text",
    ["abc", "", "   ", "-1h", "0", "0s", "00:00:00", "1:99", "25:00:00:00", "1-25:00:00"],
)
def test_rejected_forms(text: str) -> None:
    with pytest.raises(ValidationError):
        parse_duration(text)


def test_error_names_field_value_and_hint() -> None:
    with pytest.raises(ValidationError) as info:
        parse_duration("abc", field="walltime")
    err = info.value
    assert "walltime" in err.message and "abc" in err.message
    assert err.details == {"walltime": "abc"}
    assert "HH:MM:SS" in err.hint


def test_zero_is_rejected_with_its_own_message() -> None:
    with pytest.raises(ValidationError, match="greater than zero"):
        parse_duration("0")


def test_unicode_digits_are_not_numbers() -> None:
    # str.isdigit() is true for these; int() rejects "²" with ValueError (was a crash).
    for text in ("²", "1:²", "٣h", "١٢"):
        with pytest.raises(ValidationError):
            parse_duration(text)


@pytest.mark.parametrize(
    ("seconds", "text"),
    [(None, "—"), (0, "00:00:00"), (59, "00:00:59"), (5400, "01:30:00"), (90061, "1-01:01:01")],
)
def test_format_duration(seconds: int | None, text: str) -> None:
    assert format_duration(seconds) == text


# --- properties --------------------------------------------------------------------

hours = st.integers(min_value=0, max_value=10**6)
minutes = st.integers(min_value=0, max_value=59)
secs = st.integers(min_value=0, max_value=59)


@given(hours, minutes, secs)
def test_hh_mm_ss_is_its_sum(h: int, m: int, s: int) -> None:
    total = h * 3600 + m * 60 + s
    text = f"{h:02d}:{m:02d}:{s:02d}"
    if total == 0:
        with pytest.raises(ValidationError):
            parse_duration(text)
    else:
        assert parse_duration(text) == total


@given(st.integers(min_value=0, max_value=23), minutes, secs)
def test_format_round_trips_hh_mm_ss(h: int, m: int, s: int) -> None:
    text = f"{h:02d}:{m:02d}:{s:02d}"
    if text != "00:00:00":
        assert format_duration(parse_duration(text)) == text


@given(hours, minutes, secs)
def test_format_output_parses_back(h: int, m: int, s: int) -> None:
    """Past a day format_duration adds a D- prefix; that form must parse to the same total."""
    text = f"{h:02d}:{m:02d}:{s:02d}"
    if text != "00:00:00":
        seconds = parse_duration(text)
        assert parse_duration(format_duration(seconds)) == seconds


@given(st.integers(min_value=1, max_value=10**9))
def test_format_then_parse_is_identity(seconds: int) -> None:
    assert parse_duration(format_duration(seconds)) == seconds


@given(st.text(max_size=40))
def test_arbitrary_text_parses_or_raises_validation_error(text: str) -> None:
    try:
        result = parse_duration(text)
    except ValidationError:
        return
    assert isinstance(result, int) and result > 0


@given(st.text(alphabet="0123456789:-smhd ", max_size=16))
def test_duration_like_text_parses_or_raises_validation_error(text: str) -> None:
    try:
        result = parse_duration(text)
    except ValidationError:
        return
    assert isinstance(result, int) and result > 0
