"""Human identity with OIDC, end to end over real HTTP: the real REST and gRPC servers
(lattice_test_harness.local_api) validate tokens of a real-protocol fake identity
provider (lattice_test_harness.fake_idp: discovery, JWKS, RS256/ES256) with the
production validator (lattice_api.oidc). No part of the validation is mocked.

Accepted: a valid token, with the identity and the role of the specification's table.
Refused with 401 and a message saying what is wrong (never the token): another audience,
another issuer, an unpublished key, ``alg=none``, HS256 keyed with the IdP's RSA public
key, expired beyond the leeway. A key rotation at the IdP is picked up without a restart;
refreshes caused by unknown key ids are rate-limited; discovery redirects are not
followed; HS256 is accepted only with the configured secret.
"""

from __future__ import annotations

import logging
import time
from base64 import b64encode
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import jwt
import pytest
from lattice_api.settings import ApiSettings
from lattice_common.proto.lattice import v1
from lattice_test_harness.fake_idp import BAD_TOKEN_KINDS, FakeIdP
from lattice_test_harness.local_api import LocalApi, serve_local_api
from served_api import Grpc, Rest, grpc_error

pytestmark = pytest.mark.timeout(60)

SECRET = "break-glass-secret-that-is-long-enough!"


def bearer(token: str) -> dict[str, str]:
    return {"authorization": f"Bearer {token}"}


@pytest.fixture(scope="module")
def idp() -> Any:
    with FakeIdP(
        users={
            "alice": {"tenant": "physics"},
            "root": {"scope": "admin"},
            "pact": {"pact_role": "pact-platform-admin"},
            "ops": {"lattice_role": "operator", "scope": "readonly"},
        }
    ) as server:
        yield server


def served(idp: FakeIdP, **kw: Any) -> Any:
    settings = ApiSettings(oidc_issuer=idp.issuer, oidc_client_id="lattice")
    return serve_local_api(settings=settings, **kw)


@pytest.fixture
async def api(idp: FakeIdP) -> AsyncIterator[tuple[LocalApi, Rest]]:
    async with served(idp) as local, aiohttp.ClientSession() as session:
        yield local, Rest(session, local.rest_url)


async def whoami(rest: Rest, token: str) -> tuple[int, Any]:
    return await rest.call("GET", "/api/v1/auth/whoami", bearer(token))


# --- accepted ---------------------------------------------------------------------------


async def test_a_valid_token_gives_the_identity_and_role(api: Any, idp: FakeIdP) -> None:
    _local, rest = api
    status, me = await whoami(rest, idp.token("alice"))
    assert status == 200, me
    assert (me["user"], me["role"], me["tenant"], me["method"]) == (
        "alice",
        "user",
        "physics",
        "oidc",
    )
    assert time.time() < me["expires_at"] <= time.time() + idp.token_lifetime + 1


@pytest.mark.parametrize(
    ("user", "scope", "role"),
    [
        ("root", "", "system-admin"),  # scope admin
        ("alice", "openid tenant:admin", "tenant-admin"),
        ("pact", "", "system-admin"),  # pact_role claim
        ("ops", "", "readonly"),  # scopes first, then the role claims
        ("alice", "openid profile", "user"),
    ],
)
async def test_roles_follow_the_table(
    api: Any, idp: FakeIdP, user: str, scope: str, role: str
) -> None:
    _local, rest = api
    status, me = await whoami(rest, idp.token(user, scope=scope))
    assert status == 200 and me["role"] == role, me


async def test_grpc_takes_the_same_tokens(api: Any, idp: FakeIdP) -> None:
    local, _rest = api
    channel = local.channel()
    try:
        listed = await Grpc(channel, bearer(idp.token("root"))).admin.list_tenants(
            v1.ListTenantsRequest()
        )
        assert listed is not None
        status, err = await grpc_error(
            Grpc(channel, bearer(idp.bad_token("wrong_audience"))).admin.list_tenants(
                v1.ListTenantsRequest()
            )
        )
        assert status == "UNAUTHENTICATED" and "audience" in err["message"]
    finally:
        channel.close()


