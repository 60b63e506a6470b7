"""Whether an allocation is sensitive (its output goes to the encrypted pool) comes with
its desired state: the node's claim arrives in the same message as the work, so the
agent asks the quorum nothing per allocation; a member that does not send the claim is
still asked."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from lattice_agent.agent import Agent
from lattice_common.logstore import FsLogStore
from lattice_common.rpc import Endpoints
from lattice_common.types import Allocation, AllocationSpec, AllocationState, NodeCapabilities

pytestmark = pytest.mark.timeout(60)


def _agent(tmp_path: Path) -> Agent:
    # nothing listens at the endpoint: a question to the quorum could not be answered
    return Agent(
        node_id="n1",
        endpoints=Endpoints("127.0.0.1:1"),
        capabilities=NodeCapabilities(),
        hostname="n1",
        work_dir=tmp_path / "work",
        log_dir=tmp_path / "logs",
        state_file=tmp_path / "state.json",
        log_store=FsLogStore(tmp_path / "ordinary"),
        sensitive_log_store=FsLogStore(tmp_path / "sensitive"),
    )


def _job(aid: str, words: str) -> Allocation:
    return Allocation(
        id=aid,
        spec=AllocationSpec(entrypoint=f"echo {words}", tenant="t", vcluster="v", user="alice"),
        state=AllocationState.RUNNING,
        assigned_nodes=["n1"],
    )


def _holds(root: Path, words: str) -> bool:
    return any(words.encode() in p.read_bytes() for p in root.rglob("*") if p.is_file())


async def _ended(agent: Agent, aid: str) -> None:
    while not any(r.allocation_id == aid and r.phase == "exited" for r in agent.runtime.reports()):
        await asyncio.sleep(0.02)


async def test_the_claim_in_the_desired_state_picks_the_pool_without_asking(
    tmp_path: Path,
) -> None:
    agent = _agent(tmp_path)
    try:
        await agent.apply_desired(1, [_job("s1", "top-secret")], claimed_by="alice")
        await asyncio.wait_for(_ended(agent, "s1"), 20)
        await agent.apply_desired(2, [_job("o1", "plain-words")], claimed_by="")
        await asyncio.wait_for(_ended(agent, "o1"), 20)
        # both ended with their logs complete in their pool's store (asking the quorum,
        # unreachable here, would have left them unshipped)
        assert _holds(tmp_path / "sensitive", "top-secret")
        assert not _holds(tmp_path / "ordinary", "top-secret")
        assert _holds(tmp_path / "ordinary", "plain-words")
        assert not _holds(tmp_path / "sensitive", "plain-words")
    finally:
        await agent.runtime.close()


async def test_a_member_that_sends_no_claim_is_asked(tmp_path: Path) -> None:
    agent = _agent(tmp_path)
    try:
        await agent.apply_desired(1, [_job("u1", "unknown-pool")], claimed_by=None)
        await asyncio.wait_for(_ended(agent, "u1"), 20)
        # the question went to the (unreachable) quorum: nothing is shipped anywhere yet
        assert not _holds(tmp_path / "ordinary", "unknown-pool")
        assert not _holds(tmp_path / "sensitive", "unknown-pool")
    finally:
        await agent.runtime.close()
