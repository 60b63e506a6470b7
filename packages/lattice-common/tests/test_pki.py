"""lattice_common.pki, the pure part of mTLS between components: the CA, certificate
requests and what is signed for them, renewal time, TLS contexts, and who a verified
peer is (:func:`pki.peer_identity`), read from real ``getpeercert()`` dictionaries of
in-memory TLS handshakes (``ssl.MemoryBIO``) between :func:`pki.server_context` and
:func:`pki.client_context`."""

from __future__ import annotations

import datetime as dt
import ssl
import time

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID
from cryptography.x509.verification import PolicyBuilder, Store, VerificationError
from hypothesis import given, settings
from hypothesis import strategies as st
from lattice_common import pki
from lattice_test_harness.fake_spire import FakeSvid, SpiffeCA

NOW = time.time()
SITE = "alps"
SERVER_NAME = f"api.{SITE}.lattice.internal"


# --------------------------------------------------------------------------- helpers


@pytest.fixture(scope="module")
def ca() -> tuple[bytes, bytes]:
    return pki.create_ca(SITE, now=NOW)


@pytest.fixture(scope="module")
def server_ctx(ca: tuple[bytes, bytes]) -> ssl.SSLContext:
    cert, key = pki.issue(*ca, kind=pki.Kind.API, name="api", site=SITE, now=NOW, lifetime=86400)
    return pki.server_context(cert, key, [ca[0]])


def load(pem: bytes) -> x509.Certificate:
    return x509.load_pem_x509_certificate(pem)


def handshake(
    server: ssl.SSLContext, client: ssl.SSLContext, host: str = SERVER_NAME
) -> tuple[ssl.SSLObject, ssl.SSLObject]:
    """A complete TLS handshake in memory; (server side, client side)."""
    s_in, s_out, c_in, c_out = ssl.MemoryBIO(), ssl.MemoryBIO(), ssl.MemoryBIO(), ssl.MemoryBIO()
    s = server.wrap_bio(s_in, s_out, server_side=True)
    c = client.wrap_bio(c_in, c_out, server_hostname=host)
    s_done = c_done = False
    for _ in range(10):
        if not c_done:
            try:
                c.do_handshake()
                c_done = True
            except ssl.SSLWantReadError:
                pass
        s_in.write(c_out.read())
        if not s_done:
            try:
                s.do_handshake()
                s_done = True
            except ssl.SSLWantReadError:
                pass
        c_in.write(s_out.read())
        if s_done and c_done:
            return s, c
    raise AssertionError("the handshake did not complete")


def peercert_of(
    server: ssl.SSLContext, trust: list[bytes], cert: bytes, key: bytes
) -> dict[str, object]:
    """What the server's ``getpeercert()`` says about a client presenting cert/key."""
    s, _c = handshake(server, pki.client_context(trust, cert, key))
    peer = s.getpeercert()
    assert peer, "the server saw no verified client certificate"
    return peer


def serial_int(serial: str) -> int:
    return int(serial, 16)


def foreign_ca(cn: str) -> tuple[bytes, bytes]:
    """A CA of a site's own PKI: any subject, not the one create_ca writes."""
    key = pki.generate_key()
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(dt.datetime.fromtimestamp(NOW - 60, dt.UTC))
        .not_valid_after(dt.datetime.fromtimestamp(NOW + 86400, dt.UTC))
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(key, hashes.SHA256())
    )
    return pki.cert_pem(cert), pki.key_pem(key)


def leaf_signed_by(
    ca: tuple[bytes, bytes], subject: x509.Name, *, serial: int | None = None
) -> tuple[bytes, bytes]:
    """A client certificate with an arbitrary subject, signed by ``ca`` directly."""
    ca_cert = load(ca[0])
    ca_key = serialization.load_pem_private_key(ca[1], password=None)
    key = pki.generate_key()
    cert = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(ca_cert.subject)
        .public_key(key.public_key())
        .serial_number(serial if serial is not None else x509.random_serial_number())
        .not_valid_before(dt.datetime.fromtimestamp(NOW - 60, dt.UTC))
        .not_valid_after(dt.datetime.fromtimestamp(NOW + 3600, dt.UTC))
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False)
        .sign(ca_key, hashes.SHA256())  # type: ignore[arg-type]
    )
    return pki.cert_pem(cert), pki.key_pem(key)


# --------------------------------------------------------------------------- signing


