"""PMI wire formats and the per-launch state machine (no sockets).

The example sequences are what MPICH 4.0.2's PMI-1 "simple" client and
classic PMI-2 clients (Slurm libpmi2, MPICH simple2pmi) put on the wire;
the fuzz tests pin the contract the socket shell relies on: the
decoders raise only PmiProtocolError, for any bytes, in bounded time.
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from lattice_agent.pmi import (
    Abort,
    Close,
    FenceReady,
    Launch,
    Message,
    PmiDecoder,
    PmiProtocolError,
    PmiStateError,
    Reply,
    abort_exit_status,
    block_process_mapping,
    format_pmi1,
    format_pmi2,
    parse_pmi1_line,
    parse_pmi2_body,
    parse_pmi2_frame,
)
from lattice_agent.pmi.wire import PMI1_MAX_LINE, PMI2_MAX_FRAME

MAPPING = "(vector,(0,1,2))"


def launch2() -> Launch:
    return Launch(size=2, ranks_on_this_node=[0, 1], kvsname="kvs_42_0", process_mapping=MAPPING)


def send(launch: Launch, rank: int, line: bytes) -> list:
    """Decode one client write and run it through the launch."""
    dec = PmiDecoder()
    msgs = dec.feed(line)
    assert len(msgs) == 1, msgs
    return launch.handle(rank, msgs[0])


def replies(actions: list) -> list[bytes]:
    return [a.data for a in actions if isinstance(a, Reply)]


def v2(cmd: str, *pairs: tuple[str, str]) -> bytes:
    """A request frame the way classic clients write it (left-aligned length)."""
    body = f"cmd={cmd};" + "".join(f"{k}={v.replace(';', ';;')};" for k, v in pairs)
    return f"{len(body):<6d}".encode() + body.encode()


# --------------------------------------------------------------------------- PMI-1 parse/format


def test_pmi1_split_on_first_equals_and_order() -> None:
    msg = parse_pmi1_line(b"cmd=put kvsname=kvs_1 key=P0-seg-1/2 value=segments=2\n")
    assert msg == Message(
        1, "put", (("kvsname", "kvs_1"), ("key", "P0-seg-1/2"), ("value", "segments=2"))
    )
    assert msg.get("value") == "segments=2"
    assert msg.get("missing") is None


def test_pmi1_escaped_space_kept_verbatim() -> None:
    msg = parse_pmi1_line(b"cmd=put key=k value=a\\ b\n")
    assert msg.get("value") == "a\\ b"
    assert (
        format_pmi1("get_result", ("rc", 0), ("value", "a\\ b"))
        == b"cmd=get_result rc=0 value=a\\ b\n"
    )


@pytest.mark.parametrize(
    "line",
    [
        b"",
        b"\n",
        b"put key=a\n",
        b"cmd=\n",
        b"cmd=put =a\n",
        b"cmd=put key=\n",
        b"cmd=put key=a\x00\n",
        b"cmd=put\nkey=a\n",
        b"cmd=put key=\xff\xfe\n",
        b"cmd=put value=" + b"x" * PMI1_MAX_LINE + b"\n",
    ],
)
def test_pmi1_rejects_malformed(line: bytes) -> None:
    with pytest.raises(PmiProtocolError):
        parse_pmi1_line(line)


def test_pmi1_format_limits() -> None:
    with pytest.raises(PmiProtocolError):
        format_pmi1("get_result", ("value", "a b"))
    with pytest.raises(PmiProtocolError):
        format_pmi1("get_result", ("value", "x" * PMI1_MAX_LINE))


# --------------------------------------------------------------------------- PMI-2 parse/format


@pytest.mark.parametrize("prefix", ["{:<6d}", "{:>6d}", "{:06d}"])
def test_pmi2_length_alignments(prefix: str) -> None:
    body = b"cmd=kvs-get;jobid=kvs_1;srcid=0;key=P1-businesscard;"
    msg = parse_pmi2_frame(prefix.format(len(body)).encode() + body)
    assert msg.cmd == "kvs-get"
    assert msg.args == (("jobid", "kvs_1"), ("srcid", "0"), ("key", "P1-businesscard"))


def test_pmi2_round_trip_with_semicolon_escaping() -> None:
    pairs = (("key", "a;b"), ("value", "x;;y;"), ("empty", ""), ("eq", "k=v"))
    frame = format_pmi2("kvs-put", *pairs)
    assert frame[:6] == f"{len(frame) - 6:6d}".encode()
    assert b"value=x;;;;y;;;" in frame
    msg = parse_pmi2_frame(frame)
    assert msg == Message(2, "kvs-put", pairs)


def test_pmi2_lenient_trailing_and_bare_key() -> None:
    assert parse_pmi2_body(b"cmd=finalize").cmd == "finalize"
    assert parse_pmi2_body(b"cmd=x;flag;k=v;").args == (("flag", ""), ("k", "v"))


@pytest.mark.parametrize(
    "frame",
    [
        b"",
        b"12",
        b"abcdefcmd=x;",
        b"     0",
        b"  1 2 cmd=x;",
        b"999999" + b"cmd=x;",
        b"    10cmd=x;",  # announced length does not match
        b"     6key=v;",
        b"     5cmd=;",
        b"     8cmd=\xff\xfe;",
        b"     7cmd=x\x00;",
    ],
)
def test_pmi2_rejects_malformed(frame: bytes) -> None:
    with pytest.raises(PmiProtocolError):
        parse_pmi2_frame(frame)


# --------------------------------------------------------------------------- stream decoder


def test_decoder_byte_at_a_time_mixed_framing() -> None:
    """PMI-2 clients open with a PMI-1 init line, then switch to frames."""
    stream = b"cmd=init pmi_version=2 pmi_subversion=0\n" + v2(
        "fullinit", ("pmirank", "0"), ("threaded", "FALSE")
    )
    dec = PmiDecoder()
    out: list[Message] = []
    for i in range(len(stream)):
        out += dec.feed(stream[i : i + 1])
    assert [(m.version, m.cmd) for m in out] == [(1, "init"), (2, "fullinit")]
    assert dec.pending == 0
    dec.eof()


def test_decoder_mcmd_spawn_block() -> None:
    dec = PmiDecoder()
    msgs = dec.feed(b"mcmd=spawn\nnprocs=2\nexecname=/bin/true\narg1=a b\nendcmd\ncmd=get_maxes\n")
    assert [m.cmd for m in msgs] == ["spawn", "get_maxes"]
    assert msgs[0].get("arg1") == "a b"


def test_decoder_bounded_and_sticky_error() -> None:
    dec = PmiDecoder()
    with pytest.raises(PmiProtocolError):
        dec.feed(b"cmd=" + b"x" * PMI1_MAX_LINE)
    with pytest.raises(PmiProtocolError):
        dec.feed(b"cmd=get_maxes\n")
    dec2 = PmiDecoder()
    with pytest.raises(PmiProtocolError):
        dec2.feed(f"{PMI2_MAX_FRAME + 1:6d}".encode())
    dec3 = PmiDecoder()
    assert dec3.feed(b"cmd=get_ma") == []
    with pytest.raises(PmiProtocolError):
        dec3.eof()


# --------------------------------------------------------------------------- PMI-1 launch (MPICH sequence)


def mpich_init(launch: Launch, rank: int) -> list[bytes]:
    """The exact request sequence MPICH 4.0.2's MPI_Init sends before the first barrier."""
    out: list[bytes] = []
    for line in (
        b"cmd=init pmi_version=1 pmi_subversion=1\n",
        b"cmd=get_maxes\n",
        b"cmd=get_appnum\n",
        b"cmd=get_my_kvsname\n",
        b"cmd=get kvsname=kvs_42_0 key=PMI_process_mapping\n",
        f"cmd=put kvsname=kvs_42_0 key=P{rank}-businesscard value=addr{rank}\n".encode(),
    ):
        out += replies(send(launch, rank, line))
    return out


