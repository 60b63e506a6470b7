"""Per-launch PMI state machine: decoded messages in, actions out.

Why pure: the node agent's PMI server has three hard parts (socket I/O,
the cross-node fence over gRPC, and the protocol rules); keeping the
rules free of I/O lets them be tested exhaustively and fuzzed, and lets
the shell stay a thin loop::

    for msg in decoder.feed(data):
        for action in launch.handle(rank, msg):
            ...  # Reply -> write, FenceReady -> exchange, Abort -> kill, Close -> close

The barrier is job-wide: when every *local* rank has entered
``barrier_in`` / ``kvs-fence`` the core emits :class:`FenceReady` with
the keys put on this node since the previous fence; the shell exchanges
them with the other node agents and calls :meth:`Launch.fence_done`
with the merged key-value space, which releases the local ranks.  A
single-node launch simply calls ``fence_done(ready.puts)``.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from lattice_agent.pmi.wire import Message, PmiProtocolError, format_pmi1, format_pmi2

__all__ = [
    "Abort",
    "Action",
    "Close",
    "FenceReady",
    "Launch",
    "PmiStateError",
    "Reply",
    "abort_exit_status",
    "block_process_mapping",
]

#: What we advertise in ``cmd=maxes``; MPICH sizes its buffers from these.
KVSNAME_MAX = 256
KEYLEN_MAX = 64
VALLEN_MAX = 1024


@dataclass(frozen=True)
class Reply:
    """Bytes to write to ``rank``'s PMI connection."""

    rank: int
    data: bytes


@dataclass(frozen=True)
class FenceReady:
    """Every local rank is in the barrier: run the cross-node exchange.

    ``puts`` are the key-value pairs put by local ranks since the last
    fence (MPI_Init's business cards travel here); ``epoch`` counts
    fences from 0 so the shell can match cross-node rounds.
    """

    epoch: int
    puts: Mapping[str, str]


@dataclass(frozen=True)
class Abort:
    """``rank`` asked to abort (or broke the protocol): kill every rank.

    ``exit_status`` is already mapped into 1..255.
    """

    rank: int
    exit_status: int
    message: str = ""


@dataclass(frozen=True)
class Close:
    """The PMI conversation with ``rank`` is over; close after pending writes."""

    rank: int


Action = Reply | FenceReady | Abort | Close


class PmiStateError(RuntimeError):
    """The shell misused the core (e.g. ``fence_done`` with no fence pending)."""


def abort_exit_status(code: object) -> int:
    """Map a client-supplied abort code to a process exit status in 1..255.

    Why: an aborting job must never look successful (0), and a wait
    status cannot hold negatives or values above 255; ``-1`` maps to
    255 as the shell would show it, multiples of 256 map to 1.
    """
    try:
        value = int(str(code).strip())
    except (TypeError, ValueError):
        return 1
    status = value % 256
    return status if status != 0 else 1


def block_process_mapping(ranks_per_node: Sequence[int]) -> str:
    """``PMI_process_mapping`` for a block layout (node 0 gets ranks 0..k-1, ...).

    Runs of nodes with equal rank counts collapse into one
    ``(start_node,num_nodes,ranks_per_node)`` triple, as MPICH's Hydra
    writes it; MPICH uses this to find which ranks share a node (shared
    memory).
    """
    triples: list[str] = []
    start = 0
    i = 0
    counts = list(ranks_per_node)
    while i < len(counts):
        j = i
        while j < len(counts) and counts[j] == counts[i]:
            j += 1
        triples.append(f"({start},{j - i},{counts[i]})")
        start += j - i
        i = j
    return "(vector," + ",".join(triples) + ")"


@dataclass
class _RankState:
    version: int = 0  # 0 = no init yet
    in_fence: bool = False
    fence_version: int = 1
    fence_thrid: str | None = None
    finalized: bool = False
    aborted: bool = False


@dataclass
class _NodeAttrWaiter:
    rank: int
    key: str
    thrid: str | None