def test_create_ca_issue_and_sign_csr_round_trip(ca: tuple[bytes, bytes]) -> None:
    ca_cert = load(ca[0])
    assert ca_cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)[0].value == pki.ca_name(SITE)
    assert ca_cert.subject == ca_cert.issuer
    assert ca_cert.extensions.get_extension_for_class(x509.BasicConstraints).value.ca

    key = pki.generate_key()
    csr = pki.make_csr(key, pki.Kind.AGENT, "node-042", SITE)
    pem = pki.sign_csr(
        *ca,
        csr,
        kind=pki.Kind.AGENT,
        name="node-042",
        site=SITE,
        now=NOW,
        lifetime=3600,
        hosts=["10.0.0.42", "nid042.example"],
    )
    leaf = load(pem)
    # the chain verifies (cryptography's RFC 5280 verifier, as a client and a server)
    when = dt.datetime.fromtimestamp(NOW + 10, dt.UTC)
    builder = PolicyBuilder().store(Store([ca_cert])).time(when)
    assert builder.build_client_verifier().verify(leaf, []).chain[-1] == ca_cert
    cn = "node-042.alps.lattice.internal"
    assert builder.build_server_verifier(x509.DNSName(cn)).verify(leaf, [])[-1] == ca_cert
    leaf.verify_directly_issued_by(ca_cert)
    assert leaf.public_key() == key.public_key()  # the requester's key, not a new one
    # names as documented
    subject = {a.oid: a.value for a in leaf.subject}
    assert subject == {
        NameOID.ORGANIZATION_NAME: "Lattice",
        NameOID.ORGANIZATIONAL_UNIT_NAME: "agent",
        NameOID.COMMON_NAME: cn,
    }
    assert cn == pki.common_name("node-042", SITE)
    san = leaf.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert san.get_values_for_type(x509.DNSName) == [cn, "nid042.example"]
    assert [str(ip) for ip in san.get_values_for_type(x509.IPAddress)] == ["10.0.0.42"]
    eku = leaf.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
    assert set(eku) == {ExtendedKeyUsageOID.CLIENT_AUTH, ExtendedKeyUsageOID.SERVER_AUTH}
    assert not leaf.extensions.get_extension_for_class(x509.BasicConstraints).value.ca
    assert pki.validity(pem) == (pytest.approx(NOW - 60, abs=1), pytest.approx(NOW + 3600, abs=1))
    assert serial_int(pki.serial_of(pem)) == leaf.serial_number

    # issue() is make_csr + sign_csr with a fresh key it returns
    cert2, key2 = pki.issue(
        *ca, kind=pki.Kind.SCHEDULER, name="sched", site=SITE, now=NOW, lifetime=3600
    )
    assert load(cert2).public_key() == serialization.load_pem_private_key(key2, None).public_key()
    assert "OU=scheduler" in load(cert2).subject.rfc4514_string()


def _sign(ca: tuple[bytes, bytes], csr: bytes, **kw: object) -> bytes:
    args: dict[str, object] = {
        "kind": pki.Kind.AGENT,
        "name": "node-001",
        "site": SITE,
        "now": NOW,
        "lifetime": 600.0,
    }
    args.update(kw)
    return pki.sign_csr(*ca, csr, **args)  # type: ignore[arg-type]


def test_sign_csr_refuses_another_node_kind_or_site(ca: tuple[bytes, bytes]) -> None:
    key = pki.generate_key()
    for_002 = pki.make_csr(key, pki.Kind.AGENT, "node-002", SITE)
    with pytest.raises(pki.CertError, match="node-002"):
        _sign(ca, for_002)  # signed as node-001: the request names node-002
    as_api = pki.make_csr(key, pki.Kind.API, "node-001", SITE)
    with pytest.raises(pki.CertError, match="OU=api"):
        _sign(ca, as_api)  # an agent asking for an API member's certificate
    as_bootstrap = pki.make_csr(key, pki.Kind.BOOTSTRAP, "node-001", SITE)
    with pytest.raises(pki.CertError, match="expected"):
        _sign(ca, as_bootstrap, kind=pki.Kind.AGENT)
    other_site = pki.make_csr(key, pki.Kind.AGENT, "node-001", "other")
    with pytest.raises(pki.CertError, match="other"):
        _sign(ca, other_site)
    # the matching request is signed
    assert load(_sign(ca, pki.make_csr(key, pki.Kind.AGENT, "node-001", SITE)))


