"""uenv at submit: the API resolves ``spec.uenv`` against the agents' registry (the real
REST and gRPC servers over a LocalQuorum), records the image's sha256 on the allocation,
and refuses unknown refs, unsigned images, a uenv where none is configured, and a view
without a uenv, each with a hint and nothing stored."""

from __future__ import annotations

import hashlib
import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from lattice_api.settings import ApiSettings
from lattice_common.proto.lattice import v1
from lattice_common.types import AllocationSpec
from lattice_common.uenv_registry import sign_index_entry
from lattice_common.wire import to_message
from lattice_test_harness.local_api import LocalApi, serve_local_api
from served_api import Grpc, Rest, grpc_error

pytestmark = pytest.mark.timeout(60)

ALICE = {"x-lattice-user": "alice"}
SHA_V1 = hashlib.sha256(b"v1").hexdigest()
SHA_V2 = hashlib.sha256(b"v2").hexdigest()
BODY = {"entrypoint": "make", "tenant": "physics", "vcluster": "batch", "walltime": "1h"}
ALLOCATIONS = "/api/v1/allocations"


def registry(root: Path, signatures: dict[str, str] | None = None) -> str:
    root.mkdir(parents=True, exist_ok=True)
    index: dict[str, Any] = {
        "prgenv-gnu/24.11:v1": {"file": "a.sqfs", "sha256": SHA_V1, "size": 2},
        "prgenv-gnu/24.7:v2": {"file": "b.sqfs", "sha256": SHA_V2, "size": 2},
    }
    for ref, sig in (signatures or {}).items():
        index[ref]["signature"] = sig
    (root / "index.json").write_text(json.dumps(index))
    return str(root)


async def serve(settings: ApiSettings) -> AsyncIterator[tuple[LocalApi, Rest]]:
    async with serve_local_api(settings=settings) as api:
        api.add_tenant("physics")
        api.add_vcluster("batch")
        api.add_node("n1")
        async with aiohttp.ClientSession() as session:
            yield api, Rest(session, api.rest_url)


@pytest.fixture
async def served(tmp_path: Path) -> AsyncIterator[tuple[LocalApi, Rest]]:
    async for x in serve(ApiSettings(uenv_registry=registry(tmp_path / "registry"))):
        yield x


async def test_the_resolved_image_is_recorded(served: tuple[LocalApi, Rest]) -> None:
    api, rest = served
    status, a = await rest.call(
        "POST", ALLOCATIONS, ALICE, {**BODY, "uenv": "prgenv-gnu/24.11", "view": "default"}
    )
    assert status == 201, a
    stored = api.quorum.state.allocations[a["id"]]
    assert stored.uenv_sha256 == SHA_V1
    assert (stored.spec.uenv, stored.spec.view) == ("prgenv-gnu/24.11:v1", "default")  # the tag
    assert a["uenv_sha256"] == SHA_V1
    # a task group: every task runs the same image
    status, out = await rest.call(
        "POST", ALLOCATIONS, ALICE, {**BODY, "uenv": "prgenv-gnu/24.7:v2", "task_group": "0-2"}
    )
    assert status == 201, out
    tasks = [api.quorum.state.allocations[i] for i in out["allocation_ids"]]
    assert [t.uenv_sha256 for t in tasks] == [SHA_V2] * 3


async def test_an_unknown_uenv_is_refused_with_the_versions(
    served: tuple[LocalApi, Rest],
) -> None:
    api, rest = served
    before = dict(api.quorum.state.allocations)
    status, err = await rest.call("POST", ALLOCATIONS, ALICE, {**BODY, "uenv": "prgenv-gnu/25.1"})
    assert status == 400
    assert err["error"]["message"] == (
        "uenv prgenv-gnu/25.1: not in the registry; available: "
        "prgenv-gnu/24.11:v1, prgenv-gnu/24.7:v2"
    )
    assert "prgenv-gnu/24.11:v1, prgenv-gnu/24.7:v2" in err["error"]["hint"]
    status, err = await rest.call("POST", ALLOCATIONS, ALICE, {**BODY, "uenv": "cuda/12:v1"})
    assert status == 400 and "no uenv named 'cuda'" in err["error"]["message"]
    assert "prgenv-gnu" in err["error"]["hint"]
    status, err = await rest.call("POST", ALLOCATIONS, ALICE, {**BODY, "uenv": "no version"})
    assert status == 400 and "name/version[:tag]" in err["error"]["message"]
    assert err["error"]["hint"]
    # gRPC answers the same
    spec = AllocationSpec(
        entrypoint="make",
        tenant="physics",
        vcluster="batch",
        uenv="prgenv-gnu/25.1",
        walltime_seconds=3600,
    )
    channel = api.channel()
    try:
        code, body = await grpc_error(
            Grpc(channel, ALICE).alloc.submit(
                v1.SubmitRequest(allocation=to_message(spec, v1.AllocationSpec))
            )
        )
    finally:
        channel.close()
    assert code == "INVALID_ARGUMENT" and "available: prgenv-gnu/24.11:v1" in body["message"]
    assert api.quorum.state.allocations == before  # nothing stored


