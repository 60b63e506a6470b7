"""lattice_common.uenv_registry: refs (property-tested), the index, signatures, views,
directory and HTTP registries (a real http.server), and the API's cached index."""

from __future__ import annotations

import asyncio
import base64
import hashlib
import http.server
import json
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed448 import Ed448PrivateKey
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from hypothesis import given, settings
from hypothesis import strategies as st
from lattice_common.uenv_registry import (
    CachedIndex,
    UenvError,
    UenvNotFound,
    UenvRegistry,
    UenvSignatureError,
    UenvUnreachable,
    apply_view,
    check_view_name,
    find_view,
    format_ref,
    load_public_key,
    match_ref,
    parse_index,
    parse_ref,
    parse_views,
    sign_index_entry,
    verify_signature,
)

pytestmark = pytest.mark.timeout(60)

SHA_A = hashlib.sha256(b"a").hexdigest()


# ---------------------------------------------------------------------- refs

_PART = st.from_regex(r"[A-Za-z0-9][A-Za-z0-9._+-]{0,20}", fullmatch=True)
_TAG = st.one_of(st.just(""), st.from_regex(r"[A-Za-z0-9._+-]{1,12}", fullmatch=True))


@settings(max_examples=300, deadline=None)
@given(st.text(max_size=60) | st.binary(max_size=20).map(lambda b: b.decode("latin-1")))
def test_parse_ref_raises_only_its_own_error(text: str) -> None:
    try:
        name, version, tag = parse_ref(text)
    except UenvNotFound as e:
        assert "name/version[:tag]" in e.message and e.hint
        return
    assert format_ref(name, version, tag) == text.strip()  # what parses, formats back


@settings(max_examples=200, deadline=None)
@given(_PART, _PART, _TAG)
def test_refs_round_trip(name: str, version: str, tag: str) -> None:
    ref = format_ref(name, version, tag)
    assert parse_ref(ref) == (name, version, tag)
    assert parse_ref(f"  {ref}\n") == (name, version, tag)


@pytest.mark.parametrize(
    "bad", ["", "gnu", "gnu/", "/24", "gnu/24:", "gnu/24:v1:v2", "a b/1", "../x/1", "x" * 300]
)
def test_malformed_refs(bad: str) -> None:
    with pytest.raises(UenvNotFound, match=r"not of the form name/version\[:tag\]"):
        parse_ref(bad)


def test_view_names() -> None:
    assert check_view_name("default") == "default"
    for bad in ("", "a b", "-x", "x" * 65, "a/b"):
        with pytest.raises(UenvError, match="invalid uenv view"):
            check_view_name(bad)


# ---------------------------------------------------------------------- the index


def entry(sha: str = SHA_A, **kw: Any) -> dict[str, Any]:
    return {"file": "a.sqfs", "sha256": sha, "size": 1, **kw}


INDEX = {
    "prgenv-gnu/24.11:v1": entry(),
    "prgenv-gnu/24.7:v2": entry(),
    "prgenv-gnu/24.7:v3": entry(),
    "nvhpc/1:v1": entry(),
}


def test_match_exact_untagged_and_ambiguous() -> None:
    assert match_ref(INDEX, "prgenv-gnu/24.11:v1").key == "prgenv-gnu/24.11:v1"
    assert match_ref(INDEX, "prgenv-gnu/24.11").key == "prgenv-gnu/24.11:v1"  # the only tag
    with pytest.raises(UenvNotFound, match="more than one tag") as e:
        match_ref(INDEX, "prgenv-gnu/24.7")
    assert e.value.available == ("prgenv-gnu/24.7:v2", "prgenv-gnu/24.7:v3")


