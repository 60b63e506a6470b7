"""Secret references (lattice_common.secrets): env://, file://, vault:// against a real
OpenBao dev server (the ``openbao`` fixture of lattice_test_harness), refusals, rotation,
and that no value leaks into a repr, an error message or a log line."""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

import pytest
from lattice_common.config import SecretsConfig, is_config_env, load_config
from lattice_common.errors import LatticeError
from lattice_common.secrets import (
    SecretError,
    SecretResolver,
    SecretUnavailable,
    is_reference,
    parse_ref,
)
from pydantic import SecretStr

VALUE = "hmac-value-7f3a9c0e2b"


def secret_file(tmp_path: Path, value: str = VALUE, mode: int = 0o600) -> Path:
    p = tmp_path / "secret"
    p.write_text(value + "\n")
    p.chmod(mode)
    return p


def assert_clean(err: BaseException, *values: str) -> None:
    text = f"{err} {err!r}"
    if isinstance(err, LatticeError):
        text += " " + err.render() + " " + repr(err.to_dict())
    for v in values:
        assert v not in text


# --- parsing ---------------------------------------------------------------------------


def test_parse_refs() -> None:
    assert parse_ref("env://LATTICE_X").path == "LATTICE_X"
    assert parse_ref("file:///etc/lattice/key").path == "/etc/lattice/key"
    r = parse_ref("vault://secret/lattice/api#hmac")
    assert (r.scheme, r.path, r.key) == ("vault", "secret/lattice/api", "hmac")
    assert str(r) == "vault://secret/lattice/api#hmac"
    assert is_reference("vault://x") and is_reference(SecretStr("file:///a"))
    assert not is_reference("plain-secret") and not is_reference(None)


@pytest.mark.parametrize(
    ("ref", "words"),
    [
        ("s3://bucket/key", "unknown secret reference scheme 's3'"),
        ("file://relative/path", "not an absolute path"),
        ("env://BAD-NAME", "invalid environment variable name"),
        ("vault://#key", "invalid Vault path"),
        ("vault://a/../b#k", "invalid Vault path"),
    ],
)
def test_bad_references_refused(ref: str, words: str) -> None:
    with pytest.raises(SecretError) as e:
        SecretResolver().resolve(ref)
    assert words in e.value.message
    assert e.value.hint


# --- env:// and file:// ---------------------------------------------------------------


def test_plain_value_stays() -> None:
    got = SecretResolver().resolve("just-a-secret")
    assert isinstance(got, SecretStr) and got.get_secret_value() == "just-a-secret"
    assert VALUE not in repr(SecretResolver().resolve(VALUE))


def test_env_reference() -> None:
    r = SecretResolver(env={"MY_TOKEN": VALUE})
    assert r.resolve("env://MY_TOKEN").get_secret_value() == VALUE
    with pytest.raises(SecretError) as e:
        r.resolve("env://NOT_SET")
    assert "environment variable NOT_SET" in e.value.message and "is not set" in e.value.message


def test_reference_to_reference_refused() -> None:
    with pytest.raises(SecretError, match="resolves to another reference"):
        SecretResolver(env={"A": "env://B", "B": VALUE}).resolve("env://A")


def test_file_reference(tmp_path: Path) -> None:
    p = secret_file(tmp_path)
    assert SecretResolver().resolve(f"file://{p}").get_secret_value() == VALUE


@pytest.mark.parametrize("mode", [0o644, 0o640, 0o604, 0o660])
def test_file_open_to_others_refused(tmp_path: Path, mode: int) -> None:
    p = secret_file(tmp_path, mode=mode)
    with pytest.raises(SecretError) as e:
        SecretResolver().resolve(f"file://{p}")
    assert "accessible by group or others" in e.value.message
    assert f"chmod 600 {p}" in e.value.hint
    assert_clean(e.value, VALUE)


