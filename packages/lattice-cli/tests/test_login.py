"""``lattice login`` / ``logout`` / ``whoami`` against a real-protocol identity provider
(lattice_test_harness.fake_idp, Authlib) and the real API validating its tokens (JWKS),
over real HTTP: authorization code + PKCE through the loopback listener (the "browser"
fetches the URL with urllib and follows the IdP's redirect), the device flow approved by
the test, then ordinary commands with the cached token; the token file's mode and its
repair; silent refresh with the refresh token; the ``lattice login`` hint when the token
cannot be refreshed; logout with revocation."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from lattice_api.settings import ApiSettings
from lattice_cli import auth
from lattice_cli.commands.whoami import whoami_text
from lattice_cli.main import app, load_commands
from lattice_test_harness.fake_idp import FakeIdP
from lattice_test_harness.local_api import LocalApi, ThreadedLocalApi
from typer.testing import CliRunner

load_commands()
pytestmark = pytest.mark.timeout(60)


def run(*args: str) -> Any:
    return CliRunner().invoke(app, list(args), catch_exceptions=False)


@pytest.fixture(scope="module")
def idp() -> Iterator[FakeIdP]:
    with FakeIdP(device_interval=0.05, users={"alice": {"tenant": "physics"}}) as server:
        yield server


@pytest.fixture
def oidc_api(idp: FakeIdP, clean_env: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[LocalApi]:
    """The real API validating the fake IdP's tokens, LATTICE_ENDPOINT pointing at it."""
    settings = ApiSettings(oidc_issuer=idp.issuer, oidc_client_id="lattice")
    with ThreadedLocalApi(settings=settings) as server:
        monkeypatch.setenv("LATTICE_ENDPOINT", server.rest_url)
        server.add_tenant("physics")
        server.add_vcluster("gpu")
        yield server


@pytest.fixture
def browser(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """webbrowser.open replaced by a user agent that loads the URL (following the IdP's
    redirect to the CLI's loopback listener), as a browser would."""
    opened: list[str] = []

    def open_url(url: str, *a: Any, **kw: Any) -> bool:
        opened.append(url)
        with urllib.request.urlopen(url, timeout=10) as resp:
            assert resp.status == 200
        return True

    monkeypatch.setattr("webbrowser.open", open_url)
    return opened


def token_file(env: Path) -> Path:
    return env / "xdg" / "lattice" / "tokens.json"


def cached(env: Path, server: str) -> dict[str, Any]:
    return json.loads(token_file(env).read_text())["servers"][server]


def write_entry(env: Path, server: str, entry: dict[str, Any], mode: int = 0o600) -> None:
    path = token_file(env)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"servers": {server: entry}}))
    os.chmod(path, mode)


def entry_for(idp: FakeIdP, token: str, refresh: str = "") -> dict[str, Any]:
    meta = idp.metadata()
    return {
        "access_token": token,
        "refresh_token": refresh,
        "expires_at": auth.jwt_expiry(token),
        "issuer": idp.issuer,
        "client_id": "lattice",
        "token_endpoint": meta["token_endpoint"],
        "revocation_endpoint": meta["revocation_endpoint"],
    }


# --- login ------------------------------------------------------------------------------------


def test_login_with_pkce_then_commands_use_the_cached_token(
    oidc_api: LocalApi, idp: FakeIdP, browser: list[str], clean_env: Path
) -> None:
    server = oidc_api.rest_url
    result = run("login")
    assert result.exit_code == 0, result.stderr
    assert f"Logged in to {server} as alice" in result.stdout
    [url] = browser
    assert "code_challenge_method=S256" in url and "redirect_uri=http%3A%2F%2F127.0.0.1" in url
    path = token_file(clean_env)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    entry = cached(clean_env, server)
    assert entry["refresh_token"] and entry["expires_at"] > time.time()
    assert entry["access_token"] not in result.stdout + result.stderr

    submitted = run(
        "submit", "--tenant", "physics", "--vcluster", "gpu", "-t", "1h", "--", "hostname"
    )
    assert submitted.exit_code == 0, submitted.stderr
    [alloc_id] = list(oidc_api.quorum.state.allocations)
    assert oidc_api.quorum.state.allocations[alloc_id].spec.user == "alice"  # from the token
    status = run("status")
    assert status.exit_code == 0, status.stderr
    assert alloc_id[:8] in status.stdout
    sent = [r for r in oidc_api.requests if r["method"] == "GET"][-1]["headers"]["Authorization"]
    assert sent == f"Bearer {entry['access_token']}"

    me = run("whoami")
    assert me.exit_code == 0, me.stderr
    for line in ("User:     alice", "Role:     user", "Tenant:   physics", "Auth:     oidc"):
        assert line in me.stdout
    data = json.loads(run("whoami", "-o", "json").stdout)
    assert data["user"] == "alice" and data["expires_at"] == pytest.approx(entry["expires_at"])