def test_unknown_refs_name_what_exists() -> None:
    with pytest.raises(UenvNotFound) as e:
        match_ref(INDEX, "prgenv-gnu/25.1:v1")
    assert e.value.message == (
        "uenv prgenv-gnu/25.1:v1: not in the registry; available: "
        "prgenv-gnu/24.11:v1, prgenv-gnu/24.7:v2, prgenv-gnu/24.7:v3"
    )
    assert "prgenv-gnu/24.11:v1" in e.value.hint
    with pytest.raises(UenvNotFound, match=r"no uenv named 'cuda'.*available: nvhpc, prgenv-gnu"):
        match_ref(INDEX, "cuda/12")
    with pytest.raises(UenvNotFound, match="available: none") as e:
        match_ref({}, "cuda/12")
    assert "submit without --uenv" in e.value.hint


@pytest.mark.parametrize(
    ("bad", "why"),
    [
        ({"sha256": SHA_A}, "no file"),
        (entry(file="/etc/passwd"), "not inside the registry"),
        (entry(file="../up.sqfs"), "not inside the registry"),
        (entry(sha="abc"), "sha256 is not 64 hex digits"),
        (entry(size="big"), "size is not a whole number"),
        (entry(signature=5), "signature is not text"),
    ],
)
def test_bad_entries(bad: dict[str, Any], why: str) -> None:
    with pytest.raises(UenvError, match=rf"bad registry entry 'a/1:v1': .*{why}"):
        match_ref({"a/1:v1": bad}, "a/1:v1")


def test_parse_index_errors() -> None:
    assert parse_index(json.dumps({"a/1": entry(), "junk": 3}), "r") == {"a/1": entry()}
    with pytest.raises(UenvError, match=r"uenv registry r: unreadable index\.json"):
        parse_index(b"{", "r")
    with pytest.raises(UenvError, match=r"index\.json is not an object"):
        parse_index(b"[]", "r")


# ---------------------------------------------------------------------- signatures


@pytest.fixture(scope="module")
def site_key(tmp_path_factory: pytest.TempPathFactory) -> tuple[bytes, Path]:
    """(private key PEM, path of the public key PEM)."""
    key = Ed25519PrivateKey.generate()
    private = key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )
    public = tmp_path_factory.mktemp("key") / "site.pub"
    public.write_bytes(
        key.public_key().public_bytes(
            serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
        )
    )
    return private, public


def test_signatures_good_missing_tampered(site_key: tuple[bytes, Path]) -> None:
    private, public = site_key
    key = load_public_key(public)
    sig = sign_index_entry(private, SHA_A)
    good = match_ref({"a/1:v1": entry(signature=sig)}, "a/1:v1")
    verify_signature(good, key)
    missing = match_ref({"a/1:v1": entry()}, "a/1:v1")
    with pytest.raises(UenvSignatureError, match=r"^uenv a/1:v1: signature missing$") as e:
        verify_signature(missing, key)
    assert "uenv_signing_key" in e.value.hint
    other = hashlib.sha256(b"other").hexdigest()  # the signature is of another image
    for bad in (entry(sha=other, signature=sig), entry(signature="!!not base64")):
        with pytest.raises(UenvSignatureError, match="signature does not verify with the site key"):
            verify_signature(match_ref({"a/1:v1": bad}, "a/1:v1"), key)
    flipped = bytearray(base64.b64decode(sig))
    flipped[0] ^= 1
    tampered = entry(signature=base64.b64encode(bytes(flipped)).decode())
    with pytest.raises(UenvSignatureError, match="does not verify"):
        verify_signature(match_ref({"a/1:v1": tampered}, "a/1:v1"), key)
    # a key of another site does not verify it either
    other_key = Ed25519PrivateKey.generate().public_key()
    with pytest.raises(UenvSignatureError, match="does not verify"):
        verify_signature(good, other_key)


def test_signing_key_errors(tmp_path: Path) -> None:
    with pytest.raises(UenvError, match=r"uenv signing key .*: cannot read"):
        load_public_key(tmp_path / "none.pem")
    (tmp_path / "junk.pem").write_text("not a key")
    with pytest.raises(UenvError, match="not a PEM public key"):
        load_public_key(tmp_path / "junk.pem")
    ed448 = Ed448PrivateKey.generate().public_key()
    (tmp_path / "ed448.pem").write_bytes(
        ed448.public_bytes(
            serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
        )
    )
    with pytest.raises(UenvError, match="not an Ed25519 key"):
        load_public_key(tmp_path / "ed448.pem")
    with pytest.raises(UenvError, match="not a sha256"):
        sign_index_entry(
            Ed25519PrivateKey.generate().private_bytes(
                serialization.Encoding.PEM,
                serialization.PrivateFormat.PKCS8,
                serialization.NoEncryption(),
            ),
            "xyz",
        )


