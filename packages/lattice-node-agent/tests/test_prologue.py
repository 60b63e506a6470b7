"""PrologueManager with a real uenv cache and real hook scripts: a Staging allocation is
staged (image cached and pinned) or fails with the cause; results belong to one attempt;
pins go when the allocation leaves; the epilogue runs for every allocation that leaves."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from lattice_agent.prologue import PrologueManager
from lattice_common.types import PHASE_PROLOGUE_FAILED, PHASE_STAGED, AllocationState
from lattice_test_harness.builders import allocation
from test_uenv import make_cache

pytestmark = pytest.mark.timeout(30)

S = AllocationState


def staging(aid: str = "a1", nodes: tuple[str, ...] = ("n0", "n1"), **spec):  # type: ignore[no-untyped-def]
    a = allocation(id=aid, nodes=len(nodes), **spec)
    a.state = S.STAGING
    a.assigned_nodes = list(nodes)
    return a


def hook(tmp_path: Path, name: str, body: str) -> str:
    p = tmp_path / name
    p.write_text("#!/bin/sh\n" + body + "\n")
    p.chmod(0o755)
    return str(p)


async def test_staged_with_the_image_cached_and_pinned(tmp_path: Path) -> None:
    cache = make_cache(tmp_path, {"env/1.0:v1": b"squash"})
    beats: list[int] = []
    pm = PrologueManager("n1", uenv=cache, on_result=lambda: beats.append(1))
    a = staging(uenv="env/1.0:v1")
    pm.sync({a.id: a})
    await pm.idle()
    [r] = pm.reports()
    assert (r.allocation_id, r.phase, r.reason, r.attempt) == ("a1", PHASE_STAGED, "", 0)
    assert beats == [1]  # the result goes out with a heartbeat at once
    assert [e.in_use for e in cache.entries()] == [True]
    a.state = S.RUNNING
    pm.sync({a.id: a})
    assert pm.reports() == []  # Running: nothing more to say
    pm.sync({})  # it left this node: the pin goes
    assert [e.in_use for e in cache.entries()] == [False]


async def test_tampered_image_fails_with_the_cause(tmp_path: Path) -> None:
    cache = make_cache(tmp_path, {"env/1.0:v1": b"squash"}, bad_hash={"env/1.0:v1"})
    pm = PrologueManager("n0", uenv=cache)
    a = staging(uenv="env/1.0:v1")
    pm.sync({a.id: a})
    await pm.idle()
    [r] = pm.reports()
    assert r.phase == PHASE_PROLOGUE_FAILED
    assert r.reason.startswith("uenv env/1.0:v1: image hash mismatch (expected ")
    assert cache.entries() == []  # nothing bad left in the cache


async def test_uenv_disabled_and_unknown_node(tmp_path: Path) -> None:
    pm = PrologueManager("n0")
    a = staging(uenv="env/1.0:v1")
    other = staging("a2", nodes=("n5",), uenv="env/1.0:v1")
    pm.sync({a.id: a, other.id: other})
    await pm.idle()
    [r] = pm.reports()
    assert r.allocation_id == "a1" and "uenv is not enabled on this node" in r.reason


async def test_site_hook_runs_with_the_allocation_and_its_failure_is_the_cause(
    tmp_path: Path,
) -> None:
    seen = tmp_path / "seen"
    script = hook(
        tmp_path,
        "prologue",
        f'echo "$LATTICE_ALLOCATION_ID $LATTICE_NODE_ID $LATTICE_NODELIST" > {seen}\n'
        'echo "checking GPUs"; echo "GPU 3 has ECC errors" >&2; exit 3',
    )
    pm = PrologueManager("n0", script=script, uenv=make_cache(tmp_path, {"x/1:v": b"z"}))
    a = staging(uenv="x/1")
    pm.sync({a.id: a})
    await pm.idle()
    [r] = pm.reports()
    assert r.phase == PHASE_PROLOGUE_FAILED
    assert r.reason == "prologue script exited with 3: GPU 3 has ECC errors"
    assert seen.read_text() == "a1 n0 n0,n1\n"


async def test_hook_timeout_fails_the_prologue(tmp_path: Path) -> None:
    script = hook(tmp_path, "slow", "sleep 30")
    pm = PrologueManager(
        "n0", script=script, timeout=0.3, uenv=make_cache(tmp_path, {"x/1:v": b"z"})
    )
    a = staging(uenv="x/1")
    pm.sync({a.id: a})
    await pm.idle()
    [r] = pm.reports()
    assert r.phase == PHASE_PROLOGUE_FAILED and r.reason == "prologue timed out after 0s"


async def test_results_belong_to_one_attempt(tmp_path: Path) -> None:
    script = hook(tmp_path, "count", f"echo x >> {tmp_path / 'runs'}")
    pm = PrologueManager("n0", script=script, uenv=make_cache(tmp_path, {"x/1:v": b"z"}))
    a = staging(uenv="x/1")
    pm.sync({a.id: a})
    await pm.idle()
    pm.sync({a.id: a})  # the same attempt again: not run twice
    await pm.idle()
    assert (tmp_path / "runs").read_text() == "x\n"
    again = staging(uenv="x/1")
    again.prologue_failures = 1  # failed elsewhere, placed here again: a new attempt
    pm.sync({a.id: again})
    await pm.idle()
    assert (tmp_path / "runs").read_text() == "x\nx\n"
    [r] = pm.reports()
    assert r.attempt == 1


async def test_epilogue_runs_for_every_allocation_that_leaves(tmp_path: Path) -> None:
    log = tmp_path / "epi"
    script = hook(tmp_path, "epilogue", f'echo "$LATTICE_ALLOCATION_ID" >> {log}')
    pm = PrologueManager("n0", epilogue_script=script)
    bare = allocation(id="b1")
    bare.state = S.RUNNING
    bare.assigned_nodes = ["n0"]
    pm.sync({"b1": bare})
    pm.sync({})
    await pm.idle()
    await asyncio.sleep(0)
    assert log.read_text() == "b1\n"
