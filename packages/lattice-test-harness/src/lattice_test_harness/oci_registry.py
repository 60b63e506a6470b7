"""A real local OCI registry and tiny images for container tests, without any network.

* :class:`LocalRegistry` runs Debian's ``docker-registry`` (distribution 2.8) on
  127.0.0.1:<free port> with its storage in a temporary directory.
* :func:`build_image` builds an image from the host's statically linked busybox (package
  ``busybox-static``) plus the given files with umoci, and pushes it there with skopeo.
* :func:`skip_unless_oci` skips a test module when a tool is missing (CI installs them all
  through ``scripts/test``, so nothing is skipped there).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from lattice_cli.devcluster import free_port

__all__ = [
    "BUSYBOX",
    "LocalRegistry",
    "build_image",
    "missing_oci_tools",
    "registry_digest",
    "skip_unless_oci",
]

REGISTRY_BIN = "/usr/bin/docker-registry"
BUSYBOX = "/bin/busybox"
TINI = "/usr/bin/tini-static"
_TOOLS = ("crun", "skopeo", "umoci", "unshare", "mount")
# busybox applets the test images get (symlinks in /bin)
_APPLETS = (
    "sh", "cat", "echo", "env", "false", "grep", "head", "hostname", "id", "kill", "ls",
    "mkdir", "mount", "ps", "pwd", "rm", "sleep", "stat", "tail", "test", "touch", "tr",
    "true", "umount", "unshare", "wc", "[",
)  # fmt: skip
_MANIFEST_TYPES = (
    "application/vnd.oci.image.manifest.v1+json",
    "application/vnd.docker.distribution.manifest.v2+json",
    "application/vnd.oci.image.index.v1+json",
    "application/vnd.docker.distribution.manifest.list.v2+json",
)


def missing_oci_tools() -> list[str]:
    """What the container tests need and this machine lacks (Debian package names)."""
    missing = [
        f"{tool} ({package})"
        for tool, package in (
            ("crun", "crun"),
            ("skopeo", "skopeo"),
            ("umoci", "umoci"),
            ("unshare", "util-linux"),
            ("mount", "mount"),
        )
        if shutil.which(tool) is None
    ]
    for path, package in (
        (REGISTRY_BIN, "docker-registry"),
        (BUSYBOX, "busybox-static"),
        (TINI, "tini"),
    ):
        if not os.access(path, os.X_OK):
            missing.append(f"{path} ({package})")
    return missing


def skip_unless_oci() -> None:
    """Skip the calling test (or module, at import) unless OCI containers can run here."""
    missing = missing_oci_tools()
    if missing:
        pytest.skip(
            "OCI container tests need " + ", ".join(missing) + " (scripts/test installs them)",
            allow_module_level=True,
        )
    if os.geteuid() != 0:
        pytest.skip("OCI container tests run crun and umoci as root", allow_module_level=True)


class LocalRegistry:
    """``with LocalRegistry() as reg:`` a registry at ``reg.host`` (127.0.0.1:PORT, plain
    HTTP) until the block ends; its storage is removed afterwards."""

    def __init__(self, *, start_timeout: float = 20.0) -> None:
        self.start_timeout = start_timeout
        self.port = 0
        self._dir: Path | None = None
        self._proc: subprocess.Popen[bytes] | None = None

    @property
    def host(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def url(self) -> str:
        return f"http://{self.host}"

    def __enter__(self) -> LocalRegistry:
        self._dir = Path(tempfile.mkdtemp(prefix="lattice-registry-"))
        try:
            for _ in range(3):  # the free port can be taken before the registry binds it
                if self._start():
                    return self
            raise RuntimeError(f"docker-registry did not start: {self._log()}")
        except BaseException:
            self.__exit__()
            raise

    def __exit__(self, *exc: object) -> None:
        self._stop()
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)
            self._dir = None

    def _start(self) -> bool:
        assert self._dir is not None
        self._stop()
        self.port = free_port()
        config = self._dir / "config.yml"
        config.write_text(
            "version: 0.1\n"
            "log:\n  level: error\n  accesslog:\n    disabled: true\n"
            f"storage:\n  filesystem:\n    rootdirectory: {self._dir / 'data'}\n"
            "  delete:\n    enabled: true\n"
            f"http:\n  addr: {self.host}\n"
        )
        with open(self._dir / "registry.log", "ab") as out:
            self._proc = subprocess.Popen(
                [REGISTRY_BIN, "serve", str(config)],
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
            )
        deadline = time.monotonic() + self.start_timeout
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                return False
            with (
                contextlib.suppress(OSError, urllib.error.URLError),
                urllib.request.urlopen(f"{self.url}/v2/", timeout=2) as resp,
            ):
                if resp.status == 200:
                    return True
            time.sleep(0.05)
        return False

    def _stop(self) -> None:
        if self._proc is None:
            return
        if self._proc.poll() is None:
            self._proc.terminate()
            try:
                self._proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
        self._proc = None

    def _log(self) -> str:
        if self._dir is None:
            return ""
        with contextlib.suppress(OSError):
            return (self._dir / "registry.log").read_text(errors="replace")[-2000:]
        return ""


def registry_digest(registry: LocalRegistry, name: str, tag: str) -> str:
    """The registry's own digest for ``name:tag`` (its Docker-Content-Digest header)."""
    request = urllib.request.Request(
        f"{registry.url}/v2/{name}/manifests/{tag}",
        method="HEAD",
        headers={"Accept": ", ".join(_MANIFEST_TYPES)},
    )
    with urllib.request.urlopen(request, timeout=10) as resp:
        return resp.headers["Docker-Content-Digest"]


