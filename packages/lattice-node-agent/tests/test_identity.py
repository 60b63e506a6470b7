"""identity: user_map and NSS resolution, root refusal, the setpriv prefix (run for real as
root), directory access by mode bits."""

from __future__ import annotations

import os
import pwd
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st
from lattice_agent.identity import (
    NO_HOME,
    IdentityError,
    IdentityPolicy,
    MapTarget,
    RunAs,
    may_enter,
    parse_map_value,
    resolve,
)
from lattice_test_harness.builders import allocation

NOBODY = pwd.getpwnam("nobody")
as_root = pytest.mark.skipif(os.geteuid() != 0, reason="switching users needs root")


def nobody() -> RunAs:
    return resolve("nobody", user_map={}, allow_root=False, node_id="n1")


# ---------------------------------------------------------------------- user_map parser


def test_map_values() -> None:
    assert parse_map_value("1234:5678") == MapTarget(uid=1234, gid=5678)
    assert parse_map_value(" 1234 ") == MapTarget(uid=1234)
    assert parse_map_value(1234) == MapTarget(uid=1234)
    assert parse_map_value("alice") == MapTarget(name="alice")
    assert parse_map_value("alice@example.org") == MapTarget(name="alice@example.org")
    for bad in ("", "a:b", "1:", ":1", "al ice", "1:2:3", str(2**32), True, None, 1.5, -1):
        with pytest.raises(ValueError, match="user_map value"):
            parse_map_value(bad)  # type: ignore[arg-type]


ids = st.integers(min_value=0, max_value=2**32 - 2)


@given(ids, ids)
def test_map_ids_round_trip(uid: int, gid: int) -> None:
    assert parse_map_value(f"{uid}:{gid}") == MapTarget(uid=uid, gid=gid)
    assert parse_map_value(str(uid)) == parse_map_value(uid) == MapTarget(uid=uid)


@given(st.text(max_size=40))
def test_map_parser_answers_or_refuses_cleanly(text: str) -> None:
    try:
        target = parse_map_value(text)
    except ValueError:
        return
    if target.name:  # a name is never all digits and has no ':' or whitespace
        assert target.name == text.strip() and not target.name.isdigit()
        assert ":" not in target.name and not any(c.isspace() for c in target.name)
    else:
        assert target.uid is not None and 0 <= target.uid <= 2**32 - 2


# ---------------------------------------------------------------------- resolution


def test_map_ids_without_passwd_entry() -> None:
    who = resolve("alice", user_map={"alice": "4000123:4000456"}, allow_root=False)
    assert who == RunAs(uid=4000123, gid=4000456, groups=(), home=NO_HOME, name="alice")


def test_map_uid_with_passwd_entry_takes_its_name_home_and_group() -> None:
    who = resolve("alice", user_map={"alice": str(NOBODY.pw_uid)}, allow_root=False)
    assert (who.uid, who.gid, who.name) == (NOBODY.pw_uid, NOBODY.pw_gid, "nobody")
    assert who.home == NOBODY.pw_dir and who.groups[0] == NOBODY.pw_gid


def test_map_to_local_name_and_map_before_nss() -> None:
    who = resolve("alice", user_map={"alice": "nobody"}, allow_root=False)
    assert (who.uid, who.name) == (NOBODY.pw_uid, "nobody")
    # the map wins over NSS: "root" is mapped away from uid 0
    who = resolve("root", user_map={"root": "nobody"}, allow_root=False)
    assert who.uid == NOBODY.pw_uid


def test_nss_entry() -> None:
    who = nobody()
    assert (who.uid, who.gid, who.home, who.name) == (
        NOBODY.pw_uid,
        NOBODY.pw_gid,
        NOBODY.pw_dir,
        "nobody",
    )
    assert who.groups[0] == NOBODY.pw_gid
    assert set(who.groups) == {NOBODY.pw_gid, *os.getgrouplist("nobody", NOBODY.pw_gid)}


