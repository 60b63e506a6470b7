"""Steps for features/checkpoint_storage.feature: checkpoints in an S3 bucket (a real
S3-compatible server, moto's server mode as a process of its own so that it can be
stopped), on a fresh one-node real cluster per scenario whose checkpoint root is
``s3://BUCKET/PREFIX``. The jobs are batch scripts that `exec` the counting test
applications of lattice-node-agent (tests/apps). The checkpoint broker runs only once
the storage is down, to report the outage."""

from __future__ import annotations

import asyncio
import re
import sys
import time
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from lattice_acceptance.steps import *  # noqa: F403 (shared step definitions)
from lattice_acceptance.world import TIMEOUT, log_lines
from lattice_acceptance.world import World as ClusterWorld
from lattice_acceptance.world import show as _show
from lattice_checkpoint.storage import AllocationKey, open_checkpoint_store
from lattice_common.config import StorageConfig
from lattice_test_harness.cluster import ClusterHandle
from lattice_test_harness.s3 import ACCESS_KEY_ID, SECRET_ACCESS_KEY, MotoS3Process
from pytest_bdd import given, parsers, scenarios, then, when

pytestmark = [pytest.mark.cluster]

scenarios("checkpoint_storage.feature")

APPS = Path(__file__).resolve().parents[2] / "lattice-node-agent" / "tests" / "apps"
BUCKET = "site-checkpoints"
ROOT = f"s3://{BUCKET}/lattice"


@dataclass
class World(ClusterWorld):
    s3: MotoS3Process | None = None
    saved: dict[str, int] = field(default_factory=dict)  # job -> its checkpointed counter


@pytest.fixture
def world(cluster_factory: Callable[..., ClusterHandle], tmp_path: Path) -> Iterator[World]:
    s3 = MotoS3Process().start()
    s3.create_bucket(BUCKET)

    def make(**kw: Any) -> ClusterHandle:
        env = {
            "LATTICE_CHECKPOINT__CHECKPOINT_ROOT": ROOT,
            "LATTICE_CHECKPOINT__CHECKPOINT_TIMEOUT_SECONDS": "10",
            "LATTICE_CHECKPOINT__EVALUATION_INTERVAL_SECONDS": "1",
            "LATTICE_STORAGE__S3_ENDPOINT": s3.endpoint,
            "LATTICE_STORAGE__S3_ACCESS_KEY_ID": ACCESS_KEY_ID,
            "LATTICE_STORAGE__S3_SECRET_ACCESS_KEY": SECRET_ACCESS_KEY,
        }
        return cluster_factory(env=env, checkpoint_broker=True, **kw)

    w = World(make=make, workdir=tmp_path / "work", s3=s3)
    w.workdir.mkdir()
    try:
        yield w
    finally:
        w.clean_up()
        s3.stop()


def show(world: World) -> str:
    return _show(world.last) if world.last is not None else ""


def wait(world: World, what: str, fn: Callable[[], Any], timeout: float = TIMEOUT * 3) -> Any:
    return world.cluster.wait_for(what, fn, timeout=timeout, interval=0.2)


def logs(world: World, name: str) -> list[str]:
    return log_lines(world.cli("logs", world.jobs[name].id))


def stored_counter(world: World, name: str, checkpoint_id: str) -> int:
    """The counter in the checkpoint as the bucket holds it."""
    assert world.s3 is not None
    storage = StorageConfig(
        s3_endpoint=world.s3.endpoint,
        s3_access_key_id=ACCESS_KEY_ID,  # type: ignore[arg-type]
        s3_secret_access_key=SECRET_ACCESS_KEY,  # type: ignore[arg-type]
    )
    job = world.jobs[name]
    key = AllocationKey(world.cluster.cluster.tenant, "default", job.id)
    dest = world.workdir / "downloaded" / job.id

    async def read() -> int:
        store = open_checkpoint_store(ROOT, storage)
        try:
            await store.download(key, checkpoint_id, dest)
        finally:
            await store.close()
        return int((dest / "counter").read_text())

    return asyncio.run(read())


