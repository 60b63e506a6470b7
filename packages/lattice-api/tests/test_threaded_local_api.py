"""The harness's threaded variant: the real servers in a background thread with their
own loop, driven from synchronous code that calls ``asyncio.run`` itself (as the CLI
does), seeded with synchronous ``propose``."""

from __future__ import annotations

import asyncio
import json
import urllib.request

from lattice_common import commands as c
from lattice_common.proto.lattice import v1
from lattice_test_harness.local_api import ThreadedLocalApi


def test_threaded_local_api_serves_rest_and_grpc() -> None:
    with ThreadedLocalApi() as api:
        api.add_tenant("physics")
        res = api.propose(c.RegisterNode(node_id="n1", now=1.0))
        assert res.node is not None and res.node.id == "n1"
        req = urllib.request.Request(
            api.rest_url + "/api/v1/tenants", headers={"x-lattice-user": "alice"}
        )
        with urllib.request.urlopen(req, timeout=10) as r:
            assert [t["name"] for t in json.loads(r.read())["tenants"]] == ["physics"]

        async def nodes() -> list[str]:
            channel = api.channel()
            try:
                stub = v1.NodeServiceStub(channel, timeout=10)
                return [n.id for n in (await stub.list_nodes(v1.ListNodesRequest())).nodes]
            finally:
                channel.close()

        assert asyncio.run(nodes()) == ["n1"]
        assert api.requests[-1]["path"] == "/api/v1/tenants"


def test_local_api_fixture(local_api_thread) -> None:  # type: ignore[no-untyped-def]
    with urllib.request.urlopen(local_api_thread.rest_url + "/healthz", timeout=10) as r:
        assert json.loads(r.read())["status"] == "ok"
