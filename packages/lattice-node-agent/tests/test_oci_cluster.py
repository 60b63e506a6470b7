"""OCI containers and agent restarts on a real local cluster (2 agents running jobs as
their submitting user, a real registry, crun, real SquashFS mounts).

* A job in an image from the local registry passes through Staging (both nodes pull
  it), runs as the submitting user's uid with a read-only root and its working
  directory bound in, and `lattice status -o json` shows the registry's digest.
* The allocation's agent socket (Hydra's launcher) belongs to that user, mode 0600.
* With a uenv job and a container job running, the agent is killed with SIGKILL and
  started again: it reattaches both (nothing starts twice), they complete once, and no
  cgroup scope, container or bundle is left behind.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
from pathlib import Path

import pytest
from lattice_test_harness.oci_registry import (
    LocalRegistry,
    build_image,
    registry_digest,
    skip_unless_oci,
)
from lattice_test_harness.plugin import make_cluster
from test_staging_cluster import _image, _registry

skip_unless_oci()

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(240)]

UID = 1000  # the submitting user "tester" on these nodes (node_agent.user_map)
STATE_ROOT = "/run/lattice/crun"  # lattice_agent.oci.DEFAULT_STATE_ROOT


def _containers() -> list[str]:
    r = subprocess.run(["crun", "--root", STATE_ROOT, "list", "-q"], capture_output=True, text=True)
    return [c for c in r.stdout.split() if c.startswith("lattice-")]


def _shared_dir(path: Path) -> Path:
    """A directory the job's user can use, under pytest's root-only tmp directory."""
    path.mkdir(parents=True)
    for p in [path, *path.parents]:
        if str(p) in ("/", "/tmp"):
            break
        os.chmod(p, os.stat(p).st_mode | 0o755)
    os.chmod(path, 0o777)
    return path


def test_container_job_as_user_then_reattached_after_agent_kill(tmp_path: Path) -> None:
    _registry(tmp_path / "uenv-registry", _image(tmp_path / "uenv-build"))
    work = _shared_dir(tmp_path / "work")
    env = {
        "LATTICE_NODE_AGENT__USER_MAP": json.dumps({"tester": f"{UID}:{UID}"}),
        "LATTICE_NODE_AGENT__UENV_REGISTRY": str(tmp_path / "uenv-registry"),
    }
    with LocalRegistry() as reg:
        ref = build_image(reg, "lattice/app", "1", {"/etc/motd": "inside the image\n"})
        digest = registry_digest(reg, "lattice/app", "1")
        h = make_cluster(
            tmp_path / "cluster",
            members=1,
            agents=2,
            env=env,
            agent_args=("--run-as", "submitter"),
        )
        try:
            entry = (
                "id -u; cat /etc/motd; "
                "(touch /root-file 2>/dev/null && echo root-writable) || echo root-read-only; "
                "echo from-the-job > out.txt; cat out.txt"
            )
            a = h.submit(entry, image=ref, submit_dir=str(work), nodes=2)["id"]
            done = h.wait_state(a, ("Completed", "Failed"), timeout=90)
            assert done["state"] == "Completed", done
            assert h.logs(a) == [str(UID), "inside the image", "root-read-only", "from-the-job"]
            assert (work / "out.txt").stat().st_uid == UID
            assert sorted(done["staged_nodes"]) == ["node-001", "node-002"]
            status = h.cli("status", a, "-o", "json")
            assert json.loads(status.stdout)["image_digest"] == digest, status.stdout

            # the allocation's agent socket (mpirun's launcher) is the job user's: it can
            # connect, nobody else can (the launcher itself is tested in test_hydra_cluster)
            b = h.submit(
                'stat -c "%u %a" "$LATTICE_AGENT_SOCKET"; test -w "$LATTICE_AGENT_SOCKET" && echo ok',
                submit_dir=str(work),
            )["id"]
            done = h.wait_state(b, ("Completed", "Failed"), timeout=60)
            assert done["state"] == "Completed", (done, h.logs(b))
            assert h.logs(b) == [f"{UID} 600", "ok"]

            # --- kill -9 the agents while a uenv job and a container job run
            trace = work / "trace"
            wait = f"while [ ! -e {work}/release ]; do sleep 0.1; done"
            u = h.submit(
                f"echo uenv-start >> {trace}; {wait}; /user-environment/bin/hello; "
                f"echo uenv-done >> {trace}",
                uenv="env/1.0:v1",
                submit_dir=str(work),
            )["id"]
            c = h.submit(
                f"echo oci-start >> {trace}; {wait}; cat /etc/motd; echo oci-done >> {trace}",
                image=ref,
                submit_dir=str(work),
            )["id"]
            for x in (u, c):
                h.wait_state(x, "Running", timeout=60)
            h.wait_for(
                "both jobs started",
                lambda: trace.exists() and len(trace.read_text().split()) == 2,
                timeout=30,
            )
            assert len(_containers()) == 1
            for agent in h.cluster.agents:
                h.cluster.stop_agent(agent, signal.SIGKILL)
            for agent in h.cluster.agents:
                h.cluster.start_agent(agent)
            h.cluster.wait_for_nodes(2, 30)
            assert h.get(u)["state"] == "Running" and h.get(c)["state"] == "Running"
            (work / "release").touch()
            for x in (u, c):
                end = h.wait_state(x, ("Completed", "Failed"), timeout=60)
                assert end["state"] == "Completed", end
            assert sorted(trace.read_text().split()) == [
                "oci-done",
                "oci-start",
                "uenv-done",
                "uenv-start",
            ]  # each ran once
            assert h.logs(c) == ["inside the image"]
            assert h.logs(u)[0].startswith("hello from /user-environment/bin")
            h.wait_for("no container left", lambda: _containers() == [], timeout=30)
            bundles = list(h.cluster.base.glob("agents/*/cache/oci/bundles/*"))
            assert bundles == [], bundles
            scopes = list(Path("/sys/fs/cgroup/memory").glob(f"{h.cluster.cgroup_slice}/*/*"))
            assert [s for s in scopes if s.name.startswith("alloc-")] == [], scopes
        finally:
            h.cluster.stop()