def broker_gauge(world: World) -> float | None:
    url = f"http://127.0.0.1:{world.cluster.cluster.broker_metrics_port}/metrics"
    try:
        with urllib.request.urlopen(url, timeout=10) as r:
            text = r.read().decode()
    except OSError:
        return None
    for line in text.splitlines():
        if line.startswith("lattice_checkpoint_storage_unavailable "):
            return float(line.split()[1])
    return None


# --------------------------------------------------------------------------- given


@given("a Lattice cluster with 1 node that keeps checkpoints in an S3 bucket")
def one_node_s3(world: World) -> None:
    world.start_cluster(1)
    world.cluster.cluster.stop_broker()  # started when the storage goes down


@given(
    parsers.re(
        r'a class-(?P<cls>\d+) job "(?P<name>[^"]+)" submitted with "(?P<flag>[^"]+)" '
        r"that counts to (?P<limit>\d+)"
    )
)
def counting_job(world: World, cls: str, name: str, flag: str, limit: str) -> None:
    app = APPS / f"ckpt_{flag.split('=', 1)[1]}.py"
    job = world.submit(
        name,
        f"exec {sys.executable} {app} {limit} 0.05",
        directives=("--walltime=10m", f"--preemption-class={cls}", flag),
    )
    world.wait_running(job)
    wait(world, f"{name} counting", lambda: "count 5" in logs(world, name))


# --------------------------------------------------------------------------- when


@when(parsers.parse('the owner runs "lattice {verb}" on "{name}"'))
def owner_runs(world: World, verb: str, name: str) -> None:
    r = world.cli(verb, world.jobs[name].id)
    said = {"suspend": "Suspending", "resume": "Resumed"}[verb]
    assert said in r.stdout, show(world)


@when("the S3 service stops")
def s3_stops(world: World) -> None:
    assert world.s3 is not None
    world.s3.stop()
    world.cluster.cluster.start_broker()


# --------------------------------------------------------------------------- then


@then(parsers.parse('"{name}" becomes Suspended with its checkpoint stored in the bucket'))
def suspended_in_bucket(world: World, name: str) -> None:
    job = world.jobs[name]
    a = world.cluster.wait_state(job.id, "Suspended", timeout=TIMEOUT * 2)
    path = a["last_checkpoint"]["path"]
    tenant = world.cluster.cluster.tenant
    assert path == f"{ROOT}/{tenant}/default/{job.id}/checkpoints/ckpt-1/", a["last_checkpoint"]
    world.saved[name] = stored_counter(world, name, "ckpt-1")
    line = world.status_field(job.id, "Last checkpoint")
    assert line.startswith("ckpt-1") and path in line, show(world)
    time.sleep(1.0)  # an owner's suspend is not requeued on its own
    assert world.cluster.get(job.id)["state"] == "Suspended"


@then(parsers.parse('"{name}" runs again, resumes from its saved counter and ends Completed'))
def resumes(world: World, name: str) -> None:
    world.wait_end(name)
    saved = world.saved[name]
    out = logs(world, name)
    assert f"resumed from {saved}" in out, out
    assert out.count("started fresh") == 1, out
    assert any(re.fullmatch(r"finished at \d+", ln) for ln in out), out


@then("the checkpoint broker reports checkpoint storage unavailable")
def broker_reports(world: World) -> None:
    wait(world, "lattice_checkpoint_storage_unavailable 1", lambda: broker_gauge(world) == 1.0)


@then(
    parsers.parse(
        '"{name}" ends Failed because checkpoint storage is unavailable and was never Suspended'
    )
)
def ends_failed(world: World, name: str) -> None:
    seen = world.cluster.states_seen(world.jobs[name].id, timeout=TIMEOUT * 2)
    assert seen[-1] == "Failed" and "Suspended" not in seen, seen
    a = world.cluster.get(world.jobs[name].id)
    assert a["reason"].startswith("checkpoint storage unavailable: "), a
    assert world.status_field(a["id"], "State") == "Failed"


@then(parsers.parse('"{name}" never wrote a checkpoint'))
def never_wrote(world: World, name: str) -> None:
    assert world.cluster.get(world.jobs[name].id).get("last_checkpoint") is None
    assert not any(ln.startswith("checkpointed at") for ln in logs(world, name))
