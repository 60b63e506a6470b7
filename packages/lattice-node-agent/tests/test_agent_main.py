"""main.py: the agent's listen address goes through the one host:port parser."""

from __future__ import annotations

import pytest
from lattice_agent.main import _listen_address
from lattice_common.errors import ValidationError


def test_listen_address_forms() -> None:
    assert _listen_address("0.0.0.0:50053") == ("0.0.0.0", 50053)
    assert _listen_address(":0") == ("0.0.0.0", 0)  # empty host: every interface
    assert _listen_address("[::1]:50053") == ("::1", 50053)


@pytest.mark.parametrize("bad", ["50053", "host:", "host:port", "host:70000"])
def test_bad_listen_address_says_how_to_write_it(bad: str) -> None:
    with pytest.raises(ValidationError) as e:
        _listen_address(bad)
    assert "host:port" in e.value.hint
    assert bad in e.value.message or "65535" in e.value.message