def test_unknown_user() -> None:
    with pytest.raises(IdentityError) as e:
        resolve("lattice-no-such-user", user_map={}, allow_root=False, node_id="n7")
    assert e.value.message == (
        "user lattice-no-such-user has no account on node n7 "
        "(no NSS entry and no node_agent.user_map entry)"
    )
    assert "Hint: " in str(e.value) and "user_map" in e.value.hint
    with pytest.raises(IdentityError, match=r"mapped to lattice-no-such-user.*no account"):
        resolve("alice", user_map={"alice": "lattice-no-such-user"}, allow_root=False)
    with pytest.raises(IdentityError, match="user_map entry for alice"):
        resolve("alice", user_map={"alice": "x:y"}, allow_root=False)
    with pytest.raises(IdentityError, match="no submitting user"):
        resolve("", user_map={}, allow_root=True)


def test_root_refused_unless_allowed() -> None:
    for user, user_map in (("root", {}), ("alice", {"alice": "0:0"})):
        with pytest.raises(IdentityError) as e:
            resolve(user, user_map=user_map, allow_root=False)
        assert e.value.message == "allocation would run as root; the vCluster does not allow it"
        assert "root_vclusters" in e.value.hint
        assert resolve(user, user_map=user_map, allow_root=True).uid == 0


def test_policy() -> None:
    root_job = allocation(user="root", vcluster="ops")
    assert IdentityPolicy().run_as(root_job) == RunAs.agent()  # default: the agent itself
    policy = IdentityPolicy(node_id="n1", mode="submitter", root_vclusters=frozenset({"ops"}))
    if os.geteuid() == 0:
        assert policy.run_as(root_job).uid == 0
    with pytest.raises(IdentityError, match="vCluster does not allow it"):
        policy.run_as(allocation(user="root", vcluster="batch"))
    with pytest.raises(IdentityError, match="has no account on node n1"):
        policy.run_as(allocation(user="lattice-no-such-user"))
    with pytest.raises(ValueError, match=r"user_map\['alice'\]"):
        IdentityPolicy(mode="submitter", user_map={"alice": "a b"})


# ---------------------------------------------------------------------- switching


def test_the_agent_itself_switches_nothing() -> None:
    me = RunAs.agent()
    assert (me.uid, me.gid) == (os.geteuid(), os.getegid())
    assert not me.switches and me.argv_prefix() == [] and me.environment() == {}


def test_prefix_and_environment() -> None:
    who = RunAs(uid=4000123, gid=4000456, groups=(4000456, 27), home="/h", name="u", shell="/s")
    prefix = who.argv_prefix(keep_pdeathsig=True)
    assert prefix[0].endswith("/setpriv") and prefix[-1] == "--"
    assert prefix[1:-1] == [
        "--reuid=4000123",
        "--regid=4000456",
        "--groups=4000456,27",
        "--inh-caps=-all",
        "--pdeathsig=keep",
    ]
    assert "--clear-groups" in RunAs(4000123, 1, (), "/", "u").argv_prefix()
    assert who.environment() == {"HOME": "/h", "USER": "u", "LOGNAME": "u", "SHELL": "/s"}


@as_root
def test_prefix_runs_the_command_as_the_user() -> None:
    who = nobody()
    out = subprocess.run(
        [*who.argv_prefix(), "sh", "-c", "id -u; id -g; id -G; grep CapEff /proc/self/status"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split("\n")
    assert out[0] == str(who.uid) and out[1] == str(who.gid)
    assert {int(g) for g in out[2].split()} == set(who.groups)
    assert out[3].split()[1] == "0000000000000000"  # no capabilities left


# ---------------------------------------------------------------------- directory access


@pytest.fixture
def open_tmp() -> Iterator[Path]:
    """A directory everyone can reach (pytest's tmp_path is under a root-only one)."""
    d = Path(tempfile.mkdtemp(prefix="lattice-identity-"))
    d.chmod(0o755)
    yield d
    shutil.rmtree(d)


@as_root
def test_may_enter_by_mode_bits(open_tmp: Path) -> None:
    who = nobody()
    tmp_path = open_tmp
    open_dir = tmp_path / "open" / "inner"
    open_dir.mkdir(parents=True)
    closed = tmp_path / "closed"
    closed.mkdir(mode=0o700)
    (tmp_path / "open").chmod(0o711)
    assert may_enter(str(open_dir), who) is True
    assert may_enter(str(closed), who) is False
    (tmp_path / "link").symlink_to(closed)  # the target's bits count too
    assert may_enter(str(tmp_path / "link"), who) is False
    os.chown(closed, who.uid, who.gid)
    assert may_enter(str(closed), who) is True
    assert may_enter(str(closed), RunAs(0, 0, (), "/root", "root")) is True
