"""Authentication (dev header, HS256 bearer tokens, agent token), role derivation from
the specification's Roles table, and the roles of each permission (lattice_api.permissions)."""

from __future__ import annotations

import time
from typing import Any

import jwt
import pytest
from lattice_api.auth import Authenticator, Identity, Role, role_from_claims
from lattice_api.permissions import ROLES, authorize
from lattice_common.errors import PermissionDenied, Unauthenticated

SECRET = "dev-secret-that-is-long-enough-for-hs256!"
AGENT_TOKEN = "agent-token-0123456789"


def token(claims: dict[str, Any] | None = None, *, secret: str = SECRET, **kw: Any) -> str:
    payload: dict[str, Any] = {"sub": "alice", "exp": int(time.time()) + 3600}
    payload.update(claims or {})
    payload.update(kw)
    return jwt.encode(payload, secret, algorithm="HS256")


def bearer(tok: str) -> dict[str, str]:
    return {"authorization": f"Bearer {tok}"}


@pytest.fixture
def auth() -> Authenticator:
    return Authenticator(hmac_secret=SECRET, agent_token=AGENT_TOKEN)


# --- dev mode ------------------------------------------------------------------------


def test_dev_mode_identity_from_header() -> None:
    a = Authenticator()
    assert a.dev_mode
    who = a.authenticate({"x-lattice-user": "bob", "x-lattice-tenant": "physics"})
    assert (who.user, who.role, who.tenant) == ("bob", Role.SYSTEM_ADMIN, "physics")
    assert a.authenticate({"X-Lattice-User": "carol"}).user == "carol"
    assert a.authenticate({}).user == "anonymous"


def test_empty_secret_means_dev_mode() -> None:
    assert Authenticator(hmac_secret="").dev_mode


def test_dev_mode_still_recognises_the_agent_token() -> None:
    a = Authenticator(agent_token=AGENT_TOKEN)
    assert a.authenticate(bearer(AGENT_TOKEN)).role == Role.AGENT


# --- tokens --------------------------------------------------------------------------


def test_valid_token_is_accepted(auth: Authenticator) -> None:
    assert not auth.dev_mode
    who = auth.authenticate(bearer(token(tenant="physics")))
    assert (who.user, who.role, who.tenant) == ("alice", Role.USER, "physics")


def test_bearer_prefix_is_case_insensitive_and_header_name_too(auth: Authenticator) -> None:
    tok = token()
    assert auth.authenticate({"authorization": f"bearer {tok}"}).user == "alice"
    assert auth.authenticate({"Authorization": f"BEARER  {tok} "}).user == "alice"


def test_dev_header_is_ignored_when_a_secret_is_configured(auth: Authenticator) -> None:
    with pytest.raises(Unauthenticated):
        auth.authenticate({"x-lattice-user": "root"})
    who = auth.authenticate({**bearer(token()), "x-lattice-user": "root"})
    assert who.user == "alice"


@pytest.mark.parametrize(
    "headers",
    [
        {},
        {"authorization": ""},
        {"authorization": "Basic YWxpY2U6cHc="},
        {"authorization": "Bearer "},
    ],
)
def test_missing_token(auth: Authenticator, headers: dict[str, str]) -> None:
    with pytest.raises(Unauthenticated) as ei:
        auth.authenticate(headers)
    assert ei.value.message == "missing bearer token"
    assert "lattice login" in ei.value.hint


def test_wrong_secret(auth: Authenticator) -> None:
    with pytest.raises(Unauthenticated) as ei:
        auth.authenticate(bearer(token(secret="another-secret-that-is-long-enough-too!")))
    assert ei.value.message.startswith("invalid token")
    assert "lattice login" in ei.value.hint


def test_expired_token(auth: Authenticator) -> None:
    with pytest.raises(Unauthenticated) as ei:
        auth.authenticate(bearer(token(exp=int(time.time()) - 60)))
    assert ei.value.message == "token expired"
    assert "lattice login" in ei.value.hint


