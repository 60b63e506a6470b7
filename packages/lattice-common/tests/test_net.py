"""host:port parsing: the one parser every process uses for listeners and peers."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st
from lattice_common.net import split_host_port


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("127.0.0.1:50051", ("127.0.0.1", 50051)),
        (" node-1.example:9000 ", ("node-1.example", 9000)),
        ("[::1]:8080", ("::1", 8080)),
        (":50051", ("0.0.0.0", 50051)),
        ("0.0.0.0:0", ("0.0.0.0", 0)),
    ],
)
def test_splits(text: str, expected: tuple[str, int]) -> None:
    assert split_host_port(text, default_host="0.0.0.0") == expected


@pytest.mark.parametrize(
    "text", ["", "localhost", "host:", "host:abc", "host:70000", "h:-1", "h:٣"]
)
def test_rejects_with_the_value_named(text: str) -> None:
    with pytest.raises(ValueError, match=r"host:port|port must be"):
        split_host_port(text)


def test_clients_refuse_port_zero() -> None:
    with pytest.raises(ValueError, match="between 1 and 65535"):
        split_host_port("127.0.0.1:0", allow_port_zero=False)


@given(st.text(max_size=40))
def test_any_text_parses_or_raises_value_error(text: str) -> None:
    try:
        host, port = split_host_port(text)
    except ValueError:
        return
    assert 0 <= port <= 65535
    assert isinstance(host, str)


@given(
    st.from_regex(r"[a-z0-9.-]{1,20}", fullmatch=True),
    st.integers(min_value=0, max_value=65535),
)
def test_round_trip(host: str, port: int) -> None:
    assert split_host_port(f"{host}:{port}") == (host, port)
