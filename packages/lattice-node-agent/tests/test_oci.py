"""oci.py against the real tools: a local docker-registry, skopeo, umoci and crun.

Images are built from the host's busybox (no network) and pushed to a registry on loopback;
containers run through ``OciStore.run_argv`` under a ``/bin/sh`` wrapper in its own session
that first joins a throwaway cgroup, as the agent's spawn wrapper does."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import time
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from lattice_agent.oci import OciError, OciStore, container_name, parse_ref
from lattice_cli.devcluster import free_port
from lattice_test_harness.oci_registry import (
    LocalRegistry,
    build_image,
    registry_digest,
    skip_unless_oci,
)

skip_unless_oci()

pytestmark = pytest.mark.timeout(120)

USER = (1000, 1000)
# as spawn.py's wrapper: catch SIGTERM (so it records the status), join the cgroup, run
WRAPPER = 'trap : TERM; echo $$ > "$1" || exit 125; shift; "$@"; exit $?'


class Clock:
    """Deterministic last-use times: every call is 10 s later."""

    def __init__(self) -> None:
        self.now = 1_000_000.0

    def __call__(self) -> float:
        self.now += 10.0
        return self.now


@pytest.fixture(scope="module")
def registry() -> Iterator[LocalRegistry]:
    with LocalRegistry() as reg:
        yield reg


@pytest.fixture(scope="module")
def images(registry: LocalRegistry) -> dict[str, str]:
    return {
        "busy": build_image(
            registry, "lattice/busy", "1", {"/etc/greeting": "hello from the image\n"}
        ),
        "other": build_image(registry, "lattice/other", "1", {"/etc/greeting": "other\n"}),
        "big": build_image(registry, "lattice/other", "2", {"/opt/big": os.urandom(300_000)}),
        "entry": build_image(
            registry,
            "lattice/entry",
            "1",
            {"/usr/bin/hello": '#!/bin/sh\necho entrypoint "$@" $GREETING\n'},
            entrypoint=["/usr/bin/hello", "from"],
            env={"GREETING": "image-env"},
        ),
    }


@pytest.fixture
def store(tmp_path: Path) -> Iterator[OciStore]:
    s = OciStore(tmp_path / "cache", state_root=tmp_path / "crun", clock=Clock())
    yield s
    with contextlib.suppress(FileNotFoundError):
        for bundle in (s.dir / "bundles").iterdir():
            with contextlib.suppress(OciError):
                s.cleanup(bundle.name)


@pytest.fixture
def workdir(tmp_path: Path) -> Path:
    """The job's working directory, owned by the job's user (as the agent creates it)."""
    work = tmp_path / "work"
    work.mkdir()
    os.chown(work, *USER)
    return work


@contextlib.contextmanager
def throwaway_cgroup() -> Iterator[Path]:
    """A fresh pids cgroup (v1 here; the v2 root on a v2 host); emptied and removed after."""
    v1 = Path("/sys/fs/cgroup/pids")
    parent = v1 if (v1 / "cgroup.procs").exists() else Path("/sys/fs/cgroup")
    cg = parent / f"lattice-oci-test-{uuid.uuid4().hex[:8]}"
    cg.mkdir()
    try:
        yield cg
    finally:
        for pid in cgroup_pids(cg):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        wait_for(lambda: not cgroup_pids(cg), "the throwaway cgroup to empty")
        cg.rmdir()


def cgroup_pids(cg: Path) -> set[int]:
    return {int(p) for p in (cg / "cgroup.procs").read_text().split()}


def wait_for(cond, what: str, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


def start(store: OciStore, alloc_id: str, bundle: Path, cg: Path, log: Path) -> subprocess.Popen:
    """The container as the agent starts it: a wrapper in its own session joins the cgroup,
    then runs the launch argv (crun in the foreground, as its child)."""
    with open(log, "wb") as out:
        return subprocess.Popen(
            [
                "/bin/sh",
                "-c",
                WRAPPER,
                "wrapper",
                str(cg / "cgroup.procs"),
                *store.run_argv(alloc_id, bundle),
            ],
            start_new_session=True,
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
        )


def run(store: OciStore, alloc_id: str, bundle: Path, tmp_path: Path) -> tuple[int, str]:
    with throwaway_cgroup() as cg:
        log = tmp_path / f"{alloc_id}.log"
        proc = start(store, alloc_id, bundle, cg, log)
        rc = proc.wait(timeout=60)
    return rc, log.read_text()


def kv(output: str) -> dict[str, str]:
    return dict(line.split("=", 1) for line in output.splitlines() if "=" in line)


# ---------------------------------------------------------------------- references


def test_parse_ref() -> None:
    ref = parse_ref("127.0.0.1:5000/lattice/busy:1")
    assert (ref.name, ref.tag, ref.digest, ref.registry) == (
        "127.0.0.1:5000/lattice/busy",
        "1",
        None,
        "127.0.0.1:5000",
    )
    assert ref.hostname == "127.0.0.1"
    assert parse_ref("ubuntu:22.04").registry == "docker.io"
    assert parse_ref("nvcr.io/nvidia/pytorch:24.01-py3").registry == "nvcr.io"
    digest = "sha256:" + "a" * 64
    assert parse_ref(f"localhost:5000/x@{digest}").digest == digest
    assert container_name("a1b2") == "lattice-a1b2"


@pytest.mark.parametrize(
    "ref",
    [
        "",
        "lattice/busy:1; rm -rf /",
        "$(id)/x:1",
        "lattice/busy:1`id`",
        "../etc/passwd",
        "lattice/../busy:1",
        "lattice/busy:1 extra",
        "-oProxyCommand=x",
        "lattice/busy@sha256:1234",
        "Lattice/Busy:1",
    ],
)
def test_invalid_refs_are_refused_before_any_tool_runs(store: OciStore, ref: str) -> None:
    with pytest.raises(OciError, match="not a valid image reference"):
        store.pull(ref)
    assert not store.dir.exists()


# ---------------------------------------------------------------------- pull and cache


def test_pull_records_the_registrys_digest_and_the_second_pull_is_a_cache_hit(
    store: OciStore, registry: LocalRegistry, images: dict[str, str]
) -> None:
    ref = images["busy"]
    image = store.pull(ref)
    assert image.digest == registry_digest(registry, "lattice/busy", "1")
    assert image.digest.startswith("sha256:") and len(image.digest) == 71
    assert (image.rootfs / "etc" / "greeting").read_text() == "hello from the image\n"
    assert (image.rootfs / "bin" / "busybox").is_file()
    assert "PATH=/usr/bin:/bin" in image.config["Env"]
    layouts = store.dir / "layouts"
    assert os.listdir(layouts) == [image.digest.split(":")[1]]
    inodes = (store.layout_path(image.digest).stat().st_ino, image.rootfs.stat().st_ino)

    started = time.monotonic()
    again = store.pull(ref)
    elapsed = time.monotonic() - started
    assert again == image
    assert elapsed < 1.0, f"cached pull took {elapsed:.2f} s"
    assert os.listdir(layouts) == [image.digest.split(":")[1]]
    assert (store.layout_path(image.digest).stat().st_ino, image.rootfs.stat().st_ino) == inodes
    assert not list((store.dir / "tmp").iterdir())

    # by digest: no registry round trip needed, same cache entry
    by_digest = f"{registry.host}/lattice/busy@{image.digest}"
    assert store.pull(by_digest).rootfs == image.rootfs
    [entry] = store.status()
    assert entry["digest"] == image.digest
    assert entry["refs"] == [ref, by_digest]
    assert entry["size"] > 1_000_000  # busybox
    assert entry["pinned"] is False


def test_layer_blobs_are_dropped_after_unpacking(store: OciStore, images: dict[str, str]) -> None:
    image = store.pull(images["big"])
    blobs = list((store.layout_path(image.digest) / "blobs" / "sha256").iterdir())
    assert len(blobs) == 2  # manifest and config only
    assert all(b.stat().st_size < 10_000 for b in blobs)
    assert (image.rootfs / "opt" / "big").stat().st_size == 300_000


def test_concurrent_pulls_of_one_image_share_one_cache_entry(
    tmp_path: Path, images: dict[str, str]
) -> None:
    # two stores on one directory: as two threads of one agent, or two agents
    stores = [OciStore(tmp_path / "cache"), OciStore(tmp_path / "cache")]
    with ThreadPoolExecutor(6) as pool:
        pulled = list(pool.map(lambda i: stores[i % 2].pull(images["other"]), range(6)))
    assert len({p.digest for p in pulled}) == 1
    assert (pulled[0].rootfs / "etc" / "greeting").read_text() == "other\n"
    assert len(os.listdir(tmp_path / "cache" / "layouts")) == 1
    assert len(os.listdir(tmp_path / "cache" / "rootfs")) == 1
    assert not list((tmp_path / "cache" / "tmp").iterdir())


def test_unknown_images_fail_with_a_clear_cause(store: OciStore, registry: LocalRegistry) -> None:
    ref = f"{registry.host}/lattice/busy:nope"
    with pytest.raises(OciError) as err:
        store.pull(ref)
    assert str(err.value) == f"image {ref}: not found in registry (manifest unknown)"

    with pytest.raises(OciError, match=r"not found in registry \(manifest unknown\)"):
        store.pull(f"{registry.host}/lattice/nothere:1")
    tampered = f"{registry.host}/lattice/busy@sha256:{'0' * 64}"
    with pytest.raises(OciError, match=r"not found in registry \(manifest unknown\)"):
        store.pull(tampered)
    assert store.status() == []


def test_unreachable_and_plain_http_registries(
    tmp_path: Path, store: OciStore, images: dict[str, str]
) -> None:
    port = free_port()  # nothing listens there
    with pytest.raises(OciError, match=rf"registry 127.0.0.1:{port} unreachable"):
        store.pull(f"127.0.0.1:{port}/lattice/busy:1")
    strict = OciStore(tmp_path / "strict", insecure=())
    with pytest.raises(OciError, match=r"speaks plain HTTP; list 127\.0\.0\.1 as insecure"):
        strict.pull(images["busy"])


# ---------------------------------------------------------------------- LRU and pins


def test_lru_eviction_never_removes_a_pinned_image(tmp_path: Path, images: dict[str, str]) -> None:
    store = OciStore(tmp_path / "cache", clock=Clock())
    busy = store.pull(images["busy"])
    other = store.pull(images["other"])
    big = store.pull(images["big"])
    store.pull(images["busy"])  # busy is now the most recently used
    store.pin("job-1", other.digest)  # other is the least recently used
    sizes = {e["digest"]: e["size"] for e in store.status()}
    assert [e["digest"] for e in store.status()] == [busy.digest, big.digest, other.digest]

    # room for two: the least recently used unpinned one (big) goes
    assert store.evict(sizes[busy.digest] + sizes[other.digest]) == [big.digest]
    assert not big.rootfs.exists() and not store.layout_path(big.digest).exists()
    # no room at all: everything unpinned goes, the pinned one stays
    assert store.evict(0) == [busy.digest]
    [entry] = OciStore(tmp_path / "cache").status()  # pins survive a restart
    assert (entry["digest"], entry["pinned"], entry["pinned_by"]) == (other.digest, True, ["job-1"])
    assert (other.rootfs / "etc" / "greeting").is_file()

    store.unpin("job-1")
    assert store.evict(0) == [other.digest]
    assert store.status() == []
    # evicted images come back on the next pull
    assert (store.pull(images["busy"]).rootfs / "bin" / "busybox").is_file()


def test_pull_can_pin_and_a_size_limit_evicts_on_pull(
    tmp_path: Path, images: dict[str, str]
) -> None:
    store = OciStore(tmp_path / "cache", max_bytes=1, clock=Clock())
    first = store.pull(images["busy"], pin_for="job-1")
    second = store.pull(images["other"])  # over the limit: only what is pinned or just pulled
    assert {e["digest"] for e in store.status()} == {first.digest, second.digest}
    store.pull(images["big"])
    assert second.digest not in {e["digest"] for e in store.status()}
    assert store.pins() == {"job-1": first.digest}


# ---------------------------------------------------------------------- bundles


def test_bundle_config(
    store: OciStore, images: dict[str, str], workdir: Path, tmp_path: Path
) -> None:
    image = store.pull(images["busy"])
    data = tmp_path / "data"
    data.mkdir()
    bundle = store.bundle(
        "job-1",
        image,
        argv=["/bin/sh", "-c", "true"],
        env={"FOO": "1", "PATH": "/custom"},
        cwd=str(workdir),
        uid=1000,
        gid=1000,
        binds=[(str(data), "/data", True)],
    )
    assert bundle == store.dir / "bundles" / "job-1"
    assert (bundle / "lower").resolve() == image.rootfs
    spec = json.loads((bundle / "config.json").read_text())
    assert spec["root"] == {"path": "rootfs", "readonly": True}
    process = spec["process"]
    assert process["user"]["uid"] == 1000 and process["user"]["gid"] == 1000
    assert process["noNewPrivileges"] is True and process["terminal"] is False
    assert process["cwd"] == str(workdir)
    assert process["args"][-3:] == ["/bin/sh", "-c", "true"]
    assert [e for e in process["env"] if e.startswith("PATH=")] == ["PATH=/custom"]
    assert "FOO=1" in process["env"]
    assert all(caps == [] for caps in process["capabilities"].values())
    assert {n["type"] for n in spec["linux"]["namespaces"]} == {"pid", "ipc", "uts", "mount"}
    seccomp = spec["linux"]["seccomp"]
    assert seccomp["defaultAction"] == "SCMP_ACT_ALLOW"
    denied = set(seccomp["syscalls"][0]["names"])
    assert {
        "mount",
        "unshare",
        "setns",
        "ptrace",
        "bpf",
        "kexec_load",
        "open_by_handle_at",
    } <= denied
    mounts = {m["destination"]: m for m in spec["mounts"]}
    assert mounts[str(workdir)]["options"][2] == "rw"
    assert mounts["/data"]["options"][2] == "ro"
    assert mounts["/tmp"]["type"] == "tmpfs"
    assert "ro" in mounts["/etc/hosts"]["options"]
    assert "/proc/kcore" in spec["linux"]["maskedPaths"]
    assert {d["path"] for d in spec["linux"]["devices"]} >= {
        "/dev/null",
        "/dev/urandom",
        "/dev/tty",
    }

    root = store.bundle("job-2", image, argv=["true"], env={}, cwd=str(workdir), uid=0, gid=0)
    caps = json.loads((root / "config.json").read_text())["process"]["capabilities"]
    assert "CAP_CHOWN" in caps["effective"]
    assert not {"CAP_SYS_ADMIN", "CAP_NET_RAW", "CAP_MKNOD"} & set(caps["bounding"])


def test_bundle_refuses_bad_input(store: OciStore, images: dict[str, str], workdir: Path) -> None:
    image = store.pull(images["busy"])
    common = {"env": {}, "cwd": str(workdir), "uid": 1000, "gid": 1000}
    with pytest.raises(OciError, match="defines no command"):
        store.bundle("job-1", image, argv=[], **common)
    with pytest.raises(OciError, match="does not exist on this node"):
        store.bundle(
            "job-1", image, argv=["true"], binds=[("/no/such/dir", "/data", True)], **common
        )
    with pytest.raises(OciError, match=r"without '\.\.'"):
        store.bundle(
            "job-1", image, argv=["true"], binds=[(str(workdir), "/data/../etc", False)], **common
        )
    with pytest.raises(OciError, match="not usable for a container"):
        store.bundle("../x", image, argv=["true"], **common)


# ---------------------------------------------------------------------- containers


def test_container_runs_confined_as_the_user(
    store: OciStore, images: dict[str, str], workdir: Path, tmp_path: Path
) -> None:
    image = store.pull(images["busy"])
    data = tmp_path / "data"
    data.mkdir()
    (data / "input").write_text("dataset\n")
    script = """
        echo uid=$(id -u)
        echo gid=$(id -g)
        touch /probe 2>/dev/null && echo root=rw || echo root=ro
        touch /tmp/probe && echo tmp=rw
        touch ./probe && echo cwd=rw
        touch /data/probe 2>/dev/null && echo data=rw || echo data=ro
        echo input=$(cat /data/input)
        echo nnp=$(grep '^NoNewPrivs:' /proc/self/status | tr -dc 0-9)
        echo seccomp=$(grep '^Seccomp:' /proc/self/status | tr -dc 0-9)
        unshare -U true 2>/dev/null; echo unshare=$?
        mount -t tmpfs x /mnt 2>/dev/null; echo mount=$?
        echo net=$(ls /sys/class/net)
        echo greeting=$(cat /etc/greeting)
        echo env=$FOO
        echo pid1=$(tr '\\0' ' ' < /proc/1/cmdline)
    """
    bundle = store.bundle(
        "job-1",
        image,
        argv=["/bin/sh", "-c", script],
        env={"FOO": "from-the-allocation"},
        cwd=str(workdir),
        uid=USER[0],
        gid=USER[1],
        binds=[(str(data), "/data", True)],
    )
    rc, output = run(store, "job-1", bundle, tmp_path)
    assert rc == 0, output
    out = kv(output)
    assert (out["uid"], out["gid"]) == ("1000", "1000")
    assert (out["root"], out["tmp"], out["cwd"], out["data"]) == ("ro", "rw", "rw", "ro")
    assert (workdir / "probe").stat().st_uid == 1000  # written through the bind
    assert out["input"] == "dataset"
    assert (out["nnp"], out["seccomp"]) == ("1", "2")
    assert out["unshare"] != "0" and out["mount"] != "0"
    assert out["net"].split() == sorted(os.listdir("/sys/class/net"))  # the host's netns
    assert out["greeting"] == "hello from the image"
    assert out["env"] == "from-the-allocation"
    assert out["pid1"].startswith("/run/lattice-init -g -p SIGKILL -- /bin/sh -c")
    assert "unknown seccomp syscall" not in output
    assert not (image.rootfs / "probe").exists()
    assert not (image.rootfs / workdir.relative_to("/")).exists()  # mount points: in the overlay

    # control: without the seccomp profile the same user may create a user namespace, so the
    # failure above is the profile's doing (hosts that forbid unprivileged ones: skipped)
    if Path("/proc/sys/user/max_user_namespaces").read_text().strip() != "0":
        spec = json.loads((bundle / "config.json").read_text())
        del spec["linux"]["seccomp"]
        (bundle / "config.json").write_text(json.dumps(spec))
        rc, output = run(store, "job-1", bundle, tmp_path)
        assert (rc, kv(output)["seccomp"], kv(output)["unshare"]) == (0, "0", "0"), output


def test_root_container_and_image_entrypoint(
    store: OciStore, images: dict[str, str], workdir: Path, tmp_path: Path
) -> None:
    image = store.pull(images["entry"])
    assert image.config["Entrypoint"] == ["/usr/bin/hello", "from"]
    bundle = store.bundle("job-ep", image, argv=[], env={}, cwd=str(workdir), uid=1000, gid=1000)
    rc, output = run(store, "job-ep", bundle, tmp_path)
    assert (rc, output.strip()) == (0, "entrypoint from image-env")

    script = "id -u; mount -t tmpfs x /mnt 2>/dev/null; echo mount=$?; exit 7"
    bundle = store.bundle(
        "job-root", image, argv=["/bin/sh", "-c", script], env={}, cwd=str(workdir), uid=0, gid=0
    )
    rc, output = run(store, "job-root", bundle, tmp_path)
    assert rc == 7, output  # the job's exit status comes through tini and crun
    assert output.splitlines()[0] == "0" and kv(output)["mount"] != "0"


def container_pids(store: OciStore, alloc_id: str) -> set[int]:
    """Host pids of the processes in the container's pid namespace."""
    state = store.state(alloc_id)
    assert state is not None
    ns = os.readlink(f"/proc/{state['pid']}/ns/pid")
    pids = set()
    for entry in os.listdir("/proc"):
        with contextlib.suppress(OSError):
            if entry.isdigit() and os.readlink(f"/proc/{entry}/ns/pid") == ns:
                pids.add(int(entry))
    return pids


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL])
def test_container_stays_in_the_wrappers_cgroup_and_ends_with_its_group(
    store: OciStore, images: dict[str, str], workdir: Path, tmp_path: Path, sig: signal.Signals
) -> None:
    image = store.pull(images["busy"], pin_for="job-1")
    script = "sleep 300 & touch ./started; wait"
    bundle = store.bundle(
        "job-1",
        image,
        argv=["/bin/sh", "-c", script],
        env={},
        cwd=str(workdir),
        uid=USER[0],
        gid=USER[1],
    )
    with throwaway_cgroup() as cg:
        proc = start(store, "job-1", bundle, cg, tmp_path / "job.log")
        wait_for(lambda: (workdir / "started").exists(), "the container to start")
        assert store.running("job-1")
        inside = container_pids(store, "job-1")
        assert len(inside) == 3  # tini, sh, sleep
        assert inside <= cgroup_pids(cg), "container processes left the allocation's cgroup"
        assert store.state("job-1")["pid"] in cgroup_pids(cg)

        os.killpg(proc.pid, sig)  # what the agent does to an allocation
        rc = proc.wait(timeout=15)
        # SIGTERM: tini passes it to the job, which dies of it (143 through tini, crun and
        # the wrapper); SIGKILL: crun dies and tini follows it (its parent-death signal)
        assert rc == (128 + 15 if sig == signal.SIGTERM else -signal.SIGKILL), rc
        wait_for(lambda: not cgroup_pids(cg), "the container's processes to end", timeout=5)
    assert not store.running("job-1")

    store.cleanup("job-1")
    assert not (tmp_path / "crun" / container_name("job-1")).exists()
    assert not bundle.exists()
    assert store.pins() == {}
    store.cleanup("job-1")  # idempotent


def test_cleanup_when_nothing_exists(store: OciStore) -> None:
    assert not store.running("never-ran")
    assert store.state("never-ran") is None
    store.cleanup("never-ran")
    store.cleanup("never-ran")