def test_file_missing_or_empty(tmp_path: Path) -> None:
    with pytest.raises(SecretError, match="does not exist"):
        SecretResolver().resolve(f"file://{tmp_path}/nope")
    p = secret_file(tmp_path, value="")
    with pytest.raises(SecretError, match="is empty"):
        SecretResolver().resolve(f"file://{p}")


# --- the config ------------------------------------------------------------------------


def test_config_fields_take_references(tmp_path: Path) -> None:
    p = secret_file(tmp_path)
    env = {
        "LATTICE_OIDC_HMAC_SECRET": f"file://{p}",
        "LATTICE_AGENT_TOKEN": "env://AGENT_TOK",
        "AGENT_TOK": "agent-" + VALUE,
        "LATTICE_FABRIC_MANAGER_TOKEN": "plain-fm-token",
    }
    cfg = load_config(None, env=env)
    assert cfg.api.oidc_hmac_secret.get_secret_value() == VALUE
    assert cfg.api.agent_token.get_secret_value() == "agent-" + VALUE
    assert cfg.network.fabric_manager_token.get_secret_value() == "plain-fm-token"
    assert cfg.secret_refs == {
        "api.oidc_hmac_secret": f"file://{p}",
        "api.agent_token": "env://AGENT_TOK",
    }
    for text in (repr(cfg), str(cfg), cfg.model_dump_json(), repr(cfg.api)):
        assert VALUE not in text and "plain-fm-token" not in text
    # a variable named by an env:// reference is not passed on to jobs
    assert is_config_env("AGENT_TOK") and is_config_env("VAULT_SECRET_ID")
    assert not is_config_env("HOME")


def test_waldur_token_secret_ref_fills_the_token(tmp_path: Path) -> None:
    p = secret_file(tmp_path)
    cfg = load_config(None, env={"LATTICE_ACCOUNTING__WALDUR_TOKEN_SECRET_REF": f"file://{p}"})
    assert cfg.accounting.waldur_token.get_secret_value() == VALUE
    assert cfg.secret_refs == {"accounting.waldur_token": f"file://{p}"}


def test_config_refusal_names_the_field_not_the_value(tmp_path: Path) -> None:
    p = secret_file(tmp_path, mode=0o644)
    with pytest.raises(SecretError) as e:
        load_config(None, env={"LATTICE_AGENT_TOKEN": f"file://{p}"})
    assert e.value.message.startswith("api.agent_token: secret file")
    assert e.value.details["key"] == "api.agent_token"
    assert_clean(e.value, VALUE)


def test_unresolved_load_keeps_references() -> None:
    cfg = load_config(None, env={"LATTICE_AGENT_TOKEN": "vault://x/y"}, resolve_secrets=False)
    assert cfg.api.agent_token.get_secret_value() == "vault://x/y" and cfg.secret_refs == {}


# --- rotation (file) -------------------------------------------------------------------


async def test_rotation_of_a_file_is_picked_up(tmp_path: Path) -> None:
    p = secret_file(tmp_path)
    r = SecretResolver(SecretsConfig(refresh_interval_seconds=0.05))
    seen: list[str] = []
    current = r.resolve(f"file://{p}")
    r.watch(f"file://{p}", lambda v: seen.append(v.get_secret_value()), current)
    assert await r.refresh() == []  # unchanged
    p.write_text("rotated-" + VALUE)
    assert await r.refresh() == [f"file://{p}"]
    assert seen == ["rotated-" + VALUE]
    # the polling loop does the same by itself
    r.start()
    try:
        p.write_text("third-" + VALUE)
        for _ in range(100):
            if len(seen) == 2:
                break
            await _sleep(0.02)
        assert seen[-1] == "third-" + VALUE
    finally:
        await r.stop()