def test_a_signed_registry_refuses_unsigned_entries(
    tmp_path: Path, site_key: tuple[bytes, Path]
) -> None:
    private, public = site_key
    index = {"a/1:v1": entry(signature=sign_index_entry(private, SHA_A)), "b/1:v1": entry()}
    (tmp_path / "index.json").write_text(json.dumps(index))
    reg = UenvRegistry(tmp_path, signing_key=public)
    assert reg.resolve("a/1").sha256 == SHA_A
    with pytest.raises(UenvSignatureError, match="uenv b/1:v1: signature missing"):
        reg.resolve("b/1:v1")
    assert UenvRegistry(tmp_path).resolve("b/1:v1").sha256 == SHA_A  # no key: not checked


# ---------------------------------------------------------------------- views

ENV_JSON = {
    "views": {
        "default": {
            "description": "compilers",
            "env": {
                "CC": "gcc",
                "PATH": {"prepend": ["/user-environment/bin", "/user-environment/sbin"]},
                "MANPATH": {"append": ["/user-environment/man"]},
            },
        },
        "modules": {"env": {"MODULEPATH": {"prepend": ["/user-environment/modules"]}}},
    }
}


def test_views_parsed_and_applied() -> None:
    views = parse_views(json.dumps(ENV_JSON), "a/1:v1")
    assert sorted(views) == ["default", "modules"]
    view = find_view(views, "a/1:v1", "default")
    assert view.description == "compilers"
    env = apply_view({"PATH": "/usr/bin", "CC": "cc"}, view)
    assert env == {
        "PATH": "/user-environment/bin:/user-environment/sbin:/usr/bin",
        "CC": "gcc",
        "MANPATH": "/user-environment/man",  # nothing to append to
    }


def test_unknown_views_and_bad_env_json() -> None:
    views = parse_views(json.dumps(ENV_JSON), "a/1:v1")
    with pytest.raises(UenvError) as e:
        find_view(views, "a/1:v1", "spack")
    assert e.value.message == "uenv a/1:v1 has no view spack (views: default, modules)"
    assert "--view" in e.value.hint
    with pytest.raises(UenvError, match=r"has no view x \(views: none\)"):
        find_view({}, "a/1:v1", "x")
    for bad, why in [
        (b"{", "bad meta/env.json"),
        (json.dumps({"views": []}), "no views object"),
        (json.dumps({"views": {"v": {"env": {"1X": "a"}}}}), "not a variable name"),
        (json.dumps({"views": {"v": {"env": {"X": 3}}}}), "is not text"),
        (json.dumps({"views": {"v": {"env": {"X": {"prepend": "a"}}}}}), "not a list"),
        (json.dumps({"views": {"v": {"env": {"X": {"other": ["a"]}}}}}), "is not text"),
    ]:
        with pytest.raises(UenvError, match=why):
            parse_views(bad, "a/1:v1")


# ---------------------------------------------------------------------- HTTP registry


class _Handler(http.server.SimpleHTTPRequestHandler):
    delay = 0.0
    fail_with = 0

    def do_GET(self) -> None:
        if self.delay:
            time.sleep(self.delay)
        if self.fail_with:
            self.send_error(self.fail_with)
            return
        super().do_GET()

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture
def http_registry(tmp_path: Path) -> Iterator[tuple[str, Path, type[_Handler]]]:
    """A real HTTP server serving ``tmp_path/www`` (URL, directory, handler class)."""
    root = tmp_path / "www"
    root.mkdir()
    handler = type("H", (_Handler,), {})

    def make(*a: Any) -> _Handler:
        return handler(*a, directory=str(root))

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), make)
    server.daemon_threads = False  # server_close() then waits for every request thread
    thread = threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", root, handler
    finally:
        server.shutdown()
        server.server_close()  # nothing of it may outlive the test (fds, threads)
        thread.join(5)


