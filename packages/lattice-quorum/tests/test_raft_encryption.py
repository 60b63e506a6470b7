"""Raft peer traffic encrypted and authenticated with ``quorum.raft_password``.

Real pysyncobj members on loopback. With a password pysyncobj wraps every frame in a
Fernet token (key: PBKDF2-HMAC-SHA256 of the password) and binds each connection to two
random 32-byte keys exchanged on connect; a frame that is not a valid token under the
key (plaintext, or another password) makes the member drop the connection before the
frame is unpickled. These tests show: members sharing the password form a quorum; a
member with another password or none is never connected and never commits; a plaintext
client speaking the unencrypted wire format is disconnected without any effect (while
the same bytes do act on a member without a password); the password is never logged
and not kept in clear on the member.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import pickle
import socket
import struct
import time
import zlib
from collections.abc import AsyncIterator, Callable, Sequence
from pathlib import Path
from typing import Any

import pytest
from lattice_cli.devcluster import free_port
from lattice_common import commands as c
from lattice_common.config import QuorumConfig, load_config
from lattice_common.errors import LatticeError, ValidationError
from lattice_quorum.member import MARKER, QuorumMember
from lattice_test_harness import builders as b
from pysyncobj.utility import TcpUtility, UtilityException

pytestmark = pytest.mark.timeout(60)

PASSWORD = "raft-pw-7f3c9a1e-do-not-log"
FORGED_TERM = 10**6


async def eventually(pred: Callable[[], bool], timeout: float = 10.0, what: str = "") -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what or pred}")
        await asyncio.sleep(0.02)


@contextlib.asynccontextmanager
async def cluster(
    tmp_path: Path, passwords: Sequence[str | None], **kw: Any
) -> AsyncIterator[list[QuorumMember]]:
    """One member per password (ids 1..n, member 1 bootstraps), each listing the others."""
    addrs = {i: f"127.0.0.1:{free_port()}" for i in range(1, len(passwords) + 1)}
    members: list[QuorumMember] = []
    loop = asyncio.get_running_loop()
    try:
        for i, pw in enumerate(passwords, start=1):
            m = QuorumMember(
                node_id=i,
                bind=addrs[i],
                peers={j: a for j, a in addrs.items() if j != i},
                data_dir=tmp_path / f"m{i}",
                bootstrap=i == 1,
                raft_password=pw,
                **kw,
            )
            m.attach_loop(loop)
            members.append(m)
        yield members
    finally:
        for m in members:
            m.close()


async def leader_of(members: Sequence[QuorumMember]) -> QuorumMember:
    """Wait until exactly one of ``members`` leads and all of them follow it."""

    def settled() -> bool:
        leaders = [m for m in members if m.is_leader]
        return len(leaders) == 1 and all(m.caught_up for m in members)

    await eventually(settled, what="a leader that every member follows")
    return next(m for m in members if m.is_leader)


async def commit(leader: QuorumMember, name: str) -> int:
    res = await leader.propose(c.CreateTenant(tenant=b.tenant(name), now=1.0))
    assert res.error is None, res.error
    return res.revision


def tenants(m: QuorumMember) -> set[str]:
    return m.read(lambda s: set(s.tenants))


def connected_peers(m: QuorumMember) -> dict[int, bool]:
    return {p["id"]: p["state"] == "connected" for p in m.status()["members"][1:]}


# --- the unencrypted wire format, spoken by hand ---------------------------------------


def plain_frame(message: object) -> bytes:
    """One frame as a member without a password sends it (pysyncobj TcpConnection.send):
    a native int32 length, then zlib(pickle(message))."""
    data = zlib.compress(pickle.dumps(message), 3)
    return struct.pack("i", len(data)) + data


def _complete(buf: bytes) -> bool:
    return len(buf) >= 4 and len(buf) - 4 >= struct.unpack("i", buf[:4])[0]


def plaintext_probe(
    address: str, messages: Sequence[object], wait: float = 5.0
) -> tuple[bytes, bool]:
    """Connect to a Raft port, send ``messages`` as plaintext frames, and return (what
    came back, whether the member closed the connection). Stops at the first complete
    reply frame, at close, or after ``wait`` seconds."""
    host, port = address.rsplit(":", 1)
    received = b""
    with socket.create_connection((host, int(port)), timeout=wait) as s:
        s.sendall(b"".join(plain_frame(m) for m in messages))
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline:
            try:
                chunk = s.recv(65536)
            except ConnectionResetError:
                return received, True
            except TimeoutError:
                break
            if not chunk:
                return received, True
            received += chunk
            if _complete(received):
                break
    return received, False


def decode_reply(buf: bytes) -> Any:
    n = struct.unpack("i", buf[:4])[0]
    return pickle.loads(zlib.decompress(buf[4 : 4 + n]))


def forged_messages(victim: str, impersonated: str) -> list[list[object]]:
    """Plaintext messages that act on a member without a password, one connection each:
    ``victim`` is the member to remove, ``impersonated`` the one to pose as."""
    vote = {
        "type": "request_vote",
        "term": FORGED_TERM,
        "last_log_index": 10**9,
        "last_log_term": FORGED_TERM,
    }
    return [
        [["status"]],  # utility: the member's status
        [["remove", victim]],  # utility: a membership change through Raft
        ["readonly"],  # register as a read-only node: receive the whole log
        [impersonated, vote],  # pose as a member, then force a new term
    ]


# --- (a) same password: a working quorum -----------------------------------------------


async def test_members_with_the_same_password_elect_and_commit(tmp_path: Path) -> None:
    async with cluster(tmp_path, [PASSWORD] * 3) as ms:
        assert all(m.encrypted and m.syncobj.encryptor is not None for m in ms)
        leader = await leader_of(ms)
        rev = await commit(leader, "t1")
        await eventually(lambda: all(m.revision == rev for m in ms), what="replication")
        assert all(tenants(m) == {"t1"} for m in ms)
        await eventually(
            lambda: all(all(connected_peers(m).values()) for m in ms), what="all connected"
        )
        # A follower's proposal commits too (forwarded to the leader over the
        # encrypted connection).
        follower = next(m for m in ms if not m.is_leader)
        rev = await commit(follower, "t2")
        await eventually(lambda: all(m.revision == rev for m in ms), what="replication")
        assert all(tenants(m) == {"t1", "t2"} for m in ms)


# --- (b) wrong or missing password: never part of the quorum ---------------------------


@pytest.mark.parametrize("bad", ["another-password", None], ids=["wrong", "none"])
async def test_member_without_the_password_cannot_join(tmp_path: Path, bad: str | None) -> None:
    async with cluster(tmp_path, [PASSWORD, PASSWORD, bad], commit_timeout=0.5) as ms:
        good, outsider = ms[:2], ms[2]
        leader = await leader_of(good)  # 2 of 3: a majority without the outsider
        rev = await commit(leader, "t1")
        await eventually(lambda: all(m.revision == rev for m in good), what="replication")
        # The outsider proposes: no leader ever reaches it, so nothing commits; the
        # others keep working meanwhile.
        evil = asyncio.ensure_future(
            outsider.propose(c.CreateTenant(tenant=b.tenant("evil"), now=1.0))
        )
        rev = await commit(leader, "t2")
        await eventually(lambda: all(m.revision == rev for m in good), what="replication")
        with pytest.raises((TimeoutError, LatticeError)):
            await evil
        assert all(tenants(m) == {"t1", "t2"} for m in good)
        assert outsider.revision == 0
        assert tenants(outsider) == set()
        assert not outsider.caught_up and not outsider.is_leader
        assert outsider.syncobj.getStatus()["commit_idx"] <= 1  # its own no-op at most
        for m in good:
            assert connected_peers(m) == {p: p != 3 for p in connected_peers(m)}


# --- (c) a plaintext client on the Raft port ---------------------------------------------


async def test_plaintext_client_is_disconnected_without_effect(tmp_path: Path) -> None:
    async with cluster(tmp_path, [PASSWORD] * 3) as ms:
        leader = await leader_of(ms)
        rev = await commit(leader, "t1")
        f1, f2 = (m.bind for m in ms if not m.is_leader)
        for target in ms:  # the leader and both followers
            for messages in forged_messages(f1, f2):
                received, closed = await asyncio.to_thread(plaintext_probe, target.bind, messages)
                assert (received, closed) == (b"", True), (target.node_id, messages)
        for m in ms:
            st = m.syncobj.getStatus()
            assert st["raft_term"] < FORGED_TERM
            assert st["partner_nodes_count"] == 2  # nobody removed
            assert st["readonly_nodes_count"] == 0  # nobody listening in
            assert m.revision == rev
        leader = await leader_of(ms)  # still one leader, everyone connected
        await eventually(
            lambda: all(all(connected_peers(m).values()) for m in ms), what="all connected"
        )
        rev = await commit(leader, "t2")
        await eventually(lambda: all(m.revision == rev for m in ms), what="replication")
        # The password itself is what gets in: pysyncobj's own client with it is
        # answered, with another one it is dropped as the plaintext client was.
        status = await asyncio.to_thread(
            TcpUtility(PASSWORD, timeout=5).executeCommand, leader.bind, ["status"]
        )
        assert status["raft_term"] == leader.syncobj.getStatus()["raft_term"]
        with pytest.raises(UtilityException, match="connection lost"):
            await asyncio.to_thread(
                TcpUtility("another-password", timeout=5).executeCommand, leader.bind, ["status"]
            )


async def test_the_same_plaintext_bytes_act_on_a_member_without_password(tmp_path: Path) -> None:
    """The control for the test above: the forged frames are valid pysyncobj messages."""
    async with cluster(tmp_path, [None] * 3) as ms:
        leader = await leader_of(ms)
        f1, f2 = (m.bind for m in ms if not m.is_leader)
        status_msg, remove_msg, readonly_msg, vote_msgs = forged_messages(f1, f2)
        received, closed = await asyncio.to_thread(plaintext_probe, leader.bind, status_msg)
        assert not closed
        assert decode_reply(received)["raft_term"] >= 1
        host, port = leader.bind.rsplit(":", 1)
        with socket.create_connection((host, int(port)), timeout=5) as listener:
            listener.sendall(plain_frame(readonly_msg[0]))
            await eventually(
                lambda: leader.syncobj.getStatus()["readonly_nodes_count"] == 1,
                what="the read-only listener",
            )
        received, _ = await asyncio.to_thread(plaintext_probe, leader.bind, remove_msg)
        assert decode_reply(received).startswith("SUCCESS")
        await eventually(
            lambda: leader.syncobj.getStatus()["partner_nodes_count"] == 1,
            what="the forged removal",
        )
        await asyncio.to_thread(plaintext_probe, leader.bind, vote_msgs, 0.5)
        await eventually(
            lambda: leader.syncobj.getStatus()["raft_term"] >= FORGED_TERM,
            what="the forged term",
        )


# --- (d) the password stays secret ------------------------------------------------------


async def test_password_is_never_logged_nor_kept(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    async with cluster(tmp_path, [PASSWORD, PASSWORD, "another-password"]) as ms:
        leader = await leader_of(ms[:2])
        await commit(leader, "t1")
        await asyncio.to_thread(plaintext_probe, leader.bind, [["status"]])  # a dropped peer
        for m in ms:
            assert PASSWORD not in repr(m)
            assert PASSWORD not in repr(vars(m))
            assert PASSWORD not in repr(m.status())
            assert m.syncobj.conf.password is None  # clear text dropped after key derivation
            assert PASSWORD not in repr(vars(m.syncobj.conf))
    assert "encrypted and authenticated" in caplog.text  # the member did log
    assert PASSWORD not in caplog.text
    assert "another-password" not in caplog.text
    for rec in caplog.records:
        assert PASSWORD not in repr(rec.args)


def test_empty_password_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValidationError, match="must not be empty"):
        QuorumMember(
            node_id=1,
            bind=f"127.0.0.1:{free_port()}",
            peers={},
            data_dir=tmp_path,
            bootstrap=True,
            raft_password="  ",
        )
    assert not (tmp_path / MARKER).exists()


async def test_no_password_with_peers_warns(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="lattice.quorum")
    async with cluster(tmp_path, [None, None]) as ms:
        assert not any(m.encrypted for m in ms)
    assert "NOT encrypted or authenticated" in caplog.text


# --- configuration: quorum.raft_password ------------------------------------------------


def test_config_raft_password_forms(tmp_path: Path) -> None:
    assert QuorumConfig().raft_password is None
    cfg = load_config(None, env={"LATTICE_RAFT_PASSWORD": PASSWORD})
    assert cfg.quorum.raft_password is not None
    assert cfg.quorum.raft_password.get_secret_value() == PASSWORD
    assert PASSWORD not in repr(cfg) and PASSWORD not in cfg.model_dump_json()
    # the section form wins over the short name
    cfg = load_config(
        None, env={"LATTICE_RAFT_PASSWORD": "short", "LATTICE_QUORUM__RAFT_PASSWORD": "long"}
    )
    assert cfg.quorum.raft_password is not None
    assert cfg.quorum.raft_password.get_secret_value() == "long"
    # a reference is resolved like the other secrets, and remembered for rotation checks
    cfg = load_config(None, env={"LATTICE_RAFT_PASSWORD": "env://RAFT_PW", "RAFT_PW": PASSWORD})
    assert cfg.quorum.raft_password is not None
    assert cfg.quorum.raft_password.get_secret_value() == PASSWORD
    assert cfg.secret_refs == {"quorum.raft_password": "env://RAFT_PW"}
    secret = tmp_path / "raft.pw"
    secret.write_text(PASSWORD + "\n")
    secret.chmod(0o600)
    path = tmp_path / "c.yaml"
    path.write_text(f"quorum:\n  raft_password: file://{secret}\n")
    cfg = load_config(path, env={})
    assert cfg.quorum.raft_password is not None
    assert cfg.quorum.raft_password.get_secret_value() == PASSWORD
    with pytest.raises(ValidationError) as ei:
        load_config(None, env={"LATTICE_RAFT_PASSWORD": " "})
    assert "quorum.raft_password" in ei.value.message