def test_mpich_pmi1_two_rank_run() -> None:
    launch = launch2()
    r0 = mpich_init(launch, 0)
    assert r0 == [
        b"cmd=response_to_init pmi_version=1 pmi_subversion=1 rc=0\n",
        b"cmd=maxes kvsname_max=256 keylen_max=64 vallen_max=1024\n",
        b"cmd=appnum appnum=0\n",
        b"cmd=my_kvsname kvsname=kvs_42_0\n",
        b"cmd=get_result rc=0 value=(vector,(0,1,2))\n",
        b"cmd=put_result rc=0\n",
    ]
    # rank 0 reaches the barrier first: nothing happens yet
    assert send(launch, 0, b"cmd=barrier_in\n") == []
    assert mpich_init(launch, 1)[-1] == b"cmd=put_result rc=0\n"
    # unfenced keys are already visible to local gets
    assert replies(send(launch, 1, b"cmd=get kvsname=kvs_42_0 key=P0-businesscard\n")) == [
        b"cmd=get_result rc=0 value=addr0\n"
    ]
    actions = send(launch, 1, b"cmd=barrier_in\n")
    assert actions == [FenceReady(0, {"P0-businesscard": "addr0", "P1-businesscard": "addr1"})]
    assert launch.fence_outstanding
    # a remote node's card arrives through the merged KVS
    merged = {**actions[0].puts, "P2-businesscard": "remote"}
    released = launch.fence_done(merged)
    assert released == [Reply(0, b"cmd=barrier_out\n"), Reply(1, b"cmd=barrier_out\n")]
    assert launch.epoch == 1
    assert replies(send(launch, 0, b"cmd=get kvsname=kvs_42_0 key=P2-businesscard\n")) == [
        b"cmd=get_result rc=0 value=remote\n"
    ]
    miss = replies(send(launch, 0, b"cmd=get kvsname=kvs_42_0 key=nope\n"))[0]
    assert miss.startswith(b"cmd=get_result rc=-1 ")
    # second fence carries only the new puts
    send(launch, 0, b"cmd=put kvsname=kvs_42_0 key=late value=1\n")
    assert send(launch, 0, b"cmd=barrier_in\n") == []
    assert send(launch, 1, b"cmd=barrier_in\n") == [FenceReady(1, {"late": "1"})]
    assert len(launch.fence_done({"late": "1"})) == 2
    for rank in (0, 1):
        assert send(launch, rank, b"cmd=finalize\n") == [
            Reply(rank, b"cmd=finalize_ack\n"),
            Close(rank),
        ]
    assert launch.finished
    assert launch.connection_lost(0) == []


