"""spiffe: the SPIFFE Workload API client against a fake SPIRE agent that speaks the real
protocol (gRPC on a unix socket, security header, streamed rotations), its error paths,
the wire encoding of the hand-written messages, and socket discovery from the environment."""

from __future__ import annotations

import asyncio
import datetime
import shutil
import socket
import ssl
import tempfile
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import serialization
from grpclib.client import Channel
from grpclib.const import Cardinality, Status
from grpclib.exceptions import GRPCError
from lattice_agent.spiffe import (
    DEFAULT_SOCKET,
    FETCH_X509_SVID,
    X509SVID,
    SpiffeError,
    X509SVIDRequest,
    X509SVIDResponse,
    agent_spiffe_id,
    fetch_x509_svid,
    socket_path_from_env,
    split_der_certificates,
)
from lattice_test_harness.fake_spire import FakeSpireAgent, FakeSvid, SpiffeCA, mint_agent_svid

TD = "lattice.test"


@pytest.fixture
def sock_dir() -> Iterator[Path]:
    # short: sun_path holds 107 bytes, pytest's tmp_path can be longer
    d = Path(tempfile.mkdtemp(prefix="spire-"))
    yield d
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
def sock(sock_dir: Path) -> str:
    return str(sock_dir / "agent.sock")


@pytest.fixture
def ca() -> SpiffeCA:
    return SpiffeCA(TD)


@pytest.fixture
async def spire(sock: str, ca: SpiffeCA) -> AsyncIterator[FakeSpireAgent]:
    async with FakeSpireAgent(sock, [ca.issue_agent("n1")]) as fake:
        yield fake


def _public(key_or_cert: object) -> bytes:
    return key_or_cert.public_key().public_bytes(  # type: ignore[attr-defined]
        serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo
    )


async def _raw_call(sock: str, metadata: dict[str, str] | None) -> list[X509SVIDResponse]:
    """FetchX509SVID by hand: the first response (or the refusal)."""
    channel = Channel(path=sock)
    try:
        async with channel.request(
            FETCH_X509_SVID,
            Cardinality.UNARY_STREAM,
            X509SVIDRequest,
            X509SVIDResponse,
            metadata=metadata,
            timeout=5,
        ) as stream:
            await stream.send_message(X509SVIDRequest(), end=True)
            first = await stream.recv_message()
            await stream.cancel()
            return [first] if first is not None else []
    finally:
        channel.close()


# --------------------------------------------------------------------------- fetching


async def test_fetch_returns_the_svid(spire: FakeSpireAgent, sock: str, ca: SpiffeCA) -> None:
    svid = await fetch_x509_svid(sock)

    assert svid.spiffe_id == f"spiffe://{TD}/lattice/agent/n1" == agent_spiffe_id(TD, "n1")
    chain = x509.load_pem_x509_certificates(svid.cert_chain_pem)
    assert len(chain) == 1
    leaf = chain[0]
    san = leaf.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert san.get_values_for_type(x509.UniformResourceIdentifier) == [svid.spiffe_id]
    leaf.verify_directly_issued_by(ca.cert)

    assert svid.key_pem.startswith(b"-----BEGIN PRIVATE KEY-----")  # PKCS#8, unencrypted
    key = serialization.load_pem_private_key(svid.key_pem, password=None)
    assert _public(key) == _public(leaf)

    assert svid.bundle_pem == ca.bundle_pem
    assert svid.not_after == leaf.not_valid_after_utc.timestamp()
    assert abs(svid.not_after - (time.time() + 3600)) < 120

    assert spire.calls == [("true",)]  # the security header went out
    # the client cancelled the stream after the first response
    async with asyncio.timeout(5):
        while spire.open_streams:
            await asyncio.sleep(0.01)


async def test_chain_with_intermediate_is_leaf_first_and_loads_into_ssl(
    sock: str, ca: SpiffeCA, sock_dir: Path
) -> None:
    async with FakeSpireAgent(sock, [ca.issue_agent("n2", intermediate=True)]):
        svid = await fetch_x509_svid(f"unix://{sock}")
    leaf, intermediate = x509.load_pem_x509_certificates(svid.cert_chain_pem)
    leaf.verify_directly_issued_by(intermediate)
    intermediate.verify_directly_issued_by(ca.cert)
    assert svid.spiffe_id.endswith("/lattice/agent/n2")

    (sock_dir / "chain.pem").write_bytes(svid.cert_chain_pem)
    (sock_dir / "key.pem").write_bytes(svid.key_pem)
    (sock_dir / "bundle.pem").write_bytes(svid.bundle_pem)
    ctx = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cafile=sock_dir / "bundle.pem")
    ctx.load_cert_chain(sock_dir / "chain.pem", sock_dir / "key.pem")