def test_sign_csr_refuses_tampered_and_garbage_requests(ca: tuple[bytes, bytes]) -> None:
    key = pki.generate_key()
    csr = pki.make_csr(key, pki.Kind.AGENT, "node-002", SITE)
    der = x509.load_pem_x509_csr(csr).public_bytes(serialization.Encoding.DER)
    # the subject edited after signing: node-002's key now claims node-001
    assert der.count(b"node-002") == 1
    forged_der = der.replace(b"node-002", b"node-001")
    forged = x509.load_der_x509_csr(forged_der).public_bytes(serialization.Encoding.PEM)
    assert x509.load_pem_x509_csr(forged).subject.rfc4514_string().startswith("CN=node-001")
    with pytest.raises(pki.CertError, match="signature does not verify"):
        _sign(ca, forged)
    for garbage in (b"", b"garbage", b"-----BEGIN CERTIFICATE REQUEST-----\nAAAA\n-----END"):
        with pytest.raises(pki.CertError, match="not a PEM certificate request"):
            _sign(ca, garbage)
    with pytest.raises(pki.CertError):  # a certificate is not a request
        _sign(ca, ca[0])
    # a CA that is not one: a key that does not load
    good = pki.make_csr(key, pki.Kind.AGENT, "node-001", SITE)
    with pytest.raises(pki.CertError, match="private key"):
        pki.sign_csr(
            ca[0],
            b"nope",
            good,
            kind=pki.Kind.AGENT,
            name="node-001",
            site=SITE,
            now=NOW,
            lifetime=3600,
        )


def test_sign_csr_refuses_long_bootstrap_and_non_positive_lifetimes(
    ca: tuple[bytes, bytes],
) -> None:
    key = pki.generate_key()
    boot = pki.make_csr(key, pki.Kind.BOOTSTRAP, "node-001", SITE)
    with pytest.raises(pki.CertError, match="bootstrap"):
        _sign(ca, boot, kind=pki.Kind.BOOTSTRAP, lifetime=3601.0)
    with pytest.raises(pki.CertError, match="bootstrap"):
        _sign(ca, boot, kind=pki.Kind.BOOTSTRAP, lifetime=7200.0)
    _start, end = pki.validity(_sign(ca, boot, kind=pki.Kind.BOOTSTRAP, lifetime=3600.0))
    assert end == pytest.approx(NOW + pki.BOOTSTRAP_MAX_LIFETIME, abs=1)
    agent = pki.make_csr(key, pki.Kind.AGENT, "node-001", SITE)
    for lifetime in (0.0, -1.0, -3600.0):
        with pytest.raises(pki.CertError, match="positive"):
            _sign(ca, agent, lifetime=lifetime)
        with pytest.raises(pki.CertError):
            _sign(ca, boot, kind=pki.Kind.BOOTSTRAP, lifetime=lifetime)
    # other kinds are not held to the bootstrap limit
    assert _sign(ca, agent, lifetime=3 * 86400.0)


def test_a_certificate_never_outlives_its_ca() -> None:
    short_ca = pki.create_ca(SITE, now=NOW, lifetime=1000.0)
    ca_end = pki.validity(short_ca[0])[1]
    cert, _ = pki.issue(
        *short_ca, kind=pki.Kind.AGENT, name="n1", site=SITE, now=NOW, lifetime=86400
    )
    assert pki.validity(cert)[1] == ca_end
    cert, _ = pki.issue(*short_ca, kind=pki.Kind.AGENT, name="n1", site=SITE, now=NOW, lifetime=10)
    assert pki.validity(cert)[1] == pytest.approx(NOW + 10, abs=1)
    assert pki.validity(cert)[1] < ca_end


def test_renew_at_two_thirds_of_the_lifetime(ca: tuple[bytes, bytes]) -> None:
    for lifetime in (3.0, 3600.0, 3 * 86400.0):
        cert, _ = pki.issue(
            *ca, kind=pki.Kind.AGENT, name="n1", site=SITE, now=NOW, lifetime=lifetime
        )
        start, end = pki.validity(cert)
        at = pki.renew_at(cert)
        assert start < at < end
        assert (at - start) / (end - start) == pytest.approx(2 / 3)
        assert at == pytest.approx(start + (end - start) * 2 / 3, abs=1e-6)


# --------------------------------------------------------------------------- peer identity


