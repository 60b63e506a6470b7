"""Staging on a real local cluster (3 agents, real SquashFS images, real mounts).

A job with a uenv passes through Staging (every node fetches and verifies the image)
into Running and runs a program from the mount. A job whose image was tampered with
fails its prologue on one node after another, is retried on nodes it has not failed on,
and ends Failed after three tries with the cause.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import pytest
from lattice_test_harness.plugin import make_cluster
from lattice_test_harness.uenv_images import build_squashfs, index_entry
from test_uenv import _MOUNT_SKIP

pytestmark = [
    pytest.mark.cluster,
    pytest.mark.timeout(180),
    pytest.mark.skipif(bool(_MOUNT_SKIP), reason=_MOUNT_SKIP or "-"),
]


HELLO = '#!/bin/sh\necho "hello from $(dirname "$0") on $LATTICE_NODE_ID"\n'


def _image(tmp: Path) -> Path:
    return build_squashfs(tmp / "env.sqfs", {"bin/hello": HELLO})


def _registry(root: Path, image: Path) -> None:
    """``env/1.0:v1`` (the image) and ``env/1.0:bad`` (its index hash is wrong)."""
    root.mkdir(parents=True)
    shutil.copy(image, root / "good.sqfs")
    shutil.copy(image, root / "bad.sqfs")
    wrong = hashlib.sha256(b"not this image").hexdigest()
    index = {
        "env/1.0:v1": index_entry(root / "good.sqfs"),
        "env/1.0:bad": index_entry(root / "bad.sqfs", sha256=wrong),
    }
    (root / "index.json").write_text(json.dumps(index))


def test_staging_then_running_and_prologue_retries(tmp_path: Path) -> None:
    _registry(tmp_path / "registry", _image(tmp_path / "build"))
    env = {
        "LATTICE_NODE_AGENT__UENV_REGISTRY": str(tmp_path / "registry"),
        "LATTICE_NODE_AGENT__UENV_CACHE_DIR": str(tmp_path / "cache"),
    }
    h = make_cluster(tmp_path / "cluster", members=1, agents=3, env=env)
    try:
        good = h.submit("/user-environment/bin/hello", uenv="env/1.0:v1", nodes=2)["id"]
        seen = h.states_seen(good, timeout=60)
        assert seen[-1] == "Completed", (seen, h.get(good))
        assert "Staging" in seen and seen.index("Staging") < seen.index("Running")
        [line] = h.logs(good)
        assert line.startswith("hello from /user-environment/bin on node-")
        # the host never sees the mount
        assert "/user-environment" not in Path("/proc/self/mountinfo").read_text()

        bad = h.submit("/user-environment/bin/hello", uenv="env/1.0:bad")["id"]
        a = h.wait_state(bad, ("Failed", "Completed"), timeout=90)
        assert a["state"] == "Failed", a
        assert a["reason"].startswith("prologue_failed: uenv env/1.0:bad: image hash mismatch")
        assert a["reason"].endswith("3 tries)")
        assert sorted(a["excluded_nodes"]) == ["node-001", "node-002", "node-003"]
        assert a["prologue_failures"] == 3
        # every node is free again for the next job
        again = h.submit("/user-environment/bin/hello", uenv="env/1.0:v1", nodes=3)["id"]
        assert h.wait_state(again, ("Completed", "Failed"), timeout=60)["state"] == "Completed"
    finally:
        h.cluster.stop()