def test_segmented_values_are_plain_keys() -> None:
    """MPICH splits long values into KEY-seg-i/N keys plus a 'segments=N' marker."""
    launch = launch2()
    chunks = ["a" * 900, "b" * 900]
    send(launch, 0, b"cmd=put kvsname=kvs_42_0 key=big value=segments=2\n")
    for i, chunk in enumerate(chunks, 1):
        line = f"cmd=put kvsname=kvs_42_0 key=big-seg-{i}/2 value={chunk}\n".encode()
        assert len(line) <= PMI1_MAX_LINE
        assert replies(send(launch, 0, line)) == [b"cmd=put_result rc=0\n"]
    send(launch, 0, b"cmd=barrier_in\n")
    (ready,) = send(launch, 1, b"cmd=barrier_in\n")
    assert ready.puts == {"big": "segments=2", "big-seg-1/2": chunks[0], "big-seg-2/2": chunks[1]}
    launch.fence_done(ready.puts)
    assert replies(send(launch, 1, b"cmd=get kvsname=kvs_42_0 key=big\n")) == [
        b"cmd=get_result rc=0 value=segments=2\n"
    ]
    got = replies(send(launch, 1, b"cmd=get kvsname=kvs_42_0 key=big-seg-2/2\n"))[0]
    assert got == f"cmd=get_result rc=0 value={chunks[1]}\n".encode()