@pytest.mark.parametrize("kind", list(pki.Kind))
def test_peer_identity_of_each_kind_from_a_real_handshake(
    ca: tuple[bytes, bytes], server_ctx: ssl.SSLContext, kind: pki.Kind
) -> None:
    lifetime = 600.0
    cert, key = pki.issue(*ca, kind=kind, name="node-042", site=SITE, now=NOW, lifetime=lifetime)
    peer = peercert_of(server_ctx, [ca[0]], cert, key)
    who = pki.peer_identity(peer)
    assert who is not None
    assert (who.kind, who.name, who.site, who.source) == (kind, "node-042", SITE, "cert")
    assert who.issuer == pki.ca_name(SITE)
    assert serial_int(who.serial) == load(cert).serial_number
    # getpeercert() has whole seconds
    assert who.not_after == pytest.approx(pki.validity(cert)[1], abs=1)
    node_kinds = (pki.Kind.AGENT, pki.Kind.BOOTSTRAP)
    assert who.node_id == ("node-042" if kind in node_kinds else "")
    assert who.mode == ("bootstrap" if kind is pki.Kind.BOOTSTRAP else "quorum-ca")


def test_peer_identity_mode_site_ca(server_ctx: ssl.SSLContext, ca: tuple[bytes, bytes]) -> None:
    """A certificate from the site's own PKI (another issuer) is site-ca; a bootstrap
    certificate is bootstrap whoever signed it."""
    site_pki = foreign_ca("ALPS Site Issuing CA 2")
    server = pki.server_context(*_server_pair(ca), [ca[0], site_pki[0]])
    cert, key = pki.issue(
        *site_pki, kind=pki.Kind.AGENT, name="n7", site=SITE, now=NOW, lifetime=3600
    )
    who = pki.peer_identity(peercert_of(server, [ca[0]], cert, key))
    assert who is not None
    assert (who.mode, who.issuer, who.node_id) == ("site-ca", "ALPS Site Issuing CA 2", "n7")
    cert, key = pki.issue(
        *site_pki, kind=pki.Kind.BOOTSTRAP, name="n7", site=SITE, now=NOW, lifetime=3600
    )
    who = pki.peer_identity(peercert_of(server, [ca[0]], cert, key))
    assert who is not None and who.mode == "bootstrap"
    # the internal CA of another site is not this site's quorum CA
    other = pki.create_ca("other", now=NOW)
    server = pki.server_context(*_server_pair(ca), [ca[0], other[0]])
    cert, key = pki.issue(
        *other, kind=pki.Kind.SCHEDULER, name="s", site=SITE, now=NOW, lifetime=3600
    )
    who = pki.peer_identity(peercert_of(server, [ca[0]], cert, key))
    assert who is not None and who.mode == "site-ca"


def _server_pair(ca: tuple[bytes, bytes]) -> tuple[bytes, bytes]:
    return pki.issue(*ca, kind=pki.Kind.API, name="api", site=SITE, now=NOW, lifetime=3600)


def _der_certificates(blob: bytes) -> list[x509.Certificate]:
    """Split concatenated DER certificates (an X.509-SVID chain on the wire)."""
    out = []
    while blob:
        assert blob[0] == 0x30  # SEQUENCE
        n = blob[1]
        if n & 0x80:  # long form: the next n & 0x7F bytes are the length
            size = int.from_bytes(blob[2 : 2 + (n & 0x7F)], "big")
            end = 2 + (n & 0x7F) + size
        else:
            end = 2 + n
        out.append(x509.load_der_x509_certificate(blob[:end]))
        blob = blob[end:]
    return out


def _svid_pem(svid: FakeSvid) -> tuple[bytes, bytes]:
    """(chain PEM, key PEM) of an SVID, leaf first."""
    chain = _der_certificates(svid.chain_der)
    key = serialization.load_der_private_key(svid.key_der, password=None)
    return b"".join(pki.cert_pem(c) for c in chain), pki.key_pem(key)  # type: ignore[arg-type]