async def test_first_svid_of_several_and_extra_fields(sock: str, ca: SpiffeCA) -> None:
    other = SpiffeCA("other.test")
    first = ca.issue_agent("n1", hint="internal")
    second = ca.issue(f"spiffe://{TD}/lattice/other")
    async with FakeSpireAgent(
        sock, [first, second], federated_bundles={"spiffe://other.test": other.bundle_der}
    ) as spire:
        (response,) = await _raw_call(sock, {"workload.spiffe.io": "true"})
        svid = await fetch_x509_svid(sock)
    assert [s.spiffe_id for s in response.svids] == [first.spiffe_id, second.spiffe_id]
    assert response.svids[0].hint == "internal"
    assert response.federated_bundles == {"spiffe://other.test": other.bundle_der}
    assert svid.spiffe_id == first.spiffe_id
    assert spire.calls == [("true",), ("true",)]


async def test_rotation_pushes_on_the_open_stream(
    spire: FakeSpireAgent, sock: str, ca: SpiffeCA
) -> None:
    channel = Channel(path=sock)
    try:
        async with channel.request(
            FETCH_X509_SVID,
            Cardinality.UNARY_STREAM,
            X509SVIDRequest,
            X509SVIDResponse,
            metadata={"workload.spiffe.io": "true"},
            timeout=10,
        ) as stream:
            await stream.send_message(X509SVIDRequest(), end=True)
            first = await stream.recv_message()
            assert first is not None
            await spire.wait_for_streams(1)

            renewed = ca.issue_agent("n1", ttl=7200)
            spire.rotate(renewed)
            second = await stream.recv_message()
            assert second is not None
            assert second.svids[0].x509_svid == renewed.chain_der
            assert second.svids[0].x509_svid != first.svids[0].x509_svid

            spire.rotate()  # identity withdrawn: SPIRE ends the stream
            with pytest.raises(GRPCError) as err:
                await stream.recv_message()
                await stream.recv_trailing_metadata()
            assert err.value.status is Status.PERMISSION_DENIED
    finally:
        channel.close()
    # a new fetch sees the withdrawn identity too
    with pytest.raises(SpiffeError, match="PERMISSION_DENIED"):
        await fetch_x509_svid(sock)


# --------------------------------------------------------------------------- the server


async def test_server_refuses_calls_without_the_security_header(
    spire: FakeSpireAgent, sock: str
) -> None:
    for metadata in (None, {"workload.spiffe.io": "True"}, {"workload.spiffe.io": "1"}):
        with pytest.raises(GRPCError) as err:
            await _raw_call(sock, metadata)
        assert err.value.status is Status.INVALID_ARGUMENT
        assert err.value.message == "security header missing from request"
    assert spire.calls == [(), ("True",), ("1",)]
    (ok,) = await _raw_call(sock, {"workload.spiffe.io": "true"})
    assert ok.svids[0].spiffe_id == agent_spiffe_id(TD, "n1")


# --------------------------------------------------------------------------- failures


async def test_missing_socket(sock: str) -> None:
    with pytest.raises(SpiffeError) as err:
        await fetch_x509_svid(sock)
    assert err.value.message == f"no SPIFFE Workload API socket at {sock}"
    assert "LATTICE_SPIRE_SOCKET" in err.value.hint


async def test_not_a_socket_and_nobody_listening(sock: str, sock_dir: Path) -> None:
    plain = sock_dir / "plain"
    plain.write_text("")
    with pytest.raises(SpiffeError, match="is not a unix socket") as err:
        await fetch_x509_svid(str(plain))
    assert err.value.hint

    stale = socket.socket(socket.AF_UNIX)
    stale.bind(sock)  # a socket file left behind by a dead agent
    stale.close()
    with pytest.raises(SpiffeError, match="cannot talk to the Workload API") as err:
        await fetch_x509_svid(sock)
    assert "start the SPIRE agent" in err.value.hint