def test_put_rejects_oversized_key_and_wrong_kvsname() -> None:
    launch = launch2()
    long_key = "k" * 65
    assert replies(send(launch, 0, f"cmd=put kvsname=kvs_42_0 key={long_key} value=1\n".encode()))[
        0
    ].startswith(b"cmd=put_result rc=-1")
    assert replies(send(launch, 0, b"cmd=put kvsname=other key=a value=1\n"))[0].startswith(
        b"cmd=put_result rc=-1"
    )


@pytest.mark.parametrize(
    ("code", "status"),
    [
        ("1", 1),
        ("13", 13),
        ("255", 255),
        ("0", 1),
        ("256", 1),
        ("257", 1),
        ("-1", 255),
        ("x", 1),
        (None, 1),
    ],
)
def test_abort_exit_status(code: object, status: int) -> None:
    assert abort_exit_status(code) == status
    assert 1 <= abort_exit_status(code) <= 255


def test_pmi1_abort_has_no_reply() -> None:
    launch = launch2()
    mpich_init(launch, 0)
    actions = send(launch, 0, b"cmd=abort exitcode=-1\n")
    assert actions == [Abort(0, 255, ""), Close(0)]
    # later traffic from an aborted rank is ignored
    assert send(launch, 0, b"cmd=get_maxes\n") == []


def test_waiting_peer_and_lost_connection() -> None:
    launch = launch2()
    mpich_init(launch, 0)
    mpich_init(launch, 1)
    send(launch, 0, b"cmd=barrier_in\n")
    lost = launch.connection_lost(1)
    assert len(lost) == 1 and isinstance(lost[0], Abort) and lost[0].exit_status == 1
    with pytest.raises(PmiStateError):
        launch.fence_done({})


def test_double_barrier_is_protocol_abort() -> None:
    launch = launch2()
    send(launch, 0, b"cmd=barrier_in\n")
    actions = send(launch, 0, b"cmd=barrier_in\n")
    assert isinstance(actions[0], Abort) and actions[-1] == Close(0)


def test_unknown_rank_and_unknown_command() -> None:
    launch = launch2()
    assert isinstance(send(launch, 7, b"cmd=get_maxes\n")[0], Abort)
    assert replies(send(launch, 0, b"cmd=frobnicate\n")) == [
        b"cmd=frobnicate_result rc=-1 msg=unknown_command\n"
    ]
    assert replies(send(launch, 0, b"cmd=get_universe_size\n")) == [
        b"cmd=universe_size size=2 rc=0\n"
    ]


def test_block_process_mapping() -> None:
    assert block_process_mapping([2]) == "(vector,(0,1,2))"
    assert block_process_mapping([4, 4, 4]) == "(vector,(0,3,4))"
    assert block_process_mapping([4, 4, 3]) == "(vector,(0,2,4),(2,1,3))"


def test_launch_validates_ranks() -> None:
    with pytest.raises(ValueError):
        Launch(size=2, ranks_on_this_node=[0, 2], kvsname="k", process_mapping=MAPPING)
    with pytest.raises(ValueError):
        Launch(size=2, ranks_on_this_node=[], kvsname="k", process_mapping=MAPPING)


# --------------------------------------------------------------------------- PMI-2 launch


