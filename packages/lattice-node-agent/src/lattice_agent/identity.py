"""Who an allocation's processes run as: the submitting user, as a local account.

The agent runs as root in production (it creates cgroups and mounts uenv images), but a
job must never do so: its processes run as the submitter (spec: processes run as
submitting user). The submitter's name becomes a local uid/gid through
``node_agent.user_map`` first (name -> ``"UID:GID"``, ``"UID"`` or a local user name:
sites whose login names differ from the node's accounts), then NSS (``getpwnam``,
supplementary groups from ``getgrouplist``). uid 0 is refused unless the allocation's
vCluster is in ``node_agent.root_vclusters``.

Switching happens in the started process, never in the agent: :meth:`RunAs.argv_prefix`
is util-linux ``setpriv`` (real and effective uid/gid, supplementary groups, no
inheritable capabilities) in front of the command. The job's environment is kept
(``spawn.environment`` builds it); :meth:`RunAs.environment` says the user's HOME, USER,
LOGNAME and SHELL. One prefix serves the batch wrapper (``spawn.py``), attach
(``attach.py``) and task launches (``pmi/server.py``). When the target is the agent's own
uid/gid (``node_agent.run_as: agent``, development clusters) there is no prefix and no
extra process at all.
"""

from __future__ import annotations

import functools
import os
import pwd
import re
import shutil
import socket
import stat
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Literal

from lattice_common.types import Allocation

__all__ = [
    "IdentityError",
    "IdentityPolicy",
    "MapTarget",
    "RunAs",
    "check_switchable",
    "may_enter",
    "parse_map_value",
    "resolve",
]

RunAsMode = Literal["submitter", "agent"]

_UID_MAX = 2**32 - 2  # (uid_t)-1 means "unchanged" to the kernel
_TOOL_PATH = "/usr/bin:/bin:/usr/sbin:/sbin"
#: HOME of a mapped uid without a passwd entry (Debian's convention for such accounts)
NO_HOME = "/nonexistent"
_IDS = re.compile(r"([0-9]+):([0-9]+)")
_UID = re.compile(r"[0-9]+")
# NSS names are not only POSIX portable ones (SSSD: alice@example.org); only ':' and
# whitespace can never be part of one
_NAME = re.compile(r"[^\s:]+")


class IdentityError(ValueError):
    """The allocation cannot run as its user here; the message is the user-facing cause."""

    def __init__(self, message: str, hint: str = "") -> None:
        super().__init__(f"{message}. Hint: {hint}" if hint else message)
        self.message = message
        self.hint = hint


@dataclass(frozen=True)
class RunAs:
    """A local identity to run processes as."""

    uid: int
    gid: int
    groups: tuple[int, ...]
    home: str
    name: str
    shell: str = ""

    @classmethod
    def agent(cls) -> RunAs:
        """The agent's own identity: nothing is switched (``node_agent.run_as: agent``)."""
        return _agent_identity()

    @property
    def switches(self) -> bool:
        """Whether starting a process as this identity needs a uid/gid change."""
        return (self.uid, self.gid) != (os.geteuid(), os.getegid())

    def argv_prefix(self, *, keep_pdeathsig: bool = False) -> list[str]:
        """``setpriv ... --`` to put in front of a command; [] when nothing switches.

        ``keep_pdeathsig``: the kernel clears the parent-death signal on a uid change;
        setpriv sets it again (task ranks must die with their agent)."""
        if not self.switches:
            return []
        groups = ",".join(str(g) for g in self.groups)
        argv = [
            _setpriv(self.name),
            f"--reuid={self.uid}",
            f"--regid={self.gid}",
            f"--groups={groups}" if groups else "--clear-groups",
            "--inh-caps=-all",  # nothing of the agent's capabilities reaches the job
        ]
        if keep_pdeathsig:
            argv.append("--pdeathsig=keep")
        return [*argv, "--"]

    def environment(self) -> dict[str, str]:
        """The user's HOME, USER, LOGNAME (and SHELL when known); {} when nothing switches
        (the agent's own environment already says who it is)."""
        if not self.switches:
            return {}
        env = {"HOME": self.home, "USER": self.name, "LOGNAME": self.name}
        if self.shell:
            env["SHELL"] = self.shell
        return env