@dataclass
class Launch:
    """PMI state of one launch on one node.

    ``size`` is the job-wide rank count, ``ranks_on_this_node`` the
    global ranks this agent serves, ``kvsname`` the job id reported to
    clients, ``process_mapping`` the ``PMI_process_mapping`` string.
    """

    size: int
    ranks_on_this_node: Sequence[int]
    kvsname: str
    process_mapping: str
    appnum: int = 0
    universe_size: int | None = None
    job_attrs: Mapping[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.size <= 0:
            raise ValueError("size must be positive")
        local = list(self.ranks_on_this_node)
        if not local or len(set(local)) != len(local) or any(not 0 <= r < self.size for r in local):
            raise ValueError("ranks_on_this_node must be distinct ranks in [0, size)")
        self._ranks: dict[int, _RankState] = {r: _RankState() for r in local}
        #: merged, fenced KVS (global); seeded with what Hydra pre-puts
        self._kvs: dict[str, str] = {"PMI_process_mapping": self.process_mapping}
        #: local puts since the last fence
        self._pending: dict[str, str] = {}
        self._node_attrs: dict[str, str] = {}
        self._node_waiters: list[_NodeAttrWaiter] = []
        self._epoch = 0
        self._fence_outstanding = False
        self._attrs: dict[str, str] = {
            "PMI_process_mapping": self.process_mapping,
            "universeSize": str(self.universe_size or self.size),
            **dict(self.job_attrs),
        }

    # ------------------------------------------------------------------ queries

    @property
    def epoch(self) -> int:
        """Number of completed fences."""
        return self._epoch

    @property
    def fence_outstanding(self) -> bool:
        """True between FenceReady and fence_done."""
        return self._fence_outstanding

    @property
    def finished(self) -> bool:
        """Every local rank has finalized."""
        return all(s.finalized for s in self._ranks.values())

    def lookup(self, key: str) -> str | None:
        """Value visible to a get: newest local put, else the merged KVS."""
        if key in self._pending:
            return self._pending[key]
        return self._kvs.get(key)

    # ------------------------------------------------------------------ entry points

    def handle(self, rank: int, message: Message) -> list[Action]:
        """Apply one message from ``rank``; return what the shell must do."""
        state = self._ranks.get(rank)
        if state is None:
            return [Abort(rank, 1, f"rank {rank} is not served by this node"), Close(rank)]
        if state.aborted:
            return []
        try:
            if message.version == 1:
                return self._handle_v1(rank, state, message)
            return self._handle_v2(rank, state, message)
        except PmiProtocolError as exc:
            # a reply could not be encoded (e.g. value too long for the wire)
            return self.protocol_error(rank, exc)

    def protocol_error(self, rank: int, exc: Exception) -> list[Action]:
        """The shell could not decode ``rank``'s stream: abort the launch.

        Why abort rather than drop: a rank that cannot talk PMI will hang
        its peers at the next barrier, which is worse than failing fast.
        """
        state = self._ranks.get(rank)
        if state is not None:
            state.aborted = True
        return [Abort(rank, 1, f"PMI protocol error: {exc}"), Close(rank)]

    def connection_lost(self, rank: int) -> list[Action]:
        """``rank`` closed its PMI connection.

        After finalize that is normal; before it, peers would wait for
        this rank forever, so the launch is aborted.
        """
        state = self._ranks.get(rank)
        if state is None or state.finalized or state.aborted:
            return []
        if state.version == 0:
            return []  # never spoke PMI (non-MPI program): nothing to tear down
        state.aborted = True
        return [Abort(rank, 1, f"rank {rank} closed its PMI connection before finalize")]

    def fence_done(self, merged_kvs: Mapping[str, str]) -> list[Action]:
        """Cross-node exchange finished: merge and release the local ranks."""
        if not self._fence_outstanding:
            raise PmiStateError("fence_done called without an outstanding fence")
        self._kvs.update(merged_kvs)
        self._pending.clear()
        self._fence_outstanding = False
        self._epoch += 1
        actions: list[Action] = []
        for rank, state in self._ranks.items():
            if not state.in_fence:
                continue
            state.in_fence = False
            if state.aborted:
                continue
            if state.fence_version == 1:
                actions.append(Reply(rank, format_pmi1("barrier_out")))
            else:
                actions.append(
                    Reply(
                        rank,
                        format_pmi2("kvs-fence-response", *_thrid(state.fence_thrid), ("rc", 0)),
                    )
                )
        return actions

    # ------------------------------------------------------------------ fence

    def _enter_fence(
        self, rank: int, state: _RankState, version: int, thrid: str | None
    ) -> list[Action]:
        if state.in_fence:
            raise PmiProtocolError(f"rank {rank} entered the barrier twice")
        state.in_fence = True
        state.fence_version = version
        state.fence_thrid = thrid
        if self._fence_outstanding or not all(s.in_fence for s in self._ranks.values()):
            return []
        self._fence_outstanding = True
        return [FenceReady(self._epoch, dict(self._pending))]

    def _put(self, key: str, value: str) -> None:
        self._pending[key] = value

    # ------------------------------------------------------------------ PMI-1

    def _handle_v1(self, rank: int, state: _RankState, msg: Message) -> list[Action]:
        cmd = msg.cmd

        def reply(name: str, *pairs: tuple[str, str | int]) -> list[Action]:
            return [Reply(rank, format_pmi1(name, *pairs))]

        if cmd == "init":
            version = msg.get("pmi_version")
            if version == "1":
                state.version = 1
                return reply(
                    "response_to_init", ("pmi_version", 1), ("pmi_subversion", 1), ("rc", 0)
                )
            if version == "2":
                # PMI-2 clients handshake with a PMI-1 line, then switch to frames
                state.version = 2
                return reply(
                    "response_to_init", ("pmi_version", 2), ("pmi_subversion", 0), ("rc", 0)
                )
            return reply("response_to_init", ("pmi_version", 1), ("pmi_subversion", 1), ("rc", -1))
        if state.version == 0:
            state.version = 1  # tolerate clients that skip init
        if cmd == "get_maxes":
            return reply(
                "maxes",
                ("kvsname_max", KVSNAME_MAX),
                ("keylen_max", KEYLEN_MAX),
                ("vallen_max", VALLEN_MAX),
            )
        if cmd == "get_appnum":
            return reply("appnum", ("appnum", self.appnum))
        if cmd == "get_my_kvsname":
            return reply("my_kvsname", ("kvsname", self.kvsname))
        if cmd == "get_universe_size":
            return reply("universe_size", ("size", self._attrs["universeSize"]), ("rc", 0))
        if cmd == "put":
            key, value = msg.get("key"), msg.get("value")
            if not key or value is None:
                return reply("put_result", ("rc", -1), ("msg", "missing_key_or_value"))
            if msg.get("kvsname", self.kvsname) != self.kvsname:
                return reply("put_result", ("rc", -1), ("msg", "unknown_kvsname"))
            if len(key) > KEYLEN_MAX or len(value) > VALLEN_MAX:
                return reply("put_result", ("rc", -1), ("msg", "key_or_value_too_long"))
            self._put(key, value)
            return reply("put_result", ("rc", 0))
        if cmd == "get":
            key = msg.get("key")
            if not key or msg.get("kvsname", self.kvsname) != self.kvsname:
                return reply("get_result", ("rc", -1), ("msg", "bad_get_request"))
            value = self.lookup(key)
            if value is None:
                return reply("get_result", ("rc", -1), ("msg", "key_not_found"))
            try:
                return reply("get_result", ("rc", 0), ("value", value))
            except PmiProtocolError:
                return reply("get_result", ("rc", -1), ("msg", "value_too_long_for_pmi1"))
        if cmd == "barrier_in":
            return self._enter_fence(rank, state, 1, None)
        if cmd == "finalize":
            state.finalized = True
            return [*reply("finalize_ack"), Close(rank)]
        if cmd == "abort":
            state.aborted = True
            status = abort_exit_status(msg.get("exitcode", "1"))
            return [Abort(rank, status, msg.get("message") or msg.get("msg") or ""), Close(rank)]
        if cmd == "spawn":
            return reply("spawn_result", ("rc", -1), ("errmsg", "spawn_not_supported"))
        if cmd in ("publish_name", "unpublish_name", "lookup_name"):
            return reply(cmd.split("_")[0] + "_result", ("rc", -1), ("msg", "not_supported"))
        return reply(f"{cmd}_result", ("rc", -1), ("msg", "unknown_command"))

    # ------------------------------------------------------------------ PMI-2

    def _handle_v2(self, rank: int, state: _RankState, msg: Message) -> list[Action]:
        cmd = msg.cmd
        thrid = msg.get("thrid")

        def reply(name: str, *pairs: tuple[str, str | int]) -> list[Action]:
            return [Reply(rank, format_pmi2(name, *_thrid(thrid), *pairs))]

        state.version = 2
        if cmd == "fullinit":
            # No spawner-jobid: its mere presence makes PMI2_Init report
            # spawned=TRUE, and MPICH then looks for a parent communicator.
            return reply(
                "fullinit-response",
                ("pmi-version", 2),
                ("pmi-subversion", 0),
                ("rank", rank),
                ("size", self.size),
                ("appnum", self.appnum),
                ("debugged", "FALSE"),
                ("pmiverbose", "FALSE"),
                ("rc", 0),
            )
        if cmd == "job-getid":
            return reply("job-getid-response", ("jobid", self.kvsname), ("rc", 0))
        if cmd in ("info-getjobattr", "job-getinfo"):
            value = self._attrs.get(msg.get("key") or "")
            resp = f"{cmd}-response"
            if value is None:
                return reply(resp, ("found", "FALSE"), ("rc", 0))
            return reply(resp, ("found", "TRUE"), ("value", value), ("rc", 0))
        if cmd == "info-putnodeattr":
            key, value = msg.get("key"), msg.get("value")
            if not key or value is None:
                return reply(
                    "info-putnodeattr-response", ("rc", -1), ("errmsg", "missing key or value")
                )
            self._node_attrs[key] = value
            actions = reply("info-putnodeattr-response", ("rc", 0))
            still: list[_NodeAttrWaiter] = []
            for w in self._node_waiters:
                if w.key == key:
                    actions.append(
                        Reply(
                            w.rank,
                            format_pmi2(
                                "info-getnodeattr-response",
                                *_thrid(w.thrid),
                                ("found", "TRUE"),
                                ("value", value),
                                ("rc", 0),
                            ),
                        )
                    )
                else:
                    still.append(w)
            self._node_waiters = still
            return actions
        if cmd == "info-getnodeattr":
            key = msg.get("key") or ""
            value = self._node_attrs.get(key)
            if value is not None:
                return reply(
                    "info-getnodeattr-response", ("found", "TRUE"), ("value", value), ("rc", 0)
                )
            if msg.get("wait") == "TRUE":
                self._node_waiters.append(_NodeAttrWaiter(rank, key, thrid))
                return []
            return reply("info-getnodeattr-response", ("found", "FALSE"), ("rc", 0))
        if cmd == "kvs-put":
            key, value = msg.get("key"), msg.get("value")
            if not key or value is None:
                return reply("kvs-put-response", ("rc", -1), ("errmsg", "missing key or value"))
            self._put(key, value)
            return reply("kvs-put-response", ("rc", 0))
        if cmd == "kvs-get":
            jobid = msg.get("jobid")
            if jobid not in (None, "", self.kvsname):
                return reply(
                    "kvs-get-response", ("found", "FALSE"), ("rc", -1), ("errmsg", "unknown jobid")
                )
            value = self.lookup(msg.get("key") or "")
            if value is None:
                return reply("kvs-get-response", ("found", "FALSE"), ("rc", 0))
            return reply("kvs-get-response", ("found", "TRUE"), ("value", value), ("rc", 0))
        if cmd == "kvs-fence":
            return self._enter_fence(rank, state, 2, thrid)
        if cmd == "finalize":
            state.finalized = True
            return [*reply("finalize-response", ("rc", 0)), Close(rank)]
        if cmd == "abort":
            # PMI2_Abort sends isworld/msg and then exit(flag) itself; no reply.
            state.aborted = True
            return [Abort(rank, 1, msg.get("msg") or ""), Close(rank)]
        if cmd == "spawn":
            return reply(
                "spawn-response", ("rc", -1), ("errmsg", "spawn is not supported by Lattice PMI-2")
            )
        return reply(f"{cmd}-response", ("rc", -1), ("errmsg", f"unsupported command {cmd}"))

    def abort_all(self) -> Iterable[int]:
        """Mark every local rank aborted (remote abort); returns the ranks to kill."""
        for state in self._ranks.values():
            state.aborted = True
        return list(self._ranks)


def _thrid(thrid: str | None) -> tuple[tuple[str, str], ...]:
    """Echo ``thrid`` so threaded MPICH clients route the reply to the right caller."""
    return (("thrid", thrid),) if thrid is not None else ()