async def test_no_identity_is_permission_denied(sock: str) -> None:
    async with FakeSpireAgent(sock, []):
        with pytest.raises(SpiffeError) as err:
            await fetch_x509_svid(sock)
    assert "PERMISSION_DENIED (no identity issued)" in err.value.message
    assert "register an entry" in err.value.hint


async def test_refusal_status_is_reported(spire: FakeSpireAgent, sock: str) -> None:
    spire.refuse(Status.UNAVAILABLE, "still starting")
    with pytest.raises(SpiffeError) as err:
        await fetch_x509_svid(sock)
    assert "UNAVAILABLE (still starting)" in err.value.message
    assert "retry" in err.value.hint
    spire.refuse(None)
    assert (await fetch_x509_svid(sock)).spiffe_id == agent_spiffe_id(TD, "n1")


@pytest.mark.parametrize("behaviour", ["empty_response", "end_stream"])
async def test_stream_without_an_svid(spire: FakeSpireAgent, sock: str, behaviour: str) -> None:
    spire.behaviour = behaviour  # type: ignore[assignment]
    with pytest.raises(SpiffeError) as err:
        await fetch_x509_svid(sock)
    assert err.value.message == f"the Workload API at {sock} sent no X.509-SVID"
    assert "PermissionDenied" in err.value.hint


async def test_silent_server_times_out(sock: str) -> None:
    async def hold(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.read()  # never answers, not even the HTTP/2 preface
        writer.close()

    server = await asyncio.start_unix_server(hold, path=sock)
    try:
        with pytest.raises(SpiffeError, match=r"no X\.509-SVID .* within 0\.3 s") as err:
            await fetch_x509_svid(sock, timeout=0.3)
        assert "healthcheck" in err.value.hint
    finally:
        server.close()


def _bad(svid: FakeSvid, **changes: object) -> FakeSvid:
    fields = {**svid.__dict__, **changes}
    return FakeSvid(**fields)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ("garbage_chain", "invalid certificate chain"),
        ("cut_chain", "invalid certificate chain"),
        ("empty_chain", "empty certificate chain"),
        ("garbage_bundle", "invalid trust bundle"),
        ("garbage_key", "invalid private key"),
        ("other_key", "does not match its certificate"),
        ("other_id", "URI SANs"),
        ("not_spiffe", "SPIFFE ID 'n1'"),
    ],
)
async def test_invalid_svid_material(sock: str, ca: SpiffeCA, change: str, message: str) -> None:
    good = ca.issue_agent("n1")
    bad = {
        "garbage_chain": lambda: _bad(good, chain_der=b"\x30\x03abc"),
        "cut_chain": lambda: _bad(good, chain_der=good.chain_der[:-10]),
        "empty_chain": lambda: _bad(good, chain_der=b""),
        "garbage_bundle": lambda: _bad(good, bundle_der=b"-----BEGIN CERTIFICATE-----"),
        "garbage_key": lambda: _bad(good, key_der=b"\x30\x00"),
        "other_key": lambda: _bad(good, key_der=ca.issue_agent("n1").key_der),
        "other_id": lambda: _bad(good, spiffe_id=agent_spiffe_id(TD, "n9")),
        "not_spiffe": lambda: _bad(good, spiffe_id="n1"),
    }[change]()
    async with FakeSpireAgent(sock, [bad]):
        with pytest.raises(SpiffeError, match=message) as err:
            await fetch_x509_svid(sock)
    assert err.value.hint


def test_split_der_certificates(ca: SpiffeCA) -> None:
    chain = ca.issue_agent("n1", intermediate=True).chain_der
    parts = split_der_certificates(chain)
    assert len(parts) == 2 and b"".join(parts) == chain
    assert split_der_certificates(b"") == []
    # short-form length
    assert split_der_certificates(b"\x30\x01\x00\x30\x00") == [b"\x30\x01\x00", b"\x30\x00"]
    for bad in (b"\x31\x00", b"\x30", b"\x30\x80\x00\x00", b"\x30\x82\x01", b"\x30\x05ab"):
        with pytest.raises(ValueError):
            split_der_certificates(bad)


# --------------------------------------------------------------------------- wire format


