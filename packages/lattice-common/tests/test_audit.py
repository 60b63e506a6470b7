"""The audit log's pure core: hash chain, signatures, export, and that any single-byte
change, deleted entry or swapped pair in an export is found and the first bad entry
named (property tests)."""

from __future__ import annotations

import functools
import itertools

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from lattice_common import audit
from lattice_common.audit import AuditEntry, AuditEvent

KEY = audit.generate_private_key()
OTHER = audit.generate_private_key()


def events(n: int, t0: float = 1_764_000_000.25) -> list[AuditEvent]:
    acts = [audit.NODE_DRAIN, audit.TENANT_UPDATE, audit.NODE_CLAIM, audit.AUTH_FAILED]
    return [
        AuditEvent(
            time=t0 + i * 1.5,
            actor=f"user{i % 3}",
            action=acts[i % len(acts)],
            target=f"node:n{i}",
            tenant="physics" if i % 2 else "",
            details={"reason": f"maintenance {i}", "é": "ü"},
        )
        for i in range(n)
    ]


def chain(n: int, key=KEY) -> list[AuditEntry]:
    return audit.seal(events(n), key, seq=0, prev_hash=audit.GENESIS)


@functools.cache
def exported(n: int) -> bytes:
    entries = chain(n)
    pems = {audit.key_id(KEY): audit.public_key_pem(KEY)}
    return b"".join(audit.export_lines(entries, KEY, pems, exported_at=1_764_000_100.0))


# --------------------------------------------------------------------------- the chain


def test_a_sealed_chain_verifies_and_links_each_entry_to_the_previous() -> None:
    entries = chain(5)
    assert [e.seq for e in entries] == [1, 2, 3, 4, 5]
    assert entries[0].prev_hash == audit.GENESIS
    for a, b in itertools.pairwise(entries):
        assert b.prev_hash == a.hash
    r = audit.verify_chain(entries, [KEY.public_key()])
    assert r.ok and r.count == 5 and r.last_hash == entries[-1].hash
    assert r.key_ids == (audit.key_id(KEY),)


def test_hash_covers_every_field_but_hash_and_signature() -> None:
    e = chain(1)[0]
    for field, value in [
        ("time", e.time + 1),
        ("actor", "mallory"),
        ("action", "x"),
        ("target", "node:zz"),
        ("tenant", "t"),
        ("details", {"reason": "other"}),
        ("key_id", "0" * 16),
    ]:
        edited = msgspec.structs.replace(e, **{field: value})
        r = audit.verify_chain([edited], [KEY.public_key()])
        assert not r.ok and r.first_bad == 1, field
    # a new hash over edited contents still needs the private key to sign it
    forged = msgspec.structs.replace(e, actor="mallory")
    forged.hash = audit.chain_hash(forged.prev_hash, audit.entry_body(forged))
    r = audit.verify_chain([forged], [KEY.public_key()])
    assert r.message == "entry 1: signature does not verify (edited, or signed by another key?)"


def test_verify_chain_names_the_first_bad_entry() -> None:
    entries = chain(6)
    keys = [KEY.public_key()]
    removed = entries[:2] + entries[3:]
    assert audit.verify_chain(removed, keys).message == (
        "entry 3: missing: the log goes on with entry 4 (removed?)"
    )
    swapped = [*entries[:1], entries[4], entries[2], entries[3], entries[1], entries[5]]
    assert audit.verify_chain(swapped, keys).message == (
        "entry 2: out of order: entry 5 stands in its place (reordered?)"
    )
    edited = list(entries)
    edited[3] = msgspec.structs.replace(edited[3], details={"reason": "nothing to see"})
    assert audit.verify_chain(edited, keys).message == (
        "entry 4: hash does not match its contents (edited?)"
    )
    assert audit.verify_chain(entries, [OTHER.public_key()]).message.startswith(
        "entry 1: signed by an unknown key"
    )


def test_a_chain_may_change_keys_and_a_verifier_trusts_several() -> None:
    first = chain(2)
    more = audit.seal(events(2), OTHER, seq=2, prev_hash=first[-1].hash)
    both = first + more
    assert audit.verify_chain(both, [KEY.public_key(), OTHER.public_key()]).ok
    r = audit.verify_chain(both, [KEY.public_key()])
    assert r.first_bad == 3 and "unknown key" in r.reason


