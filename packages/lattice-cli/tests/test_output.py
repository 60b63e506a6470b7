"""What the CLI prints for API records: columns, durations, em dashes, detail views."""

from __future__ import annotations

from lattice_cli.output import (
    ALLOCATION_COLUMNS,
    DASH,
    allocation_detail,
    allocation_row,
    allocation_table,
    clock_time,
    compress_nodelist,
    format_hms,
    format_log_line,
    gpus_cell,
    iso_utc,
    node_table,
    raft_status_text,
    render_table,
    tenant_table,
    vcluster_table,
)

NOW = 1_772_704_800.0  # 2026-03-05T10:00:00Z


def alloc(**overrides):
    data = {
        "id": "a1b2c3d4",
        "spec": {
            "name": "train.sh",
            "nodes": 4,
            "walltime_seconds": 24 * 3600,
            "vcluster": "gpu-batch",
            "tenant": "physics",
            "project": "climate",
            "uenv": "prgenv-gnu/24.11:v1",
            "constraints": {"gpu_type": "GH200", "gpu_count": 4},
        },
        "state": "Running",
        "assigned_nodes": ["nid001", "nid002", "nid003", "nid007"],
        "submitted_at": NOW - 1000,
        "started_at": NOW - (12 * 60 + 34),
        "finished_at": None,
        "exit_code": None,
        "reason": "",
        "requeue_count": 0,
    }
    data.update(overrides)
    return data


def test_table_matches_getting_started_example():
    text = allocation_table([alloc()], NOW)
    header, row = text.splitlines()
    assert header.split() == list(ALLOCATION_COLUMNS)
    assert header.startswith("ID")
    assert row.split() == [
        "a1b2c3d4",
        "train.sh",
        "Running",
        "4",
        "24:00:00",
        "00:12:34",
        clock_time(NOW - (12 * 60 + 34), NOW),  # START_TIME: when it started, local time
        "gpu-batch",
    ]
    # columns line up: every cell starts where its header starts
    for name, value in zip(ALLOCATION_COLUMNS, row.split(), strict=True):
        assert row[header.index(name) :].startswith(value)


def test_pending_has_em_dashes_and_hours_over_24():
    pending = alloc(state="Pending", started_at=None, spec={"name": "eval", "nodes": 4})
    row = allocation_row(pending, NOW)
    assert row[4] == DASH  # no walltime
    assert row[5] == DASH  # not started
    assert row[6] == DASH  # no estimate yet
    assert row[7] == DASH  # no vCluster


def test_a_pending_allocations_start_time_is_marked_as_an_estimate():
    later = alloc(
        state="Pending", started_at=None, estimated_start=NOW + 3600, estimate_basis="simulation"
    )
    assert allocation_row(later, NOW)[6] == "~" + clock_time(NOW + 3600, NOW)
    now = alloc(state="Pending", started_at=None, estimated_start=NOW, estimate_basis="now")
    assert allocation_row(now, NOW)[6] == "~now"
    detail = allocation_detail(later, NOW)
    assert "Estimated start:" in detail and "in 01:00:00; estimate: simulation" in detail
    long = alloc(spec={"walltime_seconds": 72 * 3600, "nodes": 64})
    assert allocation_row(long, NOW)[4] == "72:00:00"


def test_elapsed_stops_at_finish():
    done = alloc(state="Completed", started_at=NOW - 3600, finished_at=NOW - 1800)
    assert allocation_row(done, NOW)[5] == "00:30:00"


def test_wide_columns():
    text = allocation_table([alloc(reason="")], NOW, wide=True)
    header, row = text.splitlines()
    assert header.split() == [
        *ALLOCATION_COLUMNS,
        "TENANT",
        "PROJECT",
        "UENV",
        "GPU_TYPE",
        "NODELIST",
        "REASON",
    ]
    assert row.split()[-6:] == [
        "physics",
        "climate",
        "prgenv-gnu/24.11:v1",
        "GH200",
        "nid[001-003,007]",
        DASH,
    ]


def test_empty_table_is_just_the_header():
    assert allocation_table([], NOW).split() == list(ALLOCATION_COLUMNS)


def test_missing_fields_do_not_crash():
    row = allocation_row({"id": "x"}, NOW, wide=True)
    assert row[0] == "x" and all(isinstance(c, str) for c in row)
    assert row[1:].count(DASH) == len(row) - 1


def test_format_hms():
    assert format_hms(None) == DASH
    assert format_hms(0) == "00:00:00"
    assert format_hms(59.9) == "00:00:59"
    assert format_hms(3600 * 100 + 61) == "100:01:01"
    assert format_hms(-5) == "00:00:00"
    assert format_hms("junk") == DASH  # type: ignore[arg-type]


def test_detail_view():
    text = allocation_detail(
        alloc(state="Failed", exit_code=137, reason="walltime_exceeded", requeue_count=2),
        NOW,
    )
    lines = dict(line.split(":", 1) for line in text.splitlines())
    assert lines["State"].strip() == "Failed"
    assert lines["Reason"].strip() == "walltime_exceeded"
    assert lines["Exit code"].strip() == "137"
    assert lines["Requeue count"].strip() == "2"
    assert lines["Assigned nodes"].strip() == "nid[001-003,007]"
    assert lines["Walltime"].strip() == "24:00:00"
    assert lines["Constraints"].strip() == "gpu_type=GH200,gpu_count=4"
    assert "Submitted" in lines
    running = dict(line.split(":", 1) for line in allocation_detail(alloc(), NOW).splitlines())
    assert running["Exit code"].strip() == DASH


