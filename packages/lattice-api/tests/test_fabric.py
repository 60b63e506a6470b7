"""FabricManager (CXI credentials) against the fake fabric manager over real HTTP."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import aiohttp
import pytest
from lattice_api.fabric import CxiCredentials, FabricManager
from lattice_common.config import NetworkConfig
from lattice_common.errors import Unavailable
from lattice_test_harness.fake_fabric import FakeFabricManager

TOKEN = "fabric-secret-0123456789"
SERVICES = "/fabric/cxi/services"


@pytest.fixture
async def fake() -> AsyncIterator[FakeFabricManager]:
    async with FakeFabricManager(token=TOKEN, vni_range=(1000, 1001)) as server:
        yield server


@pytest.fixture
async def fm(fake: FakeFabricManager) -> AsyncIterator[FabricManager]:
    client = FabricManager(fake.url, TOKEN)
    try:
        yield client
    finally:
        await client.close()


async def test_provision_returns_the_fakes_record(
    fake: FakeFabricManager, fm: FabricManager
) -> None:
    creds = await fm.provision("alloc-1", "launch-1", ["x1000c0s0b0n0", "x1000c0s0b0n1"])

    assert isinstance(creds, CxiCredentials)
    record = fake.services[creds.service_id]
    assert record == {
        "allocation_id": "alloc-1",
        "launch_id": "launch-1",
        "nodes": ["x1000c0s0b0n0", "x1000c0s0b0n1"],
        "vni": creds.vni,
        "svc_id": creds.svc_id,
        "auth_key": creds.auth_key,
    }
    assert creds.vni == 1000  # lowest free VNI of the range
    assert len(bytes.fromhex(creds.auth_key)) == 32
    assert creds.auth_key not in repr(creds)
    assert fake.requests == [("POST", SERVICES), ("GET", f"{SERVICES}/{creds.service_id}/auth")]


async def test_provision_with_the_domains_vni(fake: FakeFabricManager, fm: FabricManager) -> None:
    a = await fm.provision("alloc-1", "launch-1", ["n1"], vni=1234)
    b = await fm.provision("alloc-1", "launch-2", ["n2"], vni=1234)
    assert a.vni == b.vni == 1234
    assert a.service_id != b.service_id and a.auth_key != b.auth_key
    assert set(fake.services) == {a.service_id, b.service_id}


async def test_revoke_removes_the_service_and_twice_is_fine(
    fake: FakeFabricManager, fm: FabricManager
) -> None:
    creds = await fm.provision("alloc-1", "launch-1", ["n1"])
    await fm.revoke(creds.service_id)
    assert creds.service_id not in fake.services
    assert fake.revoked == [creds.service_id]

    await fm.revoke(creds.service_id)  # already gone (404): fine
    assert fake.revoked == [creds.service_id]
    assert fake.requests[-2:] == [("DELETE", f"{SERVICES}/{creds.service_id}")] * 2


async def test_wrong_token_is_unavailable_with_a_hint_and_no_token(
    fake: FakeFabricManager,
) -> None:
    wrong = "wrong-token-abcdef"
    client = FabricManager(fake.url, wrong)
    try:
        with pytest.raises(Unavailable) as info:
            await client.provision("alloc-1", "launch-1", ["n1"])
    finally:
        await client.close()
    err = info.value
    assert fake.url in err.message and "401" in err.message
    assert "LATTICE_FABRIC_MANAGER_TOKEN" in err.hint
    for text in (err.message, err.hint, err.render(), repr(err.to_dict()), repr(client)):
        assert wrong not in text
        assert TOKEN not in text
    assert fake.services == {}


async def test_no_token_is_refused(fake: FakeFabricManager) -> None:
    client = FabricManager(fake.url)
    try:
        with pytest.raises(Unavailable, match="401"):
            await client.revoke("cxi-x")
    finally:
        await client.close()


async def test_auth_failure_deletes_the_new_service(
    fake: FakeFabricManager, fm: FabricManager
) -> None:
    fake.fail_next("GET", 500)
    with pytest.raises(Unavailable) as info:
        await fm.provision("alloc-1", "launch-1", ["n1", "n2"])

    assert "500" in info.value.message and fake.url in info.value.message
    assert info.value.hint
    assert fake.services == {}  # no leak
    assert len(fake.revoked) == 1
    service_id = fake.revoked[0]
    assert fake.requests == [
        ("POST", SERVICES),
        ("GET", f"{SERVICES}/{service_id}/auth"),
        ("DELETE", f"{SERVICES}/{service_id}"),
    ]


async def test_create_failure_is_unavailable(fake: FakeFabricManager, fm: FabricManager) -> None:
    fake.fail_next("POST", 503)
    with pytest.raises(Unavailable, match="HTTP 503") as info:
        await fm.provision("alloc-1", "launch-1", ["n1"])
    assert "logs" in info.value.hint
    assert info.value.details["status"] == 503
    assert fake.services == {} and fake.revoked == []


async def test_revoke_failure_is_unavailable(fake: FakeFabricManager, fm: FabricManager) -> None:
    creds = await fm.provision("alloc-1", "launch-1", ["n1"])
    fake.fail_next("DELETE", 500)
    with pytest.raises(Unavailable, match="HTTP 500"):
        await fm.revoke(creds.service_id)
    assert creds.service_id in fake.services
    await fm.revoke(creds.service_id)
    assert fake.services == {}


async def test_server_down_is_unavailable() -> None:
    server = FakeFabricManager(token=TOKEN)
    url = await server.start()
    await server.stop()  # the port is now closed
    client = FabricManager(url, TOKEN, timeout=5)
    try:
        with pytest.raises(Unavailable) as info:
            await client.provision("alloc-1", "launch-1", ["n1"])
        with pytest.raises(Unavailable):
            await client.revoke("cxi-x")
    finally:
        await client.close()
    assert url in info.value.message
    assert "fabric_manager_url" in info.value.hint
    assert TOKEN not in info.value.message


async def test_silent_server_times_out() -> None:
    async def never_answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.read()  # until the client gives up and closes
        writer.close()

    server = await asyncio.start_server(never_answer, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    client = FabricManager(f"http://127.0.0.1:{port}", TOKEN, timeout=0.2)
    try:
        with pytest.raises(Unavailable, match=r"did not answer .* within 0.2 s") as info:
            await client.provision("alloc-1", "launch-1", ["n1"])
    finally:
        await client.close()
        server.close()
        await server.wait_closed()
    assert "timeout" in info.value.hint


async def test_vni_pool_exhausted(fake: FakeFabricManager, fm: FabricManager) -> None:
    await fm.provision("a", "l1", ["n1"])
    await fm.provision("a", "l2", ["n1"])
    with pytest.raises(Unavailable, match="HTTP 409"):
        await fm.provision("a", "l3", ["n1"])


@pytest.mark.parametrize(
    ("body", "why"),
    [
        ("not json", "not JSON"),
        ([], "JSON object"),
        ({"allocation_id": "a", "launch_id": "l", "nodes": ["n1"]}, "missing fields: vni"),
        ({"allocation_id": "", "launch_id": "l", "nodes": ["n1"], "vni": None}, "allocation_id"),
        ({"allocation_id": "a", "launch_id": 5, "nodes": ["n1"], "vni": None}, "launch_id"),
        ({"allocation_id": "a", "launch_id": "l", "nodes": [], "vni": None}, "nodes"),
        ({"allocation_id": "a", "launch_id": "l", "nodes": "n1", "vni": None}, "nodes"),
        ({"allocation_id": "a", "launch_id": "l", "nodes": ["n1"], "vni": "7"}, "vni"),
        ({"allocation_id": "a", "launch_id": "l", "nodes": ["n1"], "vni": True}, "vni"),
        ({"allocation_id": "a", "launch_id": "l", "nodes": ["n1"], "vni": 0}, "vni"),
        ({"allocation_id": "a", "launch_id": "l", "nodes": ["n1"], "vni": None, "x": 1}, "x"),
    ],
)
async def test_fake_validates_bodies(fake: FakeFabricManager, body: object, why: str) -> None:
    headers = {"Authorization": f"Bearer {TOKEN}"}
    async with aiohttp.ClientSession(headers=headers) as session:
        if isinstance(body, str):
            resp = await session.post(fake.url + SERVICES, data=body)
        else:
            resp = await session.post(fake.url + SERVICES, json=body)
        async with resp:
            assert resp.status == 400
            assert why in (await resp.json())["error"]
    assert fake.services == {}


async def test_fake_checks_the_token_and_unknown_services(fake: FakeFabricManager) -> None:
    async with aiohttp.ClientSession() as session:
        async with session.get(f"{fake.url}{SERVICES}/cxi-x/auth") as resp:
            assert resp.status == 401
        headers = {"Authorization": "Bearer nope"}
        async with session.delete(f"{fake.url}{SERVICES}/cxi-x", headers=headers) as resp:
            assert resp.status == 401
        headers = {"Authorization": f"Bearer {TOKEN}"}
        async with session.get(f"{fake.url}{SERVICES}/cxi-x/auth", headers=headers) as resp:
            assert resp.status == 404


def test_from_config() -> None:
    assert FabricManager.from_config(NetworkConfig()) is None
    network = NetworkConfig(
        fabric_manager_url="https://fm.example.com/", fabric_manager_token=TOKEN
    )
    client = FabricManager.from_config(network)
    assert client is not None
    assert client.base_url == "https://fm.example.com"
    assert client.token == TOKEN
    assert TOKEN not in repr(client)