def _run(argv: list[str]) -> None:
    done = subprocess.run(argv, capture_output=True, text=True, timeout=120, check=False)
    if done.returncode != 0:
        raise RuntimeError(
            f"{' '.join(argv[:3])} failed ({done.returncode}): {done.stderr[-2000:]}"
        )


def _rootfs(root: Path, files: dict[str, bytes | str]) -> None:
    """busybox with its applets, the usual empty directories, then ``files``."""
    for sub in ("bin", "etc", "proc", "sys", "dev", "root", "mnt", "run", "home"):
        (root / sub).mkdir(parents=True, exist_ok=True)
    (root / "tmp").mkdir(mode=0o1777)
    os.chmod(root / "tmp", 0o1777)
    shutil.copy2(BUSYBOX, root / "bin" / "busybox")
    for applet in _APPLETS:
        (root / "bin" / applet).symlink_to("busybox")
    (root / "etc" / "passwd").write_text("root:x:0:0:root:/root:/bin/sh\n")
    (root / "etc" / "group").write_text("root:x:0:\n")
    for rel, content in files.items():
        path = root / rel.lstrip("/")
        path.parent.mkdir(parents=True, exist_ok=True)
        data = content.encode() if isinstance(content, str) else content
        path.write_bytes(data)
        os.chmod(path, 0o755 if data.startswith(b"#!") else 0o644)


def build_image(
    registry: LocalRegistry,
    name: str,
    tag: str,
    files: dict[str, bytes | str],
    *,
    entrypoint: list[str] | None = None,
    env: dict[str, str] | None = None,
    user: str | None = None,
) -> str:
    """Build a busybox image with ``files`` (path in the image -> content; "#!" = executable)
    and push it to ``registry`` as ``name:tag``. Returns the reference ``host/name:tag``."""
    ref = f"{registry.host}/{name}:{tag}"
    with tempfile.TemporaryDirectory(prefix="lattice-image-") as tmp:
        layout, root = f"{tmp}/layout", Path(tmp) / "root"
        _rootfs(root, files)
        image = f"{layout}:{tag}"
        _run(["umoci", "init", "--layout", layout])
        _run(["umoci", "new", "--image", image])
        _run(["umoci", "insert", "--image", image, str(root), "/"])
        config = ["umoci", "config", "--image", image, "--config.env", "PATH=/usr/bin:/bin"]
        for key, value in (env or {}).items():
            config += ["--config.env", f"{key}={value}"]
        for arg in entrypoint or []:
            config += ["--config.entrypoint", arg]
        if user is not None:
            config += ["--config.user", user]
        _run(config)
        _run(
            [
                "skopeo",
                "copy",
                "--quiet",
                "--dest-tls-verify=false",
                f"oci:{image}",
                f"docker://{ref}",
            ]
        )
    return ref
