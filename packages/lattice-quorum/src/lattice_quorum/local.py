"""``LocalQuorum``: the Quorum protocol in one process, with no Raft.

Commands go through the same pure ``apply()`` as in a real member, under a lock, and
through the same encode/decode round trip (so the state never shares objects with a
caller, and results are copies). It is always the leader and always caught up unless a
test says otherwise (``is_leader`` and ``caught_up`` are plain attributes), and it feeds
watchers the same encoded snapshot and deltas as :class:`QuorumMember`. Tests and
tools use it to serve the real API without starting a cluster.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from typing import Any, TypeVar

from lattice_common import commands as c
from lattice_common.errors import Unavailable

from lattice_quorum.quorum import encode_changes, encode_snapshot
from lattice_quorum.state import Changes, GlobalState, apply

T = TypeVar("T")


class LocalQuorum:
    """An in-process quorum of one: propose applies at once and returns the result."""

    def __init__(
        self, state: GlobalState | None = None, *, member_id: int = 1, address: str = "local:0"
    ) -> None:
        self.state = state if state is not None else GlobalState()
        self.member_id = member_id
        self.address = address
        self.is_leader = True
        self.caught_up = True
        self._lock = threading.RLock()
        self._watchers: dict[asyncio.Queue[bytes | None], asyncio.AbstractEventLoop] = {}
        self._leader_callbacks: list[Callable[[bool], None]] = []
        self._applied = 0

    # --- writes ---------------------------------------------------------------------

    def apply(self, cmd: c.Command) -> c.CommandResult:
        """Apply ``cmd`` now (any thread); watchers get the delta on their own loop."""
        decoded = c.decode_command(c.encode_command(cmd))
        changes = Changes()
        with self._lock:
            result = apply(self.state, decoded, changes)
            self._applied += 1
            if changes and self._watchers:
                delta = encode_changes(self.state, changes)
                for q, loop in list(self._watchers.items()):
                    loop.call_soon_threadsafe(q.put_nowait, delta)
        return c.decode_result(c.encode_result(result))

    async def propose(self, cmd: c.Command) -> c.CommandResult:
        return self.apply(cmd)

    async def propose_many(self, cmds: list[c.Command]) -> list[c.CommandResult]:
        return [self.apply(cmd) for cmd in cmds]

    # --- reads ----------------------------------------------------------------------

    def read(self, fn: Callable[..., T], /, *args: Any, **kwargs: Any) -> T:
        with self._lock:
            return fn(self.state, *args, **kwargs)

    @property
    def revision(self) -> int:
        return self.state.revision

    def snapshot_delta(self) -> bytes:
        return self.read(encode_snapshot)

    def subscribe(self, maxsize: int = 0) -> asyncio.Queue[bytes | None]:
        self.require_caught_up()
        q: asyncio.Queue[bytes | None] = asyncio.Queue(maxsize)
        with self._lock:
            q.put_nowait(encode_snapshot(self.state))
            self._watchers[q] = asyncio.get_running_loop()
        return q

    def unsubscribe(self, q: asyncio.Queue[bytes | None]) -> None:
        with self._lock:
            self._watchers.pop(q, None)

    def replace_state(self, state: GlobalState) -> None:
        """Swap the whole state, as a member does when it loads a dump: watchers get
        ``None`` and must resubscribe."""
        with self._lock:
            self.state = state
            for q, loop in list(self._watchers.items()):
                loop.call_soon_threadsafe(q.put_nowait, None)

    # --- role -----------------------------------------------------------------------

    def require_caught_up(self) -> None:
        if not self.caught_up:
            raise Unavailable(
                f"quorum member {self.member_id} is not in sync with a leader",
                hint="Retry shortly, or against another quorum member.",
            )

    @property
    def leader_raft_address(self) -> str | None:
        return self.address

    def on_leadership(self, cb: Callable[[bool], None]) -> None:
        """``cb`` hears the current role at once (a LocalQuorum never changes role by
        itself) and again on :meth:`set_leader`."""
        self._leader_callbacks.append(cb)
        cb(self.is_leader)

    def set_leader(self, is_leader: bool) -> None:
        self.is_leader = is_leader
        for cb in self._leader_callbacks:
            cb(is_leader)

    def status(self) -> dict[str, Any]:
        role = "leader" if self.is_leader else "follower"
        return {
            "member_id": self.member_id,
            "leader_address": self.address,
            "is_leader": self.is_leader,
            "term": 1,
            "commit_index": self._applied,
            "last_applied": self._applied,
            "log_len": self._applied,
            "revision": self.revision,
            "members": [{"id": self.member_id, "address": self.address, "state": role}],
        }

    def close(self) -> None:
        with self._lock:
            self._watchers.clear()


__all__ = ["LocalQuorum"]