@pytest.mark.parametrize(
    "bad",
    [
        "not-a-jwt",
        "a.b.c",
        # unsigned token (alg=none) with a valid-looking payload
        jwt.encode({"sub": "root", "scope": "admin"}, key=None, algorithm="none"),
    ],
    ids=["garbage", "three-parts", "alg-none"],
)
def test_malformed_or_unsigned_tokens(auth: Authenticator, bad: str) -> None:
    with pytest.raises(Unauthenticated) as ei:
        auth.authenticate(bearer(bad))
    assert ei.value.hint


@pytest.mark.filterwarnings("ignore:The HMAC key")
def test_token_signed_with_another_algorithm_is_rejected(auth: Authenticator) -> None:
    tok = jwt.encode({"sub": "alice"}, SECRET, algorithm="HS512")
    with pytest.raises(Unauthenticated):
        auth.authenticate(bearer(tok))


def test_token_without_subject_is_rejected(auth: Authenticator) -> None:
    tok = jwt.encode({"scope": "admin"}, SECRET, algorithm="HS256")
    with pytest.raises(Unauthenticated) as ei:
        auth.authenticate(bearer(tok))
    assert "sub" in ei.value.message


def test_agent_token(auth: Authenticator) -> None:
    who = auth.authenticate(bearer(AGENT_TOKEN))
    assert (who.user, who.role) == ("lattice-agent", Role.AGENT)
    with pytest.raises(Unauthenticated):
        auth.authenticate(bearer(AGENT_TOKEN + "x"))


def test_agent_role_claim_in_a_signed_token(auth: Authenticator) -> None:
    assert auth.authenticate(bearer(token(lattice_role="agent"))).role == Role.AGENT


# --- roles (spec: "Roles" table; scopes first, then pact_role/lattice_role) ----------


@pytest.mark.parametrize(
    ("claims", "role"),
    [
        ({}, Role.USER),
        ({"scope": "openid profile email"}, Role.USER),
        ({"scope": "admin"}, Role.SYSTEM_ADMIN),
        ({"scope": "openid system:admin"}, Role.SYSTEM_ADMIN),
        ({"scope": "tenant:admin"}, Role.TENANT_ADMIN),
        ({"scope": "operator"}, Role.OPERATOR),
        ({"scope": "sensitive:claim"}, Role.CLAIMING_USER),
        ({"scope": "readonly"}, Role.READ_ONLY),
        ({"scp": "operator"}, Role.OPERATOR),
        ({"pact_role": "pact-platform-admin"}, Role.SYSTEM_ADMIN),
        ({"pact_role": "system-admin"}, Role.SYSTEM_ADMIN),
        ({"lattice_role": "system-admin"}, Role.SYSTEM_ADMIN),
        ({"lattice_role": "tenant-admin"}, Role.TENANT_ADMIN),
        ({"pact_role": "tenant-admin"}, Role.TENANT_ADMIN),
        ({"lattice_role": "operator"}, Role.OPERATOR),
        ({"pact_role": "operator"}, Role.OPERATOR),
        # the table has no cross-system claim for ClaimingUser and ReadOnly
        ({"lattice_role": "claiming-user"}, Role.USER),
        ({"pact_role": "readonly"}, Role.USER),
        ({"lattice_role": "root"}, Role.USER),
        # scopes are checked first
        ({"scope": "readonly", "pact_role": "pact-platform-admin"}, Role.READ_ONLY),
        ({"scope": "operator", "lattice_role": "system-admin"}, Role.OPERATOR),
        # unknown scopes fall through to the claims
        ({"scope": "openid", "lattice_role": "tenant-admin"}, Role.TENANT_ADMIN),
        # scope names must match exactly
        ({"scope": "Admin"}, Role.USER),
        ({"scope": "administrator"}, Role.USER),
    ],
)
def test_role_from_claims(claims: dict[str, Any], role: Role) -> None:
    assert role_from_claims(claims) == role


