"""Helpers of the adapter tests: signed tokens per role, a seeded world, and small
clients for both transports (the ``served`` fixture in conftest.py puts them together
over the real servers on a LocalQuorum)."""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator, Callable
from typing import Any, TypeVar

import aiohttp
import grpclib
import jwt
from grpclib.client import Channel
from lattice_api.auth import Role
from lattice_common.proto.lattice import v1
from lattice_common.types import AllocationSpec, AllocationState
from lattice_test_harness.local_api import LocalApi, serve_local_api

# module-level tokens are minted at collection; a whole suite (run in any order, on any
# number of workers) must finish before they expire
TOKEN_LIFETIME_S = 6 * 3600

T = TypeVar("T")

SECRET = "adapter-test-secret-that-is-long-enough!"
AGENT_TOKEN = "agent-token-adapters-0123456789"

# claims that give each role (spec: Roles table); the agent uses the agent token
ROLE_CLAIMS: dict[Role, dict[str, Any]] = {
    Role.SYSTEM_ADMIN: {"scope": "admin"},
    Role.TENANT_ADMIN: {"scope": "tenant:admin"},
    Role.OPERATOR: {"scope": "operator"},
    Role.CLAIMING_USER: {"scope": "sensitive:claim"},
    Role.READ_ONLY: {"scope": "readonly"},
    Role.USER: {},
    Role.QUOTA_SERVICE: {"scope": "quota:update"},  # Waldur's service token
}


def token(user: str, role: Role = Role.USER) -> str:
    if role == Role.AGENT:
        return AGENT_TOKEN
    claims = {"sub": user, "exp": int(time.time()) + TOKEN_LIFETIME_S, **ROLE_CLAIMS[role]}
    return jwt.encode(claims, SECRET, algorithm="HS256")


def bearer(user: str, role: Role = Role.USER) -> dict[str, str]:
    return {"authorization": f"Bearer {token(user, role)}"}


class Rest:
    """A tiny JSON client: ``(status, body)`` for every call."""

    def __init__(self, session: aiohttp.ClientSession, url: str) -> None:
        self.session = session
        self.url = url

    async def call(
        self,
        method: str,
        path: str,
        who: dict[str, str],
        body: Any = None,
        **query: Any,
    ) -> tuple[int, Any]:
        params = {k: str(v) for k, v in query.items() if v is not None}
        async with self.session.request(
            method, self.url + path, json=body, headers=who, params=params
        ) as r:
            raw = await r.read()
            if r.content_type == "application/x-ndjson":
                return r.status, [json.loads(x) for x in raw.splitlines() if x.strip()]
            if r.content_type == "application/json":
                return r.status, json.loads(raw)
            return r.status, raw.decode()


class Grpc:
    """Stubs of the four services for one caller."""

    def __init__(self, channel: Channel, who: dict[str, str]) -> None:
        self.alloc = v1.AllocationServiceStub(channel, timeout=10, metadata=who)
        self.nodes = v1.NodeServiceStub(channel, timeout=10, metadata=who)
        self.admin = v1.AdminServiceStub(channel, timeout=10, metadata=who)
        self.quorum = v1.QuorumServiceStub(channel, timeout=10, metadata=who)


async def grpc_error(call: Any) -> tuple[str, dict[str, Any]]:
    """(status name, the error as JSON) of a failing unary call."""
    try:
        await call
    except grpclib.GRPCError as e:
        return e.status.name, json.loads(e.message or "{}")
    raise AssertionError("the call succeeded")


class World:
    """The seeded state: tenants physics and bio, vCluster batch, nodes n1 (4 GPUs,
    group 3) and n2, and allocations of alice (pending, completed) and bob (running on
    n1)."""

    def __init__(self, api: LocalApi) -> None:
        self.api = api
        api.add_tenant("physics", max_nodes=10)
        api.add_tenant("bio")
        api.add_vcluster("batch")
        api.add_node("n1", capabilities={"gpu_count": 4, "gpu_type": "GH200"}, group=3)
        api.add_node("n2")
        api.add_node("n3")
        t = time.time()
        self.alice_pending = api.submit(self.spec("alice"), now=t - 30).id
        self.bob_running = api.submit(self.spec("bob"), now=t - 20).id
        api.start(self.bob_running, ["n1"], now=t - 10)
        self.alice_done = api.submit(self.spec("alice", "bio"), now=t - 5).id
        api.start(self.alice_done, ["n2"], now=t - 4)
        api.set_state(self.alice_done, AllocationState.COMPLETED, exit_code=0, now=t - 2)
        api.logs.add(self.bob_running, "epoch 1", node_id="n1", timestamp=1.0)
        api.logs.add(self.bob_running, "warning", stream="stderr", node_id="n1", timestamp=2.0)

    @staticmethod
    def spec(user: str, tenant: str = "physics") -> AllocationSpec:
        return AllocationSpec(
            entrypoint="python train.py",
            tenant=tenant,
            vcluster="batch",
            user=user,
            walltime_seconds=3600,
        )


async def serve_seeded(
    seed: Callable[[LocalApi], T], **settings: Any
) -> AsyncIterator[tuple[LocalApi, T, Rest, Channel]]:
    """The secured server (signed tokens, agent token) with ``settings`` (ApiSettings
    fields), ``seed(api)`` run on it, a REST client and a gRPC channel."""
    from lattice_api.settings import ApiSettings

    async with serve_local_api(
        hmac_secret=SECRET, agent_token=AGENT_TOKEN, settings=ApiSettings(**settings)
    ) as api:
        seeded = seed(api)
        channel = api.channel()
        async with aiohttp.ClientSession() as session:
            try:
                yield api, seeded, Rest(session, api.rest_url), channel
            finally:
                channel.close()