def test_compress_nodelist():
    assert compress_nodelist([]) == ""
    assert compress_nodelist(["a"]) == "a"
    assert compress_nodelist(["n1", "n2", "n3"]) == "n[1-3]"
    assert compress_nodelist(["x1000c0s0b0n0", "x1000c0s0b0n1"]) == "x1000c0s0b0n[0-1]"
    assert compress_nodelist(["nid01", "nid1", "login"]) == "nid01,nid1,login"


def test_nodes_table():
    nodes = [
        {
            "id": "x1000c0s0b0n0",
            "state": "Ready",
            "capabilities": {"gpu_type": "GH200", "gpu_count": 4},
            "owner_vcluster": "hpc-batch",
            "owner_tenant": "physics",
            "group": 3,
            "conformance_group": "a1b2c3",
        },
        {"id": "cpu01", "state": "Draining", "capabilities": {}, "group": 0, "disabled": True},
    ]
    header, first, second = node_table(nodes).splitlines()
    assert header.split() == ["NODE", "STATE", "GPUS", "VCLUSTER", "TENANT", "GROUP", "CONFORMANCE"]
    assert first.split() == [
        "x1000c0s0b0n0",
        "Ready",
        "4×GH200",
        "hpc-batch",
        "physics",
        "3",
        "a1b2c3",
    ]
    assert second.split() == ["cpu01", "Draining(disabled)", DASH, DASH, DASH, "0", DASH]
    assert gpus_cell({"gpu_count": 2}) == "2"
    assert gpus_cell(None) == DASH


def test_color_does_not_break_alignment():
    plain = render_table(("A", "STATE", "B"), [["x", "Running", "y"]])
    colored = render_table(
        ("A", "STATE", "B"), [["x", "Running", "y"]], color_column="STATE", color=True
    )
    assert "\x1b[32mRunning\x1b[0m" in colored
    strip = colored.replace("\x1b[32m", "").replace("\x1b[0m", "")
    assert strip == plain


def test_admin_tables_and_raft():
    tenants = tenant_table([{"name": "physics", "max_nodes": 200, "fair_share_target": 0.3}])
    assert tenants.splitlines()[1].split()[:4] == ["physics", "200", DASH, "0.3"]
    vcs = vcluster_table(
        [
            {
                "name": "hpc",
                "scheduler_type": "hpc-backfill",
                "cycle_interval_seconds": 5.0,
                "allow_borrowing": True,
            }
        ]
    )
    assert vcs.splitlines()[1].split() == ["hpc", "hpc-backfill", DASH, "5s", DASH, "yes"]
    raft = raft_status_text(
        {
            "member_id": 1,
            "leader_id": 2,
            "leader_address": "10.0.0.2:9000",
            "term": 4,
            "commit_index": 99,
            "members": [
                {"id": 1, "address": "10.0.0.1:9000"},
                {"id": 2, "address": "10.0.0.2:9000"},
            ],
        }
    )
    assert raft.splitlines()[1].split(":", 1)[1].strip() == "2 (10.0.0.2:9000)"
    assert raft.splitlines()[-1].split() == ["2", "10.0.0.2:9000", "leader"]
    # lattice-server's shape: no leader_id, is_leader and the leader's API address instead
    server = raft_status_text(
        {
            "member_id": 1,
            "is_leader": True,
            "leader_address": "127.0.0.1:9000",
            "leader_api_address": "127.0.0.1:8080",
            "term": 1,
            "commit_index": 5,
            "revision": 9,
            "members": [{"id": 1, "address": "127.0.0.1:9000", "state": "leader"}],
        }
    )
    head = server.split("\n\n")[0]
    fields = dict(line.split(":", 1) for line in head.splitlines())
    assert fields["Member"].strip() == "1 (leader)"
    assert fields["Leader"].strip() == "127.0.0.1:9000, API 127.0.0.1:8080"
    assert fields["Revision"].strip() == "9"


def test_log_lines():
    line = {"line": "Epoch 1/100, loss=2.341\n", "timestamp": 1772704812.0, "node_id": "n1"}
    assert format_log_line(line) == "[2026-03-05T10:00:12Z] Epoch 1/100, loss=2.341"
    assert format_log_line(line, timestamps=False, node=True) == "n1: Epoch 1/100, loss=2.341"
    assert format_log_line({"line": "x", "timestamp": "2026-01-01T00:00:00Z"}).startswith(
        "[2026-01-01"
    )
    assert iso_utc(None) == DASH


def test_releasing_names_the_nodes_and_the_deadline() -> None:
    from lattice_cli.output import clock_time, releasing_text

    now = 1_700_000_000.0
    alloc = {
        "scaling_status": {
            "releasing": ["x1000c0s0b0n2"],
            "release_at": now,
            "release_by": now + 600,
        }
    }
    text = releasing_text(alloc, now)
    assert (
        text == f"x1000c0s0b0n2 after its checkpoint, by {clock_time(now + 600, now)} at the latest"
    )
    assert releasing_text({"scaling_status": {"releasing": []}}, now) is None
    assert releasing_text({}, now) is None