@functools.cache
def _agent_identity() -> RunAs:
    # cached: an NSS lookup (LDAP, SSSD) per spawn would slow down every start
    uid, gid = os.geteuid(), os.getegid()
    try:
        pw = pwd.getpwuid(uid)
        name, home, shell = pw.pw_name, pw.pw_dir, pw.pw_shell
    except KeyError:
        name, home, shell = str(uid), os.environ.get("HOME", "/"), ""
    return RunAs(uid, gid, tuple(os.getgroups()), home, name, shell)


@functools.cache
def _setpriv_path() -> str:
    return shutil.which("setpriv", path=_TOOL_PATH) or ""


def _setpriv(user: str) -> str:
    found = _setpriv_path()
    if not found:
        raise IdentityError(
            f"cannot run processes as user {user}: setpriv (util-linux) not found",
            hint="install util-linux on the node",
        )
    return found


# ---------------------------------------------------------------------- user_map


@dataclass(frozen=True)
class MapTarget:
    """One ``node_agent.user_map`` value: ids (gid None: the uid's own) or a local name."""

    uid: int | None = None
    gid: int | None = None
    name: str = ""


def _id(text: str, what: str, value: object) -> int:
    n = int(text)
    if n > _UID_MAX:
        raise ValueError(f"user_map value {value!r}: {what} {n} is out of range")
    return n


def parse_map_value(value: str | int) -> MapTarget:
    """``"UID:GID"``, ``"UID"`` (or an int) or a local user name; ValueError otherwise.

    All digits is always a uid (a numeric user name cannot be mapped to)."""
    if isinstance(value, bool) or not isinstance(value, int | str):
        raise ValueError(f"user_map value {value!r}: expected 'UID:GID', 'UID' or a user name")
    if isinstance(value, int):
        if not 0 <= value <= _UID_MAX:
            raise ValueError(f"user_map value {value!r}: uid {value} is out of range")
        return MapTarget(uid=value)
    text = value.strip()
    if m := _IDS.fullmatch(text):
        return MapTarget(uid=_id(m[1], "uid", value), gid=_id(m[2], "gid", value))
    if _UID.fullmatch(text):
        return MapTarget(uid=_id(text, "uid", value))
    if _NAME.fullmatch(text) and not text.isdigit():  # "²" is a digit, not a uid or a name
        return MapTarget(name=text)
    raise ValueError(f"user_map value {value!r}: expected 'UID:GID', 'UID' or a user name")


# ---------------------------------------------------------------------- resolution


def _groups(name: str, gid: int) -> tuple[int, ...]:
    try:
        found = os.getgrouplist(name, gid)
    except OSError:
        return (gid,)
    return tuple(dict.fromkeys([gid, *found]))  # primary first, no duplicates


def _from_passwd(pw: pwd.struct_passwd) -> RunAs:
    return RunAs(
        uid=pw.pw_uid,
        gid=pw.pw_gid,
        groups=_groups(pw.pw_name, pw.pw_gid),
        home=pw.pw_dir or NO_HOME,
        name=pw.pw_name,
        shell=pw.pw_shell,
    )


def _from_ids(user: str, uid: int, gid: int | None) -> RunAs:
    """A mapped uid: its passwd entry (name, home, groups) when it has one."""
    try:
        pw = pwd.getpwuid(uid)
    except KeyError:
        return RunAs(uid=uid, gid=uid if gid is None else gid, groups=(), home=NO_HOME, name=user)
    g = pw.pw_gid if gid is None else gid
    return RunAs(
        uid=uid,
        gid=g,
        groups=_groups(pw.pw_name, g),
        home=pw.pw_dir or NO_HOME,
        name=pw.pw_name,
        shell=pw.pw_shell,
    )


def _getpwnam(name: str) -> pwd.struct_passwd | None:
    try:
        return pwd.getpwnam(name)
    except KeyError:
        return None