def test_peer_identity_of_a_spiffe_svid(ca: tuple[bytes, bytes]) -> None:
    spire = SpiffeCA(f"{SITE}.lattice.internal")
    server = pki.server_context(*_server_pair(ca), [ca[0], spire.bundle_pem])
    for intermediate in (False, True):
        svid = spire.issue_agent("node-042", ttl=600, intermediate=intermediate)
        cert, key = _svid_pem(svid)
        peer = peercert_of(server, [ca[0]], cert, key)
        assert ("URI", f"spiffe://{SITE}.lattice.internal/lattice/agent/node-042") in peer[
            "subjectAltName"
        ]
        who = pki.peer_identity(peer)
        assert who is not None
        assert (who.kind, who.name, who.site, who.source, who.mode) == (
            pki.Kind.AGENT,
            "node-042",
            SITE,
            "spiffe",
            "spiffe",
        )
        assert who.node_id == "node-042"
    # an SVID of another workload names no Lattice component (and has no OU)
    for path in ("lattice/scheduler/s1", "lattice/agent", "lattice/agent/n1/extra", "web/n1"):
        cert, key = _svid_pem(spire.issue(f"spiffe://{SITE}.lattice.internal/{path}", ttl=600))
        assert pki.peer_identity(peercert_of(server, [ca[0]], cert, key)) is None, path


def test_peer_identity_none_without_a_lattice_ou(
    ca: tuple[bytes, bytes], server_ctx: ssl.SSLContext
) -> None:
    cn = x509.NameAttribute(NameOID.COMMON_NAME, "node-042.alps.lattice.internal")
    subjects = {
        "no OU": x509.Name([x509.NameAttribute(NameOID.ORGANIZATION_NAME, "Lattice"), cn]),
        "unknown OU": x509.Name(
            [x509.NameAttribute(NameOID.ORGANIZATIONAL_UNIT_NAME, "marketing"), cn]
        ),
        "CN outside lattice.internal": x509.Name(
            [
                x509.NameAttribute(NameOID.ORGANIZATIONAL_UNIT_NAME, "agent"),
                x509.NameAttribute(NameOID.COMMON_NAME, "node-042.example.org"),
            ]
        ),
        "CN without a site": x509.Name(
            [
                x509.NameAttribute(NameOID.ORGANIZATIONAL_UNIT_NAME, "agent"),
                x509.NameAttribute(NameOID.COMMON_NAME, "node-042"),
            ]
        ),
    }
    for why, subject in subjects.items():
        cert, key = leaf_signed_by(ca, subject)
        peer = peercert_of(server_ctx, [ca[0]], cert, key)
        assert peer["subject"], why
        assert pki.peer_identity(peer) is None, why
    assert pki.peer_identity(None) is None
    assert pki.peer_identity({}) is None  # CERT_OPTIONAL without a client certificate


def test_load_pair_replaces_the_presented_certificate(ca: tuple[bytes, bytes]) -> None:
    first, first_key = pki.issue(
        *ca, kind=pki.Kind.AGENT, name="n1", site=SITE, now=NOW, lifetime=600
    )
    client = pki.client_context([ca[0]], first, first_key)
    s_cert, s_key = _server_pair(ca)
    server = pki.server_context(s_cert, s_key, [ca[0]])

    s, c = handshake(server, client)
    who = pki.peer_identity(s.getpeercert())
    assert who is not None and serial_int(who.serial) == load(first).serial_number
    server_serial = int(c.getpeercert()["serialNumber"], 16)
    assert server_serial == load(s_cert).serial_number

    # the agent renewed: the same context presents the new certificate from now on
    renewed, renewed_key = pki.issue(
        *ca, kind=pki.Kind.AGENT, name="n1", site=SITE, now=NOW, lifetime=600
    )
    pki.load_pair(client, renewed, renewed_key)
    s2, _c2 = handshake(server, client)
    who2 = pki.peer_identity(s2.getpeercert())
    assert who2 is not None and serial_int(who2.serial) == load(renewed).serial_number
    # the connection made before is untouched
    assert s.getpeercert()["serialNumber"] != s2.getpeercert()["serialNumber"]
    assert pki.peer_identity(s.getpeercert()) == who

    # the server side too
    s_new, s_new_key = _server_pair(ca)
    pki.load_pair(server, s_new, s_new_key)
    _s3, c3 = handshake(server, client)
    assert int(c3.getpeercert()["serialNumber"], 16) == load(s_new).serial_number

    # a certificate with another key's private key does not load
    with pytest.raises(pki.CertError, match="do not load"):
        pki.load_pair(client, renewed, first_key)
    with pytest.raises(pki.CertError):
        pki.load_pair(client, b"not a cert", renewed_key)


