"""uenv images for tests and benchmarks: real SquashFS files built with ``mksquashfs``
and the ``index.json`` entries of a directory registry (lattice_common.uenv_registry)."""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
from pathlib import Path
from typing import Any


def mount_support() -> str:
    """Why uenv images cannot be mounted here ("" when they can): building needs
    squashfs-tools, mounting needs root and util-linux's unshare."""
    if os.geteuid() != 0:
        return "needs root (loop mounts in a private mount namespace)"
    for tool in ("mksquashfs", "unshare", "mount"):
        if shutil.which(tool) is None:
            return f"{tool} is not installed"
    return ""


def build_squashfs(image: Path, files: dict[str, str | bytes]) -> Path:
    """A SquashFS ``image`` holding ``files`` (path inside the image -> content; a
    ``#!`` script is made executable), owned by root inside. Raises
    ``subprocess.CalledProcessError`` when mksquashfs fails."""
    src = image.with_name(image.name + ".src")
    for rel, content in files.items():
        path = src / rel.lstrip("/")
        path.parent.mkdir(parents=True, exist_ok=True)
        data = content.encode() if isinstance(content, str) else content
        path.write_bytes(data)
        if data.startswith(b"#!"):
            path.chmod(0o755)
    image.parent.mkdir(parents=True, exist_ok=True)
    subprocess.run(
        ["mksquashfs", str(src), str(image), "-quiet", "-noappend", "-all-root", "-no-progress"],
        check=True,
        capture_output=True,
    )
    shutil.rmtree(src)
    return image


def index_entry(image: Path, *, file: str | None = None, sha256: str = "") -> dict[str, Any]:
    """The registry entry of ``image`` (``sha256`` overrides the real one: a tampered
    entry)."""
    return {
        "file": file or image.name,
        "sha256": sha256 or hashlib.sha256(image.read_bytes()).hexdigest(),
        "size": image.stat().st_size,
    }


__all__ = ["build_squashfs", "index_entry", "mount_support"]
