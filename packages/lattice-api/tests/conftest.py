"""The ``served`` fixture: the real REST and gRPC servers over a LocalQuorum
(lattice_test_harness.local_api), secured with signed tokens and the agent token,
seeded with the World of served_api.py."""

from __future__ import annotations

from collections.abc import AsyncIterator

import aiohttp
import pytest
from grpclib.client import Channel
from lattice_test_harness.local_api import LocalApi, serve_local_api
from served_api import AGENT_TOKEN, SECRET, Rest, World


@pytest.fixture
async def served() -> AsyncIterator[tuple[LocalApi, World, Rest, Channel]]:
    """A secured server (signed tokens, agent token) with the seeded world."""
    async with serve_local_api(hmac_secret=SECRET, agent_token=AGENT_TOKEN) as api:
        world = World(api)
        channel = api.channel()
        async with aiohttp.ClientSession() as session:
            try:
                yield api, world, Rest(session, api.rest_url), channel
            finally:
                channel.close()