async def test_an_es256_key_works_too(api: Any, idp: FakeIdP) -> None:
    _local, rest = api
    kid = idp.add_key("ES256")
    status, me = await whoami(rest, idp.token("alice", kid=kid))
    assert status == 200 and me["user"] == "alice"
    idp.remove_key(kid)


async def test_tokens_from_the_token_endpoint_are_accepted(api: Any, idp: FakeIdP) -> None:
    """A token the IdP issued through a real grant (client credentials, a service)."""
    from lattice_test_harness.fake_idp import SERVICE_CLIENT, SERVICE_SECRET

    _local, rest = api
    basic = f"{SERVICE_CLIENT}:{SERVICE_SECRET}"
    async with rest.session.post(
        idp.metadata()["token_endpoint"],
        data={"grant_type": "client_credentials", "scope": "readonly"},
        headers={"Authorization": "Basic " + b64encode(basic.encode()).decode()},
    ) as r:
        assert r.status == 200
        issued = await r.json()
    status, me = await whoami(rest, issued["access_token"])
    assert status == 200 and (me["user"], me["role"]) == (SERVICE_CLIENT, "readonly")


# --- refused ------------------------------------------------------------------------------

EXPECTED = {
    "wrong_audience": "audience is not 'lattice'",
    "wrong_issuer": "issuer is not",
    "unknown_key": "is not published by the identity provider",
    "alg_none": "algorithm 'none' is not accepted",
    "hs256_public_key": "algorithm 'HS256' is not accepted",
    "expired": "token expired",
}


@pytest.mark.parametrize("kind", BAD_TOKEN_KINDS)
async def test_bad_tokens_are_refused_with_a_clear_message(
    api: Any, idp: FakeIdP, kind: str
) -> None:
    _local, rest = api
    bad = idp.bad_token(kind)
    status, body = await whoami(rest, bad)
    assert status == 401, body
    err = body["error"]
    assert err["code"] == "unauthenticated"
    assert EXPECTED[kind] in err["message"], err
    assert "lattice login" in err["hint"]
    assert bad not in str(body) and bad.split(".")[1] not in str(body)  # never echoed
    # and not the admin's data either
    status, _ = await rest.call("GET", "/api/v1/tenants", bearer(bad))
    assert status == 401


async def test_expiry_within_the_leeway_is_tolerated(api: Any, idp: FakeIdP) -> None:
    _local, rest = api
    status, _ = await whoami(rest, idp.token("alice", exp=int(time.time()) - 5))
    assert status == 200
    status, body = await whoami(rest, idp.token("alice", nbf=int(time.time()) + 600))
    assert status == 401 and "not valid yet" in body["error"]["message"]


async def test_missing_token_and_garbage(api: Any) -> None:
    _local, rest = api
    status, body = await rest.call("GET", "/api/v1/auth/whoami", {})
    assert status == 401 and body["error"]["message"] == "missing bearer token"
    status, body = await whoami(rest, "not.a.jwt")
    assert status == 401 and body["error"]["message"].startswith("invalid token")


# --- keys: rotation, rate limit, redirects -------------------------------------------------


async def test_key_rotation_is_picked_up_without_a_restart(idp: FakeIdP) -> None:
    async with served(idp) as local, aiohttp.ClientSession() as session:
        rest = Rest(session, local.rest_url)
        old_token = idp.token("alice")
        assert (await whoami(rest, old_token))[0] == 200
        fetched = idp.hits["/jwks"]
        old_kid = idp.signing_kid
        new_kid = idp.rotate()  # add a key, sign with it, unpublish the old one
        try:
            status, me = await whoami(rest, idp.token("alice"))
            assert status == 200 and me["user"] == "alice"
            assert idp.hits["/jwks"] == fetched + 1  # one refresh for the new kid
            assert new_kid in local.ops.auth.oidc.key_ids
            assert old_kid not in local.ops.auth.oidc.key_ids
            status, body = await whoami(rest, old_token)  # its key is gone
            assert status == 401 and "not published" in body["error"]["message"]
        finally:
            idp.use_key(idp.add_key("RS256"))
            idp.remove_key(new_kid)


