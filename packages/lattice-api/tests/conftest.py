"""The ``served`` fixture: the real REST and gRPC servers over a LocalQuorum
(lattice_test_harness.local_api), secured with signed tokens and the agent token,
seeded with the World of served_api.py."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest
from grpclib.client import Channel
from lattice_test_harness.local_api import LocalApi
from served_api import Rest, World, serve_seeded


@pytest.fixture
async def served() -> AsyncIterator[tuple[LocalApi, World, Rest, Channel]]:
    """A secured server (signed tokens, agent token) with the seeded world."""
    async for s in serve_seeded(World):
        yield s