def test_pmi2_two_rank_run() -> None:
    launch = launch2()
    for rank in (0, 1):
        assert replies(send(launch, rank, b"cmd=init pmi_version=2 pmi_subversion=0\n")) == [
            b"cmd=response_to_init pmi_version=2 pmi_subversion=0 rc=0\n"
        ]
        (full,) = replies(
            send(launch, rank, v2("fullinit", ("pmirank", str(rank)), ("threaded", "FALSE")))
        )
        msg = parse_pmi2_frame(full)
        assert msg.cmd == "fullinit-response"
        assert dict(msg.args) == {
            "pmi-version": "2",
            "pmi-subversion": "0",
            "rank": str(rank),
            "size": "2",
            "appnum": "0",
            "debugged": "FALSE",
            "pmiverbose": "FALSE",
            "rc": "0",
        }
        assert msg.get("spawner-jobid") is None  # its presence would mean "spawned"
        (jid,) = replies(send(launch, rank, v2("job-getid")))
        assert parse_pmi2_frame(jid).get("jobid") == "kvs_42_0"
        (attr,) = replies(send(launch, rank, v2("info-getjobattr", ("key", "PMI_process_mapping"))))
        assert dict(parse_pmi2_frame(attr).args) == {"found": "TRUE", "value": MAPPING, "rc": "0"}
        (put,) = replies(
            send(launch, rank, v2("kvs-put", ("key", f"card{rank}"), ("value", f"a;{rank}")))
        )
        assert parse_pmi2_frame(put) == Message(2, "kvs-put-response", (("rc", "0"),))

    assert send(launch, 0, v2("kvs-fence", ("thrid", "0x1234"))) == []
    (ready,) = send(launch, 1, v2("kvs-fence"))
    assert ready == FenceReady(0, {"card0": "a;0", "card1": "a;1"})
    released = launch.fence_done(ready.puts)
    assert [parse_pmi2_frame(r.data) for r in released] == [
        Message(2, "kvs-fence-response", (("thrid", "0x1234"), ("rc", "0"))),
        Message(2, "kvs-fence-response", (("rc", "0"),)),
    ]
    (got,) = replies(
        send(launch, 0, v2("kvs-get", ("jobid", "kvs_42_0"), ("srcid", "1"), ("key", "card1")))
    )
    assert dict(parse_pmi2_frame(got).args) == {"found": "TRUE", "value": "a;1", "rc": "0"}
    (miss,) = replies(send(launch, 0, v2("kvs-get", ("key", "nope"))))
    assert dict(parse_pmi2_frame(miss).args) == {"found": "FALSE", "rc": "0"}
    (sp,) = replies(send(launch, 0, v2("spawn", ("ncmds", "1"))))
    assert parse_pmi2_frame(sp).cmd == "spawn-response" and parse_pmi2_frame(sp).get("rc") == "-1"
    (fin, close) = send(launch, 0, v2("finalize"))
    assert parse_pmi2_frame(fin.data) == Message(
        2, "finalize-response", (("rc", "0"),)
    ) and close == Close(0)
    assert send(launch, 1, v2("abort", ("isworld", "TRUE"), ("msg", "boom"))) == [
        Abort(1, 1, "boom"),
        Close(1),
    ]


def test_pmi2_nodeattr_wait() -> None:
    launch = launch2()
    assert (
        send(launch, 1, v2("info-getnodeattr", ("key", "shm"), ("wait", "TRUE"), ("thrid", "7")))
        == []
    )
    (miss,) = replies(send(launch, 1, v2("info-getnodeattr", ("key", "shm"), ("wait", "FALSE"))))
    assert parse_pmi2_frame(miss).get("found") == "FALSE"
    actions = send(launch, 0, v2("info-putnodeattr", ("key", "shm"), ("value", "seg0")))
    assert [a.rank for a in actions] == [0, 1]
    woken = parse_pmi2_frame(actions[1].data)
    assert woken.cmd == "info-getnodeattr-response"
    assert woken.args == (("thrid", "7"), ("found", "TRUE"), ("value", "seg0"), ("rc", "0"))


# --------------------------------------------------------------------------- fuzzing

FUZZ = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])

_pmi1_token = st.text(
    alphabet=st.characters(blacklist_categories=("Cs",), blacklist_characters="\n"),
    min_size=0,
    max_size=40,
)


@FUZZ
@given(st.binary(max_size=2 * PMI1_MAX_LINE))
def test_fuzz_pmi1_parser_random_bytes(data: bytes) -> None:
    try:
        msg = parse_pmi1_line(data)
    except PmiProtocolError:
        return
    assert msg.version == 1 and msg.cmd