def test_messages_encode_with_the_spec_field_numbers() -> None:
    msg = X509SVIDResponse(
        svids=[
            X509SVID(
                spiffe_id="spiffe://t/a",
                x509_svid=b"C",
                x509_svid_key=b"K",
                bundle=b"B",
                hint="h",
            )
        ],
        crl=[b"r1", b"r2"],
        federated_bundles={"spiffe://o": b"F"},
    )
    svid = (
        b"\x0a\x0cspiffe://t/a"  # 1: spiffe_id
        b"\x12\x01C"  # 2: x509_svid
        b"\x1a\x01K"  # 3: x509_svid_key
        b"\x22\x01B"  # 4: bundle
        b"\x2a\x01h"  # 5: hint
    )
    entry = b"\x0a\x0aspiffe://o\x12\x01F"  # map entry: key = 1, value = 2
    expected = (
        b"\x0a" + bytes([len(svid)]) + svid  # 1: svids
        + b"\x12\x02r1\x12\x02r2"  # 2: crl, repeated bytes
        + b"\x1a" + bytes([len(entry)]) + entry  # 3: federated_bundles
    )  # fmt: skip
    assert bytes(msg) == expected
    back = X509SVIDResponse.FromString(expected)
    assert back.svids[0].x509_svid_key == b"K" and back.svids[0].bundle == b"B"
    assert back.crl == [b"r1", b"r2"] and back.federated_bundles == {"spiffe://o": b"F"}
    assert bytes(X509SVIDRequest()) == b""
    # fields a newer server adds are skipped
    assert X509SVID.FromString(b"\x0a\x01x\x32\x01z").spiffe_id == "x"


# --------------------------------------------------------------------------- environment


@pytest.mark.parametrize(
    ("value", "path"),
    [
        ("unix:///run/spire/sockets/agent.sock", "/run/spire/sockets/agent.sock"),
        ("unix:/run/spire/agent.sock", "/run/spire/agent.sock"),
        ("/var/run/spire.sock", "/var/run/spire.sock"),
        ("  unix:///tmp/a.sock ", "/tmp/a.sock"),
    ],
)
def test_socket_path_from_env(value: str, path: str) -> None:
    assert socket_path_from_env({"LATTICE_SPIRE_SOCKET": value}) == path


def test_socket_path_fallbacks(monkeypatch: pytest.MonkeyPatch) -> None:
    assert socket_path_from_env({}) == DEFAULT_SOCKET == "/run/spire/agent.sock"
    assert socket_path_from_env({"LATTICE_SPIRE_SOCKET": ""}) == DEFAULT_SOCKET
    std = {"SPIFFE_ENDPOINT_SOCKET": "unix:///tmp/spire-agent/public/api.sock"}
    assert socket_path_from_env(std) == "/tmp/spire-agent/public/api.sock"
    assert socket_path_from_env({**std, "LATTICE_SPIRE_SOCKET": "/x.sock"}) == "/x.sock"

    monkeypatch.delenv("SPIFFE_ENDPOINT_SOCKET", raising=False)
    monkeypatch.setenv("LATTICE_SPIRE_SOCKET", "unix:///run/x.sock")
    assert socket_path_from_env() == "/run/x.sock"


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("tcp://127.0.0.1:8000", "over TCP is not supported"),
        ("unix://host/agent.sock", "is not a unix socket address"),
        ("unix:relative.sock", "is not a unix socket address"),
        ("unix:///a.sock?x=1", "is not a unix socket address"),
    ],
)
def test_bad_socket_addresses(value: str, message: str) -> None:
    with pytest.raises(SpiffeError, match=message) as err:
        socket_path_from_env({"LATTICE_SPIRE_SOCKET": value})
    assert "LATTICE_SPIRE_SOCKET" in err.value.message and err.value.hint


def test_minted_agent_svid() -> None:
    ca, svid = mint_agent_svid("node-7", "site.example", ttl=600)
    assert svid.spiffe_id == "spiffe://site.example/lattice/agent/node-7"
    leaf = x509.load_der_x509_certificate(split_der_certificates(svid.chain_der)[0])
    leaf.verify_directly_issued_by(ca.cert)
    assert leaf.extensions.get_extension_for_class(x509.BasicConstraints).value.ca is False
    lifetime = leaf.not_valid_after_utc - datetime.datetime.now(datetime.UTC)
    assert datetime.timedelta(seconds=500) < lifetime <= datetime.timedelta(seconds=600)
    with pytest.raises(ValueError, match="not in trust domain"):
        ca.issue("spiffe://elsewhere/x")