async def test_unknown_key_refreshes_are_rate_limited(idp: FakeIdP) -> None:
    async with (
        served(idp, oidc_min_refresh_interval=60.0) as local,
        aiohttp.ClientSession() as session,
    ):
        rest = Rest(session, local.rest_url)
        before = idp.hits["/jwks"]
        for _ in range(5):
            status, _ = await whoami(rest, idp.bad_token("unknown_key"))
            assert status == 401
        assert idp.hits["/jwks"] == before  # the start-up fetch was < 60 s ago
        assert (await whoami(rest, idp.token("alice")))[0] == 200


async def test_discovery_redirects_are_not_followed(caplog: pytest.LogCaptureFixture) -> None:
    with FakeIdP(redirect_discovery=True) as evil:
        caplog.set_level(logging.ERROR, "lattice.api.oidc")
        async with served(evil) as local, aiohttp.ClientSession() as session:
            rest = Rest(session, local.rest_url)
            assert "redirects are not followed" in caplog.text
            status, body = await whoami(rest, evil.token("alice"))
            assert status == 503 and body["error"]["code"] == "unavailable"
            assert evil.hits["/jwks"] == 0


async def test_discovery_document_tells_the_cli_where_to_log_in(api: Any, idp: FakeIdP) -> None:
    _local, rest = api
    status, doc = await rest.call("GET", "/api/v1/auth/discovery", {})
    assert status == 200
    meta = idp.metadata()
    assert doc["issuer"] == doc["idp_url"] == idp.issuer
    assert doc["client_id"] == "lattice" and doc["mode"] == "oidc"
    for key in (
        "authorization_endpoint",
        "token_endpoint",
        "device_authorization_endpoint",
        "revocation_endpoint",
    ):
        assert doc[key] == meta[key]


# --- HS256: only with the secret ----------------------------------------------------------


async def test_hs256_needs_the_configured_secret(idp: FakeIdP) -> None:
    hs = jwt.encode({"sub": "bob", "exp": int(time.time()) + 60}, SECRET, algorithm="HS256")
    async with served(idp) as local, aiohttp.ClientSession() as session:
        status, body = await whoami(Rest(session, local.rest_url), hs)
        assert status == 401 and "'HS256' is not accepted" in body["error"]["message"]
    async with (
        served(idp, hmac_secret=SECRET) as local,
        aiohttp.ClientSession() as session,
    ):
        rest = Rest(session, local.rest_url)
        status, me = await whoami(rest, hs)
        assert status == 200 and (me["user"], me["method"]) == ("bob", "hmac")
        status, body = await whoami(rest, idp.bad_token("hs256_public_key"))
        assert status == 401 and "Signature verification failed" in body["error"]["message"]
        status, me = await whoami(rest, idp.token("alice"))  # JWKS still first
        assert status == 200 and me["method"] == "oidc"


async def test_dev_mode_whoami_and_discovery() -> None:
    async with serve_local_api() as local, aiohttp.ClientSession() as session:
        rest = Rest(session, local.rest_url)
        status, me = await rest.call("GET", "/api/v1/auth/whoami", {"x-lattice-user": "carol"})
        assert status == 200 and (me["user"], me["method"], me["expires_at"]) == (
            "carol",
            "none",
            None,
        )
        status, doc = await rest.call("GET", "/api/v1/auth/discovery", {})
        assert doc["mode"] == "none" and doc["issuer"] == "" and doc["token_endpoint"] == ""
