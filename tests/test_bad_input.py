"""Bad submissions are refused with a clear error and a hint, and store nothing: once
through the real `lattice` CLI, once straight against the REST API."""

from __future__ import annotations

import pytest
from lattice_test_harness.cluster import ApiError

pytestmark = pytest.mark.cluster


def count(h) -> int:
    return len(h.allocations())


W = "--walltime=1m"  # every case is valid but for the one thing it gets wrong

CLI_CASES = [
    pytest.param(["--walltime=abc", "--", "echo", "hi"], "walltime", id="walltime-abc"),
    pytest.param(
        [W, "--nodes=0", "--", "echo", "hi"],
        "nodes",
        id="nodes-0",
    ),
    pytest.param(
        [W, "--nodes=-1", "--", "echo", "hi"],
        "nodes",
        id="nodes-minus-1",
    ),
    pytest.param(
        [W, "--vcluster=no-such-vcluster", "--", "echo", "hi"],
        "no-such-vcluster",
        id="unknown-vcluster",
    ),
    pytest.param(
        [W, "--preemption-class=11", "--", "echo", "hi"],
        "preemption",
        id="preemption-class-11",
    ),
    pytest.param([W], "nothing to submit", id="no-command"),
    pytest.param([W, "--"], "nothing to submit", id="empty-command-after-dashdash"),
    pytest.param(
        [W, "--", ""],
        "",
        id="empty-string-command",
    ),
]


@pytest.mark.parametrize(("args", "mentions"), CLI_CASES)
def test_cli_submit_rejects_bad_input(lattice_cluster, args, mentions):
    h = lattice_cluster
    before = count(h)
    r = h.cli("submit", *args)
    after = count(h)
    # do not leave a wrongly accepted allocation around for the next case
    for a in h.allocations():
        if a["state"] not in ("Completed", "Failed", "Cancelled"):
            h.cancel(a["id"])
    assert after == before, f"something was stored: {r.stdout!r}"
    assert r.returncode != 0, r.stdout
    assert "Traceback" not in r.stderr, r.stderr
    lines = r.stderr.splitlines()
    errors = [ln for ln in lines if ln.startswith("Error:")]
    assert errors, r.stderr
    assert mentions.lower() in errors[0].lower(), r.stderr
    assert any(ln.startswith("Hint:") for ln in lines), r.stderr


REST_CASES = [
    pytest.param({"walltime": "abc"}, 400, "walltime", id="walltime-abc"),
    pytest.param({"nodes": 0}, 400, "nodes", id="nodes-0"),
    pytest.param({"nodes": -1}, 400, "nodes", id="nodes-minus-1"),
    pytest.param({"vcluster": "no-such-vcluster"}, 404, "vCluster", id="unknown-vcluster"),
    pytest.param({"preemption_class": 11}, 400, "preemption class", id="preemption-class-11"),
    pytest.param({"entrypoint": ""}, 400, "entrypoint", id="empty-command"),
    pytest.param({"entrypoint": "   "}, 400, "entrypoint", id="blank-command"),
]


@pytest.mark.parametrize(("override", "status", "mentions"), REST_CASES)
def test_rest_submit_rejects_bad_input(lattice_cluster, override, status, mentions):
    h = lattice_cluster
    before = count(h)
    body = {"entrypoint": "echo hi", "tenant": h.cluster.tenant, "vcluster": "default"}
    body.update({"walltime": "1m", **override})
    with pytest.raises(ApiError) as exc:
        h.request("POST", "/api/v1/allocations", body)
    assert count(h) == before
    err = exc.value
    assert err.status == status, err.error
    assert err.error["code"] in ("invalid_argument", "not_found")
    assert mentions.lower() in err.error["message"].lower(), err.error
    assert err.error["hint"], err.error