async def test_a_view_needs_a_uenv(served: tuple[LocalApi, Rest]) -> None:
    api, rest = served
    status, err = await rest.call("POST", ALLOCATIONS, ALICE, {**BODY, "view": "default"})
    assert status == 400
    assert err["error"]["message"] == "view 'default' given without a uenv"
    assert "--uenv=NAME/VERSION[:TAG]" in err["error"]["hint"]
    status, err = await rest.call(
        "POST", ALLOCATIONS, ALICE, {**BODY, "uenv": "prgenv-gnu/24.11:v1", "view": "a b"}
    )
    assert status == 400 and "invalid uenv view" in err["error"]["message"]
    assert not api.quorum.state.allocations


async def test_no_registry_no_uenv() -> None:
    async for api, rest in serve(ApiSettings()):
        status, err = await rest.call(
            "POST", ALLOCATIONS, ALICE, {**BODY, "uenv": "prgenv-gnu/24.11:v1"}
        )
        assert status == 400
        assert err["error"]["message"] == "uenv is not enabled on this cluster"
        assert "node_agent.uenv_registry" in err["error"]["hint"]
        # sessions are refused the same way
        status, err = await rest.call(
            "POST", "/api/v1/sessions", ALICE, {**BODY, "uenv": "prgenv-gnu/24.11:v1"}
        )
        assert status == 400 and "not enabled" in err["error"]["message"]
        status, a = await rest.call("POST", ALLOCATIONS, ALICE, BODY)  # without: accepted
        assert status == 201 and api.quorum.state.allocations[a["id"]].uenv_sha256 == ""


async def test_a_signed_registry_refuses_unsigned_images(tmp_path: Path) -> None:
    key = Ed25519PrivateKey.generate()
    pem = key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )
    public = tmp_path / "site.pub"
    public.write_bytes(
        key.public_key().public_bytes(
            serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
        )
    )
    root = registry(tmp_path / "r", {"prgenv-gnu/24.11:v1": sign_index_entry(pem, SHA_V1)})
    settings = ApiSettings(uenv_registry=root, uenv_signing_key=str(public))
    async for api, rest in serve(settings):
        status, a = await rest.call(
            "POST", ALLOCATIONS, ALICE, {**BODY, "uenv": "prgenv-gnu/24.11:v1"}
        )
        assert status == 201 and api.quorum.state.allocations[a["id"]].uenv_sha256 == SHA_V1
        status, err = await rest.call(
            "POST", ALLOCATIONS, ALICE, {**BODY, "uenv": "prgenv-gnu/24.7:v2"}
        )
        assert status == 400
        assert err["error"]["message"] == "uenv prgenv-gnu/24.7:v2: signature missing"
        assert "sign" in err["error"]["hint"]


async def test_an_unreachable_registry_is_unavailable(tmp_path: Path) -> None:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{s.getsockname()[1]}"
    async for api, rest in serve(ApiSettings(uenv_registry=url)):
        status, err = await rest.call(
            "POST", ALLOCATIONS, ALICE, {**BODY, "uenv": "prgenv-gnu/24.11:v1"}
        )
        assert status == 503
        assert err["error"]["message"].startswith(f"uenv registry {url} unreachable: ")
        assert not api.quorum.state.allocations


async def test_sessions_and_dag_members_record_the_resolved_image(
    served: tuple[LocalApi, Rest],
) -> None:
    api, rest = served
    status, s = await rest.call(
        "POST", "/api/v1/sessions", ALICE, {**BODY, "uenv": "prgenv-gnu/24.11"}
    )
    assert status == 201, s
    stored = api.quorum.state.allocations[s["allocation_id"]]
    assert (stored.spec.uenv, stored.uenv_sha256) == ("prgenv-gnu/24.11:v1", SHA_V1)

    member = {"entrypoint": "make", "walltime": "1h"}
    dag = {
        "name": "pipeline",
        "tenant": "physics",
        "vcluster": "batch",
        "allocations": [
            {**member, "id": "build", "uenv": "prgenv-gnu/24.7:v2"},
            {**member, "id": "plain", "depends_on": [{"ref": "build", "condition": "success"}]},
        ],
    }
    status, out = await rest.call("POST", "/api/v1/dags", ALICE, dag)
    assert status == 201, out
    by_ref = {a["dag_ref"]: api.quorum.state.allocations[a["id"]] for a in out["allocations"]}
    assert by_ref["build"].uenv_sha256 == SHA_V2 and by_ref["plain"].uenv_sha256 == ""
    # an unknown uenv in one member refuses the whole DAG, nothing stored
    before = len(api.quorum.state.allocations)
    bad = {**dag, "allocations": [{**member, "id": "x", "uenv": "nope/1.0"}]}
    status, err = await rest.call("POST", "/api/v1/dags", ALICE, bad)
    assert status == 400 and "nope/1.0" in err["error"]["message"], err
    assert len(api.quorum.state.allocations) == before