def test_http_registry_resolves_and_streams(http_registry: tuple[str, Path, Any]) -> None:
    url, root, _ = http_registry
    (root / "images").mkdir()
    (root / "images" / "a 1.sqfs").write_bytes(b"a")
    (root / "index.json").write_text(json.dumps({"a/1:v1": entry(file="images/a 1.sqfs")}))
    reg = UenvRegistry(url + "/")
    image = reg.resolve("a/1")
    assert image.location == f"{url}/images/a%201.sqfs"
    with reg.open_image(image) as stream:
        assert stream.read() == b"a"
    missing = UenvRegistry(url).image(match_ref({"b/1": entry(file="nope.sqfs")}, "b/1"))
    pattern = r"uenv b/1: image file .*/nope\.sqfs missing \(HTTP 404\)"
    with pytest.raises(UenvError, match=pattern), reg.open_image(missing):
        pass


def test_http_registry_errors(http_registry: tuple[str, Path, Any]) -> None:
    url, _root, handler = http_registry
    with pytest.raises(UenvError, match=rf"uenv registry {url}: no index.json \(HTTP 404"):
        UenvRegistry(url).resolve("a/1")
    handler.fail_with = 500
    with pytest.raises(UenvUnreachable, match=rf"uenv registry {url} unreachable: HTTP 500"):
        UenvRegistry(url).resolve("a/1")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        closed = f"http://127.0.0.1:{s.getsockname()[1]}"
    with pytest.raises(UenvUnreachable, match=rf"^uenv registry {closed} unreachable: ") as e:
        UenvRegistry(closed).resolve("a/1")
    assert "can be reached" in e.value.hint
    handler.fail_with, handler.delay = 0, 1.0
    with pytest.raises(UenvUnreachable, match=r"unreachable: .*timed out"):
        UenvRegistry(url, timeout=0.2).resolve("a/1")


# ---------------------------------------------------------------------- the API's cache


async def test_cached_index_reads_off_the_loop_and_caches(
    http_registry: tuple[str, Path, Any],
) -> None:
    url, root, handler = http_registry
    (root / "index.json").write_text(json.dumps({"a/1:v1": entry()}))
    handler.delay = 0.3
    now = [0.0]
    cache = CachedIndex(UenvRegistry(url), ttl=30, clock=lambda: now[0])
    ticks = 0

    async def ticker() -> None:
        nonlocal ticks
        while True:
            ticks += 1
            await asyncio.sleep(0.01)

    t = asyncio.create_task(ticker())
    try:
        # a burst of submissions: one read, and the loop kept running meanwhile
        images = await asyncio.gather(*(cache.resolve("a/1") for _ in range(5)))
    finally:
        t.cancel()
    assert {i.ref for i in images} == {"a/1:v1"}
    assert ticks >= 10
    (root / "index.json").write_text(json.dumps({"a/2:v1": entry()}))
    handler.delay = 0.0
    with pytest.raises(UenvNotFound):  # within the TTL: the cached index
        await cache.resolve("a/2")
    now[0] = 31
    assert (await cache.resolve("a/2")).ref == "a/2:v1"
    with pytest.raises(UenvNotFound, match="name/version"):  # no read for a malformed ref
        await cache.resolve("junk")


async def test_cached_index_remembers_a_failure_briefly(tmp_path: Path) -> None:
    now = [0.0]
    cache = CachedIndex(UenvRegistry(tmp_path), failure_ttl=5, clock=lambda: now[0])
    with pytest.raises(UenvError, match=r"no index\.json"):
        await cache.resolve("a/1")
    (tmp_path / "index.json").write_text(json.dumps({"a/1": entry()}))
    with pytest.raises(UenvError, match=r"no index\.json"):  # not read again yet
        await cache.resolve("a/1")
    now[0] = 6
    assert (await cache.resolve("a/1")).sha256 == SHA_A