def test_client_context_refuses_a_server_of_an_untrusted_ca(ca: tuple[bytes, bytes]) -> None:
    other = pki.create_ca(SITE, now=NOW)  # same name, another key
    server = pki.server_context(*_server_pair(other), [ca[0]], client_certs="none")
    with pytest.raises(ssl.SSLCertVerificationError):
        handshake(server, pki.client_context([ca[0]]))
    with pytest.raises(pki.CertError, match="no CA"):
        pki.client_context([])


def test_server_context_requires_a_client_certificate_of_a_trusted_ca(
    ca: tuple[bytes, bytes], server_ctx: ssl.SSLContext
) -> None:
    # TLS 1.3: the client finishes first; the server refuses when it reads the client's
    # (missing or unverifiable) certificate
    with pytest.raises(ssl.SSLError, match="PEER_DID_NOT_RETURN_A_CERTIFICATE"):
        handshake(server_ctx, pki.client_context([ca[0]]))
    foreign = pki.create_ca(SITE, now=NOW)
    cert, key = pki.issue(
        *foreign, kind=pki.Kind.AGENT, name="n1", site=SITE, now=NOW, lifetime=3600
    )
    with pytest.raises(ssl.SSLCertVerificationError):
        handshake(server_ctx, pki.client_context([ca[0]], cert, key))
    optional = pki.server_context(*_server_pair(ca), [ca[0]], client_certs="optional", alpn=None)
    s, _c = handshake(optional, pki.client_context([ca[0]], alpn=None))
    assert not s.getpeercert()  # None: no certificate, and the handshake completed


@settings(max_examples=60, deadline=None)
@given(
    name=st.from_regex(r"[A-Za-z0-9-]{1,24}", fullmatch=True),
    site=st.from_regex(r"[a-z0-9]([a-z0-9-]{0,14}[a-z0-9])?", fullmatch=True),
    kind=st.sampled_from(list(pki.Kind)),
)
def test_common_name_and_peer_identity_round_trip(
    ca: tuple[bytes, bytes], server_ctx: ssl.SSLContext, name: str, site: str, kind: pki.Kind
) -> None:
    cn = pki.common_name(name, site)
    assert cn == f"{name}.{site}.lattice.internal"
    cert, key = pki.issue(*ca, kind=kind, name=name, site=site, now=NOW, lifetime=600)
    assert load(cert).subject.get_attributes_for_oid(NameOID.COMMON_NAME)[0].value == cn
    who = pki.peer_identity(peercert_of(server_ctx, [ca[0]], cert, key))
    assert who is not None
    assert (who.kind, who.name, who.site) == (kind, name, site)


@pytest.mark.parametrize("name", ["", "node.042", "."])
def test_common_name_refuses_names_with_dots_or_empty(name: str) -> None:
    with pytest.raises(pki.CertError):
        pki.common_name(name, SITE)
    with pytest.raises(pki.CertError):
        pki.common_name("node-042", "")


def test_a_name_too_long_for_a_common_name_is_a_cert_error(ca: tuple[bytes, bytes]) -> None:
    name = "nid" + "0" * 45  # 48 + len(".alps.lattice.internal") = 70 > 64
    with pytest.raises(pki.CertError):
        pki.common_name(name, SITE)
    with pytest.raises(pki.CertError):
        pki.issue(*ca, kind=pki.Kind.AGENT, name=name, site=SITE, now=NOW, lifetime=3600)


def test_peer_identity_serial_matches_serial_of(
    ca: tuple[bytes, bytes], server_ctx: ssl.SSLContext
) -> None:
    subject = pki._subject(pki.Kind.AGENT, "node-042", SITE)
    cert, key = leaf_signed_by(ca, subject, serial=0xABC)
    who = pki.peer_identity(peercert_of(server_ctx, [ca[0]], cert, key))
    assert who is not None
    assert who.serial == pki.serial_of(cert)


def test_verification_error_for_a_foreign_chain(ca: tuple[bytes, bytes]) -> None:
    """The signed chain does not verify against another CA of the same name."""
    other = pki.create_ca(SITE, now=NOW)
    cert, _ = pki.issue(*other, kind=pki.Kind.AGENT, name="n1", site=SITE, now=NOW, lifetime=3600)
    when = dt.datetime.fromtimestamp(NOW + 10, dt.UTC)
    verifier = PolicyBuilder().store(Store([load(ca[0])])).time(when).build_client_verifier()
    with pytest.raises(VerificationError):
        verifier.verify(load(cert), [])
