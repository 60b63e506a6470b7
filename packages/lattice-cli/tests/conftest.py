"""Fixtures for CLI tests: an isolated environment and the real API in a thread.

``api`` is lattice-server's own REST and gRPC servers over a LocalQuorum
(lattice_test_harness.local_api), in a background thread because the CLI under test
calls ``asyncio.run`` itself; ``LATTICE_ENDPOINT`` points at it. It records every REST
request (``api.last()``), so tests check both what the user sees and what the CLI sent.
State is seeded by proposing real commands through the helpers below, so ids are the
server's, timestamps real and states reached by real transitions. End-to-end runs
against a real cluster are in ``test_e2e.py``.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import pytest
from lattice_api.settings import ApiSettings
from lattice_common.types import Allocation, AllocationSpec, AllocationState
from lattice_test_harness.local_api import LocalApi, ThreadedLocalApi

ENTRYPOINT = "/bin/bash /home/u/train.sh"


@pytest.fixture
def clean_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    """No user config, no LATTICE_* from the developer's shell."""
    for key in list(os.environ):
        if key.startswith("LATTICE_") or key == "NO_COLOR":
            monkeypatch.delenv(key)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "xdg"))
    monkeypatch.setenv("USER", "alice")
    return tmp_path


class CliApi:
    """A LocalApi (its handles: ``rest_url``, ``requests``, ``quorum``, ``logs``,
    ``propose``, ...) with the requests and seeding helpers the CLI tests share."""

    def __init__(self, api: LocalApi) -> None:
        self.api = api

    def __getattr__(self, name: str) -> Any:
        return getattr(self.api, name)

    # --- what the CLI sent ------------------------------------------------------------

    def last(self, method: str | None = None) -> dict[str, Any]:
        """The last REST request the server received (of ``method``, if given)."""
        return self.sent(method)[-1]

    def sent(self, method: str | None = None) -> list[dict[str, Any]]:
        return [r for r in self.api.requests if method is None or r["method"] == method]

    def allocation_ids(self) -> list[str]:
        """Every allocation's id, in submission order (the server generates them)."""
        return list(self.api.quorum.state.allocations)

    # --- seeding: real commands -----------------------------------------------------

    def names(
        self, tenants: Iterable[str] = ("physics",), vclusters: Iterable[str] = ("gpu-batch",)
    ) -> None:
        """Tenants and vClusters a submission may name (the server checks both)."""
        for name in tenants:
            self.api.add_tenant(name)
        for name in vclusters:
            self.api.add_vcluster(name)

    def nodes(self, *node_ids: str, **kw: Any) -> None:
        """Registered (Ready) nodes; ``kw`` as RegisterNode (capabilities, group, ...)."""
        for node_id in node_ids:
            self.api.add_node(node_id, **kw)

    def pending(self, *, age: float = 100.0, **kw: Any) -> Allocation:
        """alice's 24-hour ``train.sh`` in physics/gpu-batch (unless ``kw``, as
        AllocationSpec, says otherwise), submitted ``age`` seconds ago."""
        return self.api.submit(spec(**kw), now=time.time() - age)

    def running(
        self, nodes: Iterable[str] = ("nid001", "nid002"), *, ran: float = 60.0, **kw: Any
    ) -> Allocation:
        """Submitted, then started on ``nodes`` (registered if new) ``ran`` seconds ago."""
        node_ids = list(nodes)
        self.nodes(*(n for n in node_ids if n not in self.api.quorum.state.nodes))
        a = self.pending(nodes=len(node_ids), age=max(ran, 60.0) + 40.0, **kw)
        return self.api.start(a.id, node_ids, now=time.time() - ran)

    def ended(
        self,
        state: AllocationState = AllocationState.COMPLETED,
        *,
        ran: float = 60.0,
        ago: float = 0.0,
        exit_code: int | None = 0,
        reason: str = "",
        **kw: Any,
    ) -> Allocation:
        """Ran for exactly ``ran`` seconds, ending in ``state`` (Completed, Failed or
        Cancelled) ``ago`` seconds ago."""
        a = self.running(ran=ran + ago, **kw)
        assert a.started_at is not None
        return self.api.set_state(
            a.id, state, exit_code=exit_code, reason=reason, now=a.started_at + ran
        )


def spec(**kw: Any) -> AllocationSpec:
    base: dict[str, Any] = {
        "entrypoint": ENTRYPOINT,
        "name": "train.sh",
        "tenant": "physics",
        "vcluster": "gpu-batch",
        "user": "alice",
        "nodes": 1,
        "walltime_seconds": 86400,
    }
    return AllocationSpec(**{**base, **kw})


# the uenv registry of the test API: the API resolves --uenv at submit (the images
# themselves are never read there)
UENVS = {"prgenv-gnu/24.11:v1": "ab" * 32}


def uenv_registry(root: Path) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    index = {ref: {"file": "img.sqfs", "sha256": sha, "size": 1} for ref, sha in UENVS.items()}
    (root / "index.json").write_text(json.dumps(index))
    return root


@pytest.fixture
def api(clean_env: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[CliApi]:
    """The real API, empty, in development mode (the caller is ``x-lattice-user``), with
    LATTICE_ENDPOINT pointing at it; one per test (it starts in about a millisecond).
    Its uenv registry offers :data:`UENVS`."""
    settings = ApiSettings(uenv_registry=str(uenv_registry(clean_env / "uenv-registry")))
    with ThreadedLocalApi(settings=settings) as server:
        monkeypatch.setenv("LATTICE_ENDPOINT", server.rest_url)
        yield CliApi(server)