def test_keys_persist_in_a_file(tmp_path) -> None:
    path = tmp_path / "d" / "audit.pem"
    key, created = audit.load_or_create_private_key(path)
    assert created and path.stat().st_mode & 0o777 == 0o600
    again, created = audit.load_or_create_private_key(path)
    assert not created and audit.key_id(again) == audit.key_id(key)
    pub = audit.load_public_key(audit.public_key_pem(key))
    assert audit.key_id(pub) == audit.key_id(key)
    assert audit.key_id(audit.load_public_key(path.read_bytes())) == audit.key_id(key)
    with pytest.raises(audit.AuditKeyError):
        audit.load_public_key("not a key")


# --------------------------------------------------------------------------- the export


def test_an_export_verifies_with_its_key_and_not_with_another() -> None:
    data = exported(4)
    header, entries = audit.read_export(data)
    assert header.format == audit.FORMAT and header.count == 4
    assert [e.seq for e in entries] == [1, 2, 3, 4]
    assert audit.verify_export(data, [audit.public_key_pem(KEY)]).ok
    assert audit.verify_export(data).ok  # the header's own keys
    r = audit.verify_export(data, [OTHER.public_key()])
    assert r.first_bad == 0 and "unknown key" in r.reason


def test_an_empty_log_exports_and_verifies() -> None:
    data = b"".join(audit.export_lines([], KEY, {}, exported_at=1.0))
    r = audit.verify_export(data, [KEY.public_key()])
    assert r.ok and r.count == 0


def test_removing_the_last_entry_is_found_through_the_signed_header() -> None:
    data = exported(4)
    lines = data.splitlines(keepends=True)
    r = audit.verify_export(b"".join(lines[:-1]), [KEY.public_key()])
    assert r.first_bad == 4 and "removed" in r.reason


def test_a_partial_export_verifies_from_its_first_entry() -> None:
    entries = chain(5)[2:]
    data = b"".join(audit.export_lines(entries, KEY, {}, exported_at=2.0))
    assert audit.verify_export(data, [KEY.public_key()]).ok


N = 6


def _line_of(data: bytes, offset: int) -> int:
    return data.count(b"\n", 0, offset)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_any_single_byte_change_names_its_entry(data: st.DataObject) -> None:
    raw = exported(N)
    offset = data.draw(st.integers(0, len(raw) - 1), label="offset")
    new = data.draw(st.integers(0, 255).filter(lambda b: b != raw[offset]), label="byte")
    flipped = raw[:offset] + bytes([new]) + raw[offset + 1 :]
    r = audit.verify_export(flipped, [KEY.public_key()])
    assert not r.ok
    assert r.first_bad == _line_of(raw, offset), r.message


@settings(max_examples=50, deadline=None)
@given(st.integers(1, N))
def test_deleting_any_entry_names_it(k: int) -> None:
    lines = exported(N).splitlines(keepends=True)
    r = audit.verify_export(b"".join(lines[:k] + lines[k + 1 :]), [KEY.public_key()])
    assert not r.ok and r.first_bad == k, r.message


@settings(max_examples=50, deadline=None)
@given(st.integers(1, N), st.integers(1, N))
def test_swapping_any_two_entries_names_the_first(i: int, j: int) -> None:
    if i == j:
        return
    i, j = min(i, j), max(i, j)
    lines = exported(N).splitlines(keepends=True)
    lines[i], lines[j] = lines[j], lines[i]
    r = audit.verify_export(b"".join(lines), [KEY.public_key()])
    assert not r.ok and r.first_bad == i, r.message
    assert "reordered" in r.reason


def test_messages_a_user_reads() -> None:
    lines = exported(N).splitlines(keepends=True)
    keys = [KEY.public_key()]
    edited = lines[3].replace(b"maintenance 2", b"maintenance X")
    r = audit.verify_export(b"".join([*lines[:3], edited, *lines[4:]]), keys)
    assert r.message == "entry 3: hash does not match its contents (edited?)"
    r = audit.verify_export(b"".join(lines[:2] + lines[3:]), keys)
    assert r.message == "entry 2: missing: the log goes on with entry 3 (removed?)"
    lines[2], lines[5] = lines[5], lines[2]
    r = audit.verify_export(b"".join(lines), keys)
    assert r.message == "entry 2: out of order: entry 5 stands in its place (reordered?)"