def resolve(
    user: str,
    *,
    user_map: Mapping[str, str | int],
    allow_root: bool,
    node_id: str = "",
) -> RunAs:
    """The local identity of ``user``: ``user_map`` first, then NSS. Raises IdentityError."""
    node = node_id or socket.gethostname()
    if not user:
        raise IdentityError(
            "the allocation has no submitting user to run as",
            hint="submit through lattice-api, which records the user",
        )
    raw = user_map.get(user)
    if raw is not None:
        try:
            target = parse_map_value(raw)
        except ValueError as e:
            raise IdentityError(
                f"node_agent.user_map entry for {user} on node {node}: {e}",
                hint="fix the node's configuration",
            ) from None
        if target.uid is not None:
            run_as = _from_ids(user, target.uid, target.gid)
        else:
            pw = _getpwnam(target.name)
            if pw is None:
                raise IdentityError(
                    f"user {user} is mapped to {target.name} by node_agent.user_map, "
                    f"which has no account on node {node}",
                    hint="create the account on the node or fix node_agent.user_map",
                )
            run_as = _from_passwd(pw)
    else:
        pw = _getpwnam(user)
        if pw is None:
            raise IdentityError(
                f"user {user} has no account on node {node} "
                "(no NSS entry and no node_agent.user_map entry)",
                hint="create the account on the node (LDAP/SSSD) or map the user in "
                "node_agent.user_map",
            )
        run_as = _from_passwd(pw)
    if run_as.uid == 0 and not allow_root:
        raise IdentityError(
            "allocation would run as root; the vCluster does not allow it",
            hint="submit as a non-root user, or add the vCluster to node_agent.root_vclusters",
        )
    return run_as


def check_switchable(run_as: RunAs) -> None:
    """Only root can start processes as another user: say so before setpriv fails."""
    euid = os.geteuid()
    if run_as.switches and euid != 0:
        raise IdentityError(
            f"the agent runs as uid {euid} and cannot start processes as user "
            f"{run_as.name} (uid {run_as.uid})",
            hint="run lattice-agent as root, or set node_agent.run_as: agent "
            "(development clusters)",
        )


@dataclass(frozen=True)
class IdentityPolicy:
    """``node_agent.run_as`` / ``user_map`` / ``root_vclusters`` applied to allocations.

    The default (``mode="agent"``) runs everything as the agent itself: what in-process
    agents and unit tests want; ``lattice-agent`` builds the policy from the config, whose
    default is ``submitter``."""

    node_id: str = ""
    mode: RunAsMode = "agent"
    user_map: Mapping[str, str | int] = field(default_factory=dict)
    root_vclusters: frozenset[str] = frozenset()

    def __post_init__(self) -> None:
        if self.mode not in ("submitter", "agent"):
            raise ValueError(f"run_as must be 'submitter' or 'agent', not {self.mode!r}")
        for user, value in self.user_map.items():
            try:
                parse_map_value(value)
            except ValueError as e:
                raise ValueError(f"node_agent.user_map[{user!r}]: {e}") from None

    def run_as(self, alloc: Allocation) -> RunAs:
        """Who ``alloc``'s processes run as on this node. Raises IdentityError."""
        if self.mode == "agent":
            return RunAs.agent()
        who = resolve(
            alloc.spec.user,
            user_map=self.user_map,
            allow_root=alloc.spec.vcluster in self.root_vclusters,
            node_id=self.node_id,
        )
        check_switchable(who)
        return who


# ---------------------------------------------------------------------- directory access


def _searchable(st: os.stat_result, run_as: RunAs) -> bool:
    # the kernel's order: owner bits for the owner (even when they deny), then group
    if st.st_uid == run_as.uid:
        return bool(st.st_mode & stat.S_IXUSR)
    if st.st_gid == run_as.gid or st.st_gid in run_as.groups:
        return bool(st.st_mode & stat.S_IXGRP)
    return bool(st.st_mode & stat.S_IXOTH)


def _has_acl(path: str) -> bool:
    try:
        os.getxattr(path, "system.posix_acl_access")
    except OSError:
        return False
    return True


def _prefixes(path: str) -> list[str]:
    out = ["/"]
    for part in path.strip("/").split("/"):
        if part:
            out.append(os.path.join(out[-1], part))
    return out


def may_enter(path: str, run_as: RunAs) -> bool | None:
    """Whether ``run_as`` can ``cd`` into ``path`` by the mode bits of it and every
    directory above it (the link's and the target's when symlinks are on the way).

    None: undecided here (a POSIX ACL on the way, or the agent itself cannot stat it,
    as on root-squashed NFS): the kernel decides when the process, as the user, enters."""
    if run_as.uid == 0:
        return True
    absolute = os.path.abspath(path)
    chain = dict.fromkeys([*_prefixes(absolute), *_prefixes(os.path.realpath(absolute))])
    for d in chain:
        try:
            st = os.stat(d)
        except OSError:
            return None
        if not _searchable(st, run_as):
            return None if _has_acl(d) else False
    return True