async def test_failed_refresh_keeps_old_value_and_logs_no_secret(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    p = secret_file(tmp_path)
    r = SecretResolver()
    seen: list[str] = []
    r.watch(f"file://{p}", lambda v: seen.append(v.get_secret_value()), r.resolve(f"file://{p}"))
    p.write_text("new-" + VALUE)
    p.chmod(0o644)  # now refused: the old value stays in use
    with caplog.at_level(logging.DEBUG, logger="lattice.secrets"):
        assert await r.refresh() == []
    assert seen == [] and "cannot refresh secret" in caplog.text
    assert VALUE not in caplog.text


async def _sleep(s: float) -> None:
    import asyncio

    await asyncio.sleep(s)


# --- vault:// against a real OpenBao ----------------------------------------------------


def vault_cfg(bao: Any, **kw: Any) -> SecretsConfig:
    return SecretsConfig(vault_address=bao.address, vault_role_id=bao.role_id, **kw)


def test_vault_kv2_with_approle(openbao: Any, caplog: pytest.LogCaptureFixture) -> None:
    openbao.put("lattice/api", hmac=VALUE, other="x")
    secret_id = openbao.secret_id()
    r = SecretResolver(vault_cfg(openbao), env={"VAULT_SECRET_ID": secret_id})
    with caplog.at_level(logging.DEBUG):
        assert r.resolve("vault://secret/lattice/api#hmac").get_secret_value() == VALUE
    # the mount from the config and a prefix: the specification's short form
    openbao.put("lattice/prod/waldur-token", token="w-" + VALUE)
    r2 = SecretResolver(
        vault_cfg(openbao, vault_kv_mount="secret", vault_path_prefix="lattice/prod"),
        env={"VAULT_SECRET_ID": secret_id},
    )
    assert r2.resolve("vault://waldur-token").get_secret_value() == "w-" + VALUE  # one key
    for text in (caplog.text, repr(r), repr(r2)):
        assert VALUE not in text and secret_id not in text


def test_vault_refusals(openbao: Any) -> None:
    openbao.put("lattice/api", hmac=VALUE, other="x")
    secret_id = openbao.secret_id()
    r = SecretResolver(vault_cfg(openbao), env={"VAULT_SECRET_ID": secret_id})
    with pytest.raises(SecretError) as e:
        r.resolve("vault://secret/lattice/api#nope")
    assert "key 'nope' not in secret" in e.value.message and "hmac, other" in e.value.hint
    with pytest.raises(SecretError) as e:
        r.resolve("vault://secret/lattice/api")
    assert "holds 2 keys" in e.value.message
    with pytest.raises(SecretError, match="not found"):
        r.resolve("vault://secret/lattice/missing#k")
    with pytest.raises(SecretUnavailable) as e:  # outside the role's policy
        r.resolve("vault://secret/elsewhere#k")
    assert "permission denied" in e.value.message
    for err in (e.value,):
        assert_clean(err, VALUE, secret_id)


def test_vault_wrong_secret_id_and_missing_one(openbao: Any) -> None:
    openbao.put("lattice/api", hmac=VALUE)
    wrong = "0000-wrong-secret-id-1234"
    r = SecretResolver(vault_cfg(openbao), env={"VAULT_SECRET_ID": wrong})
    with pytest.raises(SecretUnavailable) as e:
        r.resolve("vault://secret/lattice/api#hmac")
    assert "AppRole login" in e.value.message and "refused (HTTP 400)" in e.value.message
    assert "invalid role or secret ID" in e.value.message
    assert_clean(e.value, VALUE, wrong)
    with pytest.raises(SecretError, match="VAULT_SECRET_ID"):
        SecretResolver(vault_cfg(openbao), env={}).resolve("vault://secret/lattice/api#hmac")


def test_vault_down_is_a_clear_error() -> None:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cfg = SecretsConfig(
        vault_address=f"http://127.0.0.1:{port}", vault_role_id="role", timeout_seconds=1
    )
    r = SecretResolver(cfg, env={"VAULT_SECRET_ID": "sid-" + VALUE})
    t0 = time.monotonic()
    with pytest.raises(SecretUnavailable) as e:
        r.resolve("vault://secret/lattice/api#hmac")
    assert time.monotonic() - t0 < 5
    assert f"secrets manager at http://127.0.0.1:{port} is unreachable" in e.value.message
    assert "secrets.vault_address" in e.value.hint
    assert_clean(e.value, VALUE)
    # and through the config: the field is named, nothing else
    with pytest.raises(SecretUnavailable) as e:
        load_config(
            None,
            env={
                "LATTICE_OIDC_HMAC_SECRET": "vault://secret/lattice/api#hmac",
                "LATTICE_SECRETS__VAULT_ADDRESS": cfg.vault_address,
                "LATTICE_SECRETS__VAULT_ROLE_ID": "role",
                "LATTICE_SECRETS__TIMEOUT_SECONDS": "1",
                "VAULT_SECRET_ID": "sid-" + VALUE,
            },
        )
    assert e.value.message.startswith("api.oidc_hmac_secret: secrets manager")
    assert_clean(e.value, VALUE)


def test_vault_token_expiry_logs_in_again(openbao: Any) -> None:
    openbao.set_role(token_ttl="2s", token_max_ttl="3s")
    openbao.put("lattice/api", hmac=VALUE)
    r = SecretResolver(vault_cfg(openbao), env={"VAULT_SECRET_ID": openbao.secret_id()})
    assert r.resolve("vault://secret/lattice/api#hmac").get_secret_value() == VALUE
    vault = r._vault
    assert vault is not None
    first = vault._token
    time.sleep(3.2)  # past the token's max TTL: renewal cannot help, a new login does
    assert r.resolve("vault://secret/lattice/api#hmac").get_secret_value() == VALUE
    assert vault._token is not None and first is not None
    assert vault._token.get_secret_value() != first.get_secret_value()
    # a token revoked behind our back (403) -> one new login, then the read succeeds
    status, _ = openbao.call(
        "POST", "/v1/auth/token/revoke-self", {}, token=vault._token.get_secret_value()
    )
    assert status in (200, 204)
    vault._expires = 0.0  # "never expires": only the server's 403 tells
    assert r.resolve("vault://secret/lattice/api#hmac").get_secret_value() == VALUE


async def test_vault_rotation_new_version_picked_up(openbao: Any) -> None:
    openbao.put("lattice/api", hmac=VALUE)
    r = SecretResolver(
        vault_cfg(openbao, refresh_interval_seconds=0.05),
        env={"VAULT_SECRET_ID": openbao.secret_id()},
    )
    ref = "vault://secret/lattice/api#hmac"
    seen: list[str] = []
    r.watch(ref, lambda v: seen.append(v.get_secret_value()), r.resolve(ref))
    r.start()
    try:
        assert openbao.put("lattice/api", hmac="v2-" + VALUE) == 2
        for _ in range(200):
            if seen:
                break
            await _sleep(0.02)
        assert seen == ["v2-" + VALUE]
    finally:
        await r.stop()


def test_log_lines_mask_known_secrets(tmp_path: Path) -> None:
    from lattice_common.logging import JsonFormatter

    p = secret_file(tmp_path, value="masked-" + VALUE)
    SecretResolver().resolve(f"file://{p}")
    record = logging.LogRecord(
        "x", logging.INFO, __file__, 1, "header authorization=Bearer %s", ("masked-" + VALUE,), None
    )
    line = JsonFormatter("test").format(record)
    assert "masked-" + VALUE not in line and "Bearer **********" in line


def test_vault_token_renewed_before_it_expires(openbao: Any) -> None:
    openbao.set_role(token_ttl="3s", token_max_ttl="60s")
    openbao.put("lattice/api", hmac=VALUE)
    r = SecretResolver(vault_cfg(openbao), env={"VAULT_SECRET_ID": openbao.secret_id()})
    assert r.resolve("vault://secret/lattice/api#hmac").get_secret_value() == VALUE
    vault = r._vault
    assert vault is not None and vault._token is not None and vault._renewable
    first = vault._token.get_secret_value()
    time.sleep(2.2)  # under a third of the TTL left: renew-self, same token
    assert r.resolve("vault://secret/lattice/api#hmac").get_secret_value() == VALUE
    assert vault._token.get_secret_value() == first
    assert vault._expires - time.monotonic() > 2