def test_login_no_browser_prints_the_url(oidc_api: LocalApi, clean_env: Path) -> None:
    """A real ``lattice`` process: the URL is printed, the user opens it elsewhere."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "lattice_cli.main", "login", "--no-browser", "--timeout", "20"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=dict(os.environ),
    )
    try:
        assert proc.stdout is not None
        url = ""
        while not url:
            line = proc.stdout.readline()
            assert line, proc.stderr.read() if proc.stderr else ""
            if line.startswith("  http"):
                url = line.strip()
        with urllib.request.urlopen(url, timeout=10) as resp:
            assert b"logged in" in resp.read()
        out, err = proc.communicate(timeout=20)
    finally:
        proc.kill()
    assert proc.returncode == 0, err
    assert "Logged in to" in out
    assert cached(clean_env, oidc_api.rest_url)["access_token"]


def test_login_with_the_device_flow(oidc_api: LocalApi, idp: FakeIdP, clean_env: Path) -> None:
    def approve() -> None:
        idp.approve_device(idp.wait_for_device_request(10))

    approver = threading.Thread(target=approve)
    approver.start()
    result = run("login", "--device")
    approver.join()
    assert result.exit_code == 0, result.stderr
    assert "enter the code:" in result.stdout and "/device" in result.stdout
    assert "Logged in to" in result.stdout
    assert run("status").exit_code == 0


def test_device_flow_slows_down_when_asked(idp: FakeIdP) -> None:
    doc = {"client_id": "lattice", **idp.metadata()}
    slept: list[float] = []
    before = idp.slow_downs

    def sleep(seconds: float) -> None:
        slept.append(seconds)
        time.sleep(0.01)  # poll too fast on purpose
        if code and idp.slow_downs > before and len(slept) > 2:
            idp.approve_device(code[0])

    code: list[str] = []
    watcher = threading.Thread(target=lambda: code.append(idp.wait_for_device_request(10)))
    watcher.start()
    entry = auth.login_device(doc, say=lambda _: None, sleep=sleep, slow_down_step=0.5)
    watcher.join()
    assert entry["access_token"] and idp.slow_downs > before
    assert slept[0] == pytest.approx(0.05) and max(slept) >= 0.55  # 5 s in real life


def test_denied_device_login(oidc_api: LocalApi, idp: FakeIdP) -> None:
    denier = threading.Thread(target=lambda: idp.deny_device(idp.wait_for_device_request(10)))
    denier.start()
    result = run("login", "--device")
    denier.join()
    assert result.exit_code == 1
    assert "denied" in result.stderr and "Hint: Run `lattice login`." in result.stderr


def test_login_to_a_server_without_an_idp(api: Any) -> None:
    result = run("login")
    assert result.exit_code == 1
    assert "has no identity provider configured" in result.stderr
    assert "development mode" in result.stderr


# --- the token cache ----------------------------------------------------------------------


def test_a_token_file_readable_by_others_is_repaired(
    oidc_api: LocalApi, idp: FakeIdP, clean_env: Path
) -> None:
    write_entry(clean_env, oidc_api.rest_url, entry_for(idp, idp.token("alice")), mode=0o644)
    result = run("status")
    assert result.exit_code == 0, result.stderr
    assert "readable by other users (mode 0644)" in result.stderr
    assert stat.S_IMODE(token_file(clean_env).stat().st_mode) == 0o600


def test_an_expired_token_is_refreshed_silently(
    oidc_api: LocalApi, idp: FakeIdP, browser: list[str], clean_env: Path
) -> None:
    server = oidc_api.rest_url
    assert run("login").exit_code == 0
    entry = cached(clean_env, server)
    stale = {**entry, "access_token": idp.token("alice", lifetime=-600)}
    stale["expires_at"] = auth.jwt_expiry(stale["access_token"])
    write_entry(clean_env, server, stale)
    result = run("status")
    assert result.exit_code == 0, result.stderr
    assert result.stderr == ""
    fresh = cached(clean_env, server)
    assert fresh["access_token"] != stale["access_token"] and fresh["expires_at"] > time.time()
    assert fresh["refresh_token"] != entry["refresh_token"]  # rotated by the IdP
    assert stat.S_IMODE(token_file(clean_env).stat().st_mode) == 0o600


@pytest.mark.parametrize("case", ["no-refresh-token", "refresh-token-expired"])
def test_without_a_usable_refresh_token_the_hint_is_to_log_in(
    oidc_api: LocalApi, idp: FakeIdP, clean_env: Path, case: str
) -> None:
    refresh = ""
    if case == "refresh-token-expired":
        doc = {"client_id": "lattice", **idp.metadata()}
        threading.Thread(target=lambda: idp.approve_device(idp.wait_for_device_request(10))).start()
        refresh = auth.login_device(doc, say=lambda _: None)["refresh_token"]
        idp.expire_refresh_tokens()
    expired = idp.token("alice", lifetime=-600)
    write_entry(clean_env, oidc_api.rest_url, entry_for(idp, expired, refresh))
    result = run("status")
    assert result.exit_code == 1
    assert result.stderr.startswith("Error: Not logged in: the cached token for")
    assert "Hint: Run `lattice login`." in result.stderr
    assert expired not in result.stderr and (not refresh or refresh not in result.stderr)
    assert oidc_api.requests == []  # nothing was sent with a dead token


def test_logout_revokes_and_forgets(
    oidc_api: LocalApi, idp: FakeIdP, browser: list[str], clean_env: Path
) -> None:
    server = oidc_api.rest_url
    assert run("login").exit_code == 0
    revoked = len(idp.revoked)
    result = run("logout")
    assert result.exit_code == 0, result.stderr
    assert f"Logged out of {server} (tokens revoked at the identity provider)." in result.stdout
    assert idp.revoked[revoked:] == ["refresh_token", "access_token"]
    assert server not in json.loads(token_file(clean_env).read_text())["servers"]
    denied = run("status")
    assert denied.exit_code == 1 and "lattice login" in denied.stderr
    assert run("logout").stdout.strip() == f"Not logged in to {server}."


def test_a_configured_token_wins_over_the_cache(
    oidc_api: LocalApi, idp: FakeIdP, clean_env: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    write_entry(clean_env, oidc_api.rest_url, entry_for(idp, idp.token("alice")))
    monkeypatch.setenv("LATTICE_TOKEN", idp.token("root", scope="admin"))
    me = json.loads(run("whoami", "-o", "json").stdout)
    assert (me["user"], me["role"]) == ("root", "system-admin")


def test_whoami_text() -> None:
    now = 1_000_000.0
    text = whoami_text(
        {"user": "alice", "role": "user", "tenant": "", "method": "oidc", "expires_at": now + 299},
        "http://127.0.0.1:8080",
        now,
    )
    assert "Tenant:   -" in text and "(in 4m 59s)" in text
    assert "Expires:  -" in whoami_text({"user": "bob", "expires_at": None}, "x", now)


def test_a_valid_cached_token_costs_no_http_client_import(
    oidc_api: LocalApi, idp: FakeIdP, clean_env: Path
) -> None:
    """`lattice status` with a fresh cached token reads the cache and nothing more: no
    urllib.request / http.server (~35 ms) unless a refresh or a login needs them."""
    write_entry(clean_env, oidc_api.rest_url, entry_for(idp, idp.token("alice")))
    code = (
        "import sys\n"
        "from lattice_cli.main import main\n"
        "try:\n"
        "    main(['status'])\n"
        "except SystemExit as e:\n"
        "    assert not e.code, e.code\n"
        "print('heavy:' + ','.join(m for m in ('urllib.request', 'http.server') if m in sys.modules))\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip().splitlines()[-1] == "heavy:", proc.stdout