@FUZZ
@given(
    st.lists(st.tuples(_pmi1_token, _pmi1_token), max_size=8),
    st.integers(min_value=0, max_value=2000),
)
def test_fuzz_pmi1_truncated_lines(pairs: list[tuple[str, str]], cut: int) -> None:
    line = ("cmd=put " + " ".join(f"{k}={v}" for k, v in pairs) + "\n").encode(
        "utf-8", "surrogatepass"
    )
    for candidate in (line, line[:cut], line[cut:]):
        try:
            parse_pmi1_line(candidate)
        except PmiProtocolError:
            pass


@FUZZ
@given(st.binary(max_size=4096))
def test_fuzz_pmi2_parser_random_bytes(data: bytes) -> None:
    for candidate in (data, f"{len(data):6d}".encode() + data, f"{len(data):<6d}".encode() + data):
        try:
            msg = parse_pmi2_frame(candidate)
        except PmiProtocolError:
            continue
        assert msg.version == 2 and msg.cmd


@FUZZ
@given(
    st.lists(
        st.tuples(
            st.text(alphabet="abcdefghijklmnopqrstuvwxyz-_/0123456789", min_size=1, max_size=12),
            st.text(max_size=60).filter(lambda s: "\x00" not in s),
        ),
        max_size=8,
    )
)
def test_fuzz_pmi2_round_trip(pairs: list[tuple[str, str]]) -> None:
    frame = format_pmi2("kvs-put", *pairs)
    msg = parse_pmi2_frame(frame)
    assert msg.args == tuple(pairs)


@FUZZ
@given(st.binary(max_size=3000), st.lists(st.integers(min_value=1, max_value=64), max_size=20))
def test_fuzz_decoder_and_launch_never_crash(data: bytes, chunks: list[int]) -> None:
    """Arbitrary bytes through decoder + state machine: only typed errors or actions."""
    launch = launch2()
    dec = PmiDecoder()
    pos = 0
    sizes = chunks or [len(data) or 1]
    i = 0
    while pos < len(data):
        size = sizes[i % len(sizes)]
        i += 1
        try:
            msgs = dec.feed(data[pos : pos + size])
        except PmiProtocolError as exc:
            assert all(isinstance(a, (Abort, Close)) for a in launch.protocol_error(0, exc))
            return
        finally:
            pos += size
        assert dec.pending <= 64 * 1024 + PMI1_MAX_LINE
        for msg in msgs:
            for action in launch.handle(0, msg):
                assert isinstance(action, (Reply, FenceReady, Abort, Close))


@FUZZ
@given(
    st.lists(
        st.sampled_from(
            [
                b"cmd=init pmi_version=1 pmi_subversion=1\n",
                b"cmd=init pmi_version=2 pmi_subversion=0\n",
                b"cmd=get_maxes\n",
                b"cmd=put kvsname=kvs_42_0 key=a value=1\n",
                b"cmd=get kvsname=kvs_42_0 key=a\n",
                b"cmd=barrier_in\n",
                b"cmd=finalize\n",
                b"cmd=abort exitcode=3\n",
                v2("kvs-put", ("key", "b"), ("value", "x;y")),
                v2("kvs-get", ("key", "b")),
                v2("kvs-fence"),
                v2("info-getnodeattr", ("key", "n"), ("wait", "TRUE")),
                v2("info-putnodeattr", ("key", "n"), ("value", "v")),
                b"mcmd=spawn\nnprocs=1\nendcmd\n",
            ]
        ),
        max_size=30,
    ),
    st.lists(st.integers(min_value=0, max_value=1), max_size=30),
)
def test_fuzz_valid_commands_state_machine(cmds: list[bytes], ranks: list[int]) -> None:
    """Any interleaving of valid commands yields actions; fences always complete."""
    launch = launch2()
    decoders = {0: PmiDecoder(), 1: PmiDecoder()}
    for n, raw in enumerate(cmds):
        rank = ranks[n] if n < len(ranks) else 0
        for msg in decoders[rank].feed(raw):
            for action in launch.handle(rank, msg):
                if isinstance(action, FenceReady):
                    released = launch.fence_done(action.puts)
                    assert all(isinstance(r, Reply) for r in released)