def test_scp_claim_as_a_list() -> None:
    assert role_from_claims({"scp": ["openid", "operator"]}) == Role.OPERATOR


def test_roles_reach_the_identity(auth: Authenticator) -> None:
    assert auth.authenticate(bearer(token(scope="readonly"))).role == Role.READ_ONLY
    assert auth.authenticate(bearer(token(pact_role="pact-platform-admin"))).role == (
        Role.SYSTEM_ADMIN
    )


# --- RBAC ----------------------------------------------------------------------------


def who(role: Role) -> Identity:
    return Identity("u", role)


def denied(role: Role, op: str) -> PermissionDenied:
    with pytest.raises(PermissionDenied) as ei:
        authorize(who(role), op)
    assert ei.value.hint
    assert op in ei.value.message
    return ei.value


def test_readonly_cannot_submit_or_cancel_but_can_read() -> None:
    denied(Role.READ_ONLY, "allocation.submit")
    denied(Role.READ_ONLY, "allocation.cancel")
    denied(Role.READ_ONLY, "node.admin")
    for op in ("allocation.read", "allocation.list_all", "node.read", "tenant.read", "raft.read"):
        authorize(who(Role.READ_ONLY), op)


def test_user_can_submit_but_not_administer() -> None:
    authorize(who(Role.USER), "allocation.submit")
    authorize(who(Role.USER), "allocation.cancel")
    authorize(who(Role.USER), "node.read")
    e = denied(Role.USER, "tenant.admin")
    assert "user" in e.message
    denied(Role.USER, "node.admin")
    denied(Role.USER, "vcluster.admin")
    denied(Role.USER, "allocation.list_all")


def test_operator_can_administer_nodes_but_not_tenants() -> None:
    authorize(who(Role.OPERATOR), "node.admin")
    denied(Role.OPERATOR, "tenant.admin")
    denied(Role.OPERATOR, "vcluster.admin")


def test_system_admin_can_do_everything() -> None:
    for op in [*ROLES, "some.future.operation"]:
        authorize(who(Role.SYSTEM_ADMIN), op)


def test_unknown_operations_need_system_admin() -> None:
    for role in Role:
        if role != Role.SYSTEM_ADMIN:
            denied(role, "some.future.operation")


def test_agent_is_limited_to_agent_operations() -> None:
    authorize(who(Role.AGENT), "node.agent")
    authorize(who(Role.AGENT), "allocation.read")
    denied(Role.AGENT, "allocation.submit")
    denied(Role.AGENT, "tenant.read")
    for role in Role:
        if role not in (Role.AGENT, Role.SYSTEM_ADMIN):
            denied(role, "node.agent")


def test_claiming_user_is_a_user() -> None:
    authorize(who(Role.CLAIMING_USER), "allocation.submit")
    denied(Role.CLAIMING_USER, "node.admin")


def test_verified_tokens_are_cached_but_never_past_a_rotation_or_their_expiry() -> None:
    auth = Authenticator(hmac_secret=SECRET)
    t = token({"sub": "alice", "exp": int(time.time()) + 600})
    headers = {"authorization": f"Bearer {t}"}
    first = auth.authenticate(headers)
    assert auth.authenticate(headers) is first  # the signature is not checked again
    auth.set_hmac_secret("another-secret-that-is-long-enough-for-hs256")
    with pytest.raises(Unauthenticated):  # the rotation drops what the old secret signed
        auth.authenticate(headers)
    auth.set_hmac_secret(SECRET)
    short = token({"sub": "bob", "exp": int(time.time()) + 1})
    assert auth.authenticate({"authorization": f"Bearer {short}"}).user == "bob"
    assert auth._verified[short][1] <= time.time() + 1  # cached until its exp at most
