"""uenv SquashFS environments on a node: the image cache, and the views read from images.

* **Registry** (``node_agent.uenv_registry``): a directory or an ``http(s)://`` URL whose
  ``index.json`` maps ``name/version[:tag]`` to ``{"file", "sha256", "size",
  "signature"}`` (:mod:`lattice_common.uenv_registry`, shared with the API, which resolves
  the ref at submit and records the image's sha256 on the allocation). Empty = uenv
  disabled on this node: a job asking for one fails to start with :class:`UenvDisabled`.
  With ``node_agent.uenv_signing_key`` every entry must be signed by the site key.
* **Cache** (``node_agent.uenv_cache_dir``, ``uenv_cache_max_bytes``): images are copied
  (or downloaded, streamed) in as ``<sha256>.sqfs`` while their SHA-256 is computed; a
  mismatch with the index is refused (:class:`UenvHashMismatch`) and the copy removed, so
  only verified content is ever named by its hash (a cache hit is not re-hashed; its
  index entry, and signature, are checked on every use). Every use sets the file's access
  time; above the size limit the least recently used images are removed, never one that
  is pinned.
* **Pins**: ``acquire(ref, alloc_id)`` pins the image for an allocation as a file
  ``<cache>/pins/<alloc_id>`` (so the pin outlives an agent restart); ``release(alloc_id)``
  removes it when the allocation has been reaped.
* **Views**: ``view(image, ref, name)`` reads ``meta/env.json`` out of the cached image
  (``unsquashfs -cat``, nothing mounted on the host), once per sha256.

Mounting is done by the allocation's wrapper (``lattice_agent.spawn``) inside a private
mount namespace: only the job's processes see the image, and the mount disappears with
the last of them (nothing to unmount on the host).
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import http.client
import logging
import os
import shutil
import subprocess
import tempfile
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

from lattice_common.uenv_registry import (
    UenvChanged,
    UenvDisabled,
    UenvError,
    UenvHashMismatch,
    UenvImage,
    UenvNotFound,
    UenvRegistry,
    UenvSignatureError,
    UenvUnreachable,
    UenvView,
    find_view,
    parse_ref,
    parse_views,
)

__all__ = [
    "DEFAULT_MOUNT_POINT",
    "CacheEntry",
    "UenvCache",
    "UenvChanged",
    "UenvDisabled",
    "UenvError",
    "UenvHashMismatch",
    "UenvImage",
    "UenvInUse",
    "UenvNotFound",
    "UenvRegistry",
    "UenvSignatureError",
    "UenvUnreachable",
    "UenvView",
    "parse_ref",
    "read_env_json",
]

log = logging.getLogger(__name__)

DEFAULT_MOUNT_POINT = "/user-environment"
ENV_JSON = "meta/env.json"
_CHUNK = 1 << 20
_UNSQUASHFS_TIMEOUT = 60.0


@functools.cache
def _unsquashfs() -> tuple[str, bool] | None:
    """(path, whether it has ``-cat``: squashfs-tools 4.5 and later) or None."""
    tool = shutil.which("unsquashfs", path="/usr/sbin:/usr/bin:/sbin:/bin")
    tool = tool or shutil.which("unsquashfs")
    if tool is None:
        return None
    try:
        r = subprocess.run([tool, "-help"], capture_output=True, timeout=_UNSQUASHFS_TIMEOUT)
    except (OSError, subprocess.TimeoutExpired):
        return tool, False
    return tool, b"-cat" in r.stdout + r.stderr


def read_env_json(image: Path, ref: str) -> bytes | None:
    """``meta/env.json`` of a SquashFS image (None when it has none), read with
    ``unsquashfs`` so nothing is mounted on the host; squashfs-tools without ``-cat``
    extract it into a temporary directory instead."""
    found = _unsquashfs()
    if found is None:
        raise UenvError(
            f"uenv {ref}: cannot read its views: unsquashfs (squashfs-tools) not found",
            hint="Install squashfs-tools on the node.",
        )
    tool, has_cat = found
    try:
        if has_cat:
            r = subprocess.run(
                [tool, "-cat", str(image), ENV_JSON],
                capture_output=True,
                timeout=_UNSQUASHFS_TIMEOUT,
            )
            if r.returncode == 0:
                return r.stdout
            err = r.stderr.decode(errors="replace").strip()
            if "no matches" in err:
                return None
            raise UenvError(f"uenv {ref}: cannot read {ENV_JSON}: {err[-300:]}")
        with tempfile.TemporaryDirectory(prefix="lattice-uenv-") as tmp:
            r = subprocess.run(
                [tool, "-no-progress", "-d", f"{tmp}/x", str(image), ENV_JSON],
                capture_output=True,
                timeout=_UNSQUASHFS_TIMEOUT,
            )
            out = Path(tmp, "x", ENV_JSON)
            if out.is_file():
                return out.read_bytes()
            if r.returncode != 0:
                err = r.stderr.decode(errors="replace").strip()
                raise UenvError(f"uenv {ref}: cannot read {ENV_JSON}: {err[-300:]}")
            return None
    except subprocess.TimeoutExpired:
        raise UenvError(
            f"uenv {ref}: reading {ENV_JSON} took over {_UNSQUASHFS_TIMEOUT:.0f}s"
        ) from None
    except OSError as e:
        raise UenvError(f"uenv {ref}: cannot read {ENV_JSON}: {e}") from None


class UenvInUse(UenvError):
    """An image cannot be removed: allocations on the node use it (``allocations``)."""

    def __init__(self, message: str, *, hint: str = "", allocations: tuple[str, ...] = ()) -> None:
        super().__init__(message, hint=hint)
        self.allocations = allocations


@dataclass(frozen=True)
class CacheEntry:
    sha256: str
    ref: str
    path: Path
    size: int
    last_access: float
    in_use: bool


class UenvCache:
    """The node-local cache in front of a registry (``registry=None``: uenv disabled)."""

    def __init__(
        self,
        registry: UenvRegistry | None,
        cache_dir: Path | str,
        max_bytes: int,
        *,
        mount_point: str = DEFAULT_MOUNT_POINT,
        clock=time.time,
    ) -> None:
        self.registry = registry
        self.dir = Path(cache_dir)
        self.max_bytes = int(max_bytes)
        self.mount_point = mount_point
        self._clock = clock
        self._views: dict[str, dict[str, UenvView]] = {}  # by sha256

    @property
    def enabled(self) -> bool:
        return self.registry is not None

    @property
    def _pins(self) -> Path:
        return self.dir / "pins"

    # ------------------------------------------------------------------ fetch

    def fetch(self, ref: str, *, sha256: str = "") -> Path:
        """The cached image for ``ref`` (copied and verified first when not cached).
        ``sha256``: what the API resolved at submit (``Allocation.uenv_sha256``): exactly
        that image or, if the registry names another one for ``ref`` now, a refusal."""
        if self.registry is None:
            raise UenvDisabled(
                f"uenv {ref}: uenv is not enabled on this node (node_agent.uenv_registry is empty)",
                hint="Configure node_agent.uenv_registry on every node, as on the API.",
            )
        image = self.registry.resolve(ref)
        if sha256 and image.sha256 != sha256.lower():
            raise UenvChanged(
                f"uenv {ref} changed in the registry since submit "
                f"(submitted: sha256 {sha256[:12]}, now: {image.sha256[:12]})",
                hint="Resubmit to run the image the registry names now.",
            )
        self.dir.mkdir(parents=True, exist_ok=True)
        target = self.dir / f"{image.sha256}.sqfs"
        if not target.is_file():
            self._copy_verified(image, target)
            (self.dir / f"{image.sha256}.ref").write_text(image.ref + "\n")
        self._touch(target)
        self.evict(keep={target.name})
        return target

    def acquire(self, ref: str, alloc_id: str, *, sha256: str = "") -> Path:
        """:meth:`fetch` and pin the image for ``alloc_id`` (not evicted until released)."""
        path = self.fetch(ref, sha256=sha256)
        self._pins.mkdir(parents=True, exist_ok=True)
        (self._pins / alloc_id).write_text(path.name)
        return path

    def release(self, alloc_id: str) -> None:
        if self.registry is None:
            return  # disabled: nothing was ever pinned
        with contextlib.suppress(OSError):
            (self._pins / alloc_id).unlink()

    def view(self, image: Path, ref: str, name: str) -> UenvView:
        """The view ``name`` of the cached ``image`` (``meta/env.json``, read once per
        sha256: a cached file never changes); an unknown view names the ones there are."""
        sha = image.stem
        views = self._views.get(sha)
        if views is None:
            raw = read_env_json(image, ref)
            views = parse_views(raw, ref) if raw is not None else {}
            self._views[sha] = views
        return find_view(views, ref, name)

    def _copy_verified(self, image: UenvImage, target: Path) -> None:
        assert self.registry is not None
        # one temporary file per copy: a warm and a prologue may fetch the same image at once
        tmp = target.with_name(f".{target.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp")
        digest = hashlib.sha256()
        try:
            with self.registry.open_image(image) as src, open(tmp, "wb") as dst:
                while chunk := src.read(_CHUNK):
                    digest.update(chunk)
                    dst.write(chunk)
        except UenvError:
            tmp.unlink(missing_ok=True)
            raise
        except (OSError, http.client.HTTPException) as e:  # a download cut off, a full disk
            tmp.unlink(missing_ok=True)
            raise UenvError(
                f"uenv {image.ref}: could not copy {image.location}: {e or type(e).__name__}"
            ) from e
        got = digest.hexdigest()
        if got != image.sha256:
            tmp.unlink(missing_ok=True)
            raise UenvHashMismatch(
                f"uenv {image.ref}: image hash mismatch (expected {image.sha256}, got {got})",
                hint="The registry's file does not match its index; ask its operators.",
            )
        os.chmod(tmp, 0o444)
        os.replace(tmp, target)
        log.info("uenv %s cached as %s", image.ref, target)

    def _touch(self, path: Path) -> None:
        st = path.stat()
        os.utime(path, (self._clock(), st.st_mtime))

    # ------------------------------------------------------------------ eviction, status

    def in_use(self) -> set[str]:
        """File names of pinned images."""
        out = set()
        with contextlib.suppress(OSError):
            for pin in self._pins.iterdir():
                with contextlib.suppress(OSError):
                    out.add(pin.read_text().strip())
        return out

    def entries(self) -> list[CacheEntry]:
        used = self.in_use()
        out = []
        with contextlib.suppress(FileNotFoundError):
            for p in self.dir.glob("*.sqfs"):
                try:
                    st = p.stat()
                except OSError:
                    continue
                try:
                    ref = p.with_suffix(".ref").read_text().strip()
                except OSError:
                    ref = ""
                out.append(
                    CacheEntry(
                        sha256=p.stem,
                        ref=ref,
                        path=p,
                        size=st.st_size,
                        last_access=st.st_atime,
                        in_use=p.name in used,
                    )
                )
        out.sort(key=lambda e: e.last_access)
        return out

    def evict(self, keep: set[str] = frozenset()) -> list[CacheEntry]:  # type: ignore[assignment]
        """Remove least recently used images until the cache fits ``max_bytes``; pinned
        images and those named in ``keep`` stay. Returns what was removed."""
        entries = self.entries()
        total = sum(e.size for e in entries)
        removed = []
        for e in entries:
            if total <= self.max_bytes:
                break
            if e.in_use or e.path.name in keep:
                continue
            with contextlib.suppress(FileNotFoundError):
                e.path.unlink()
            with contextlib.suppress(FileNotFoundError):
                e.path.with_suffix(".ref").unlink()
            total -= e.size
            removed.append(e)
            log.info("uenv cache: evicted %s (%s, %d bytes)", e.ref or e.sha256, e.path, e.size)
        if total > self.max_bytes:
            log.warning(
                "uenv cache %s: %d bytes in use or just fetched, above the %d byte limit",
                self.dir,
                total,
                self.max_bytes,
            )
        return removed

    def remove(self, ref: str) -> list[CacheEntry]:
        """Remove the cached image(s) of ``ref`` (``lattice cache evict``): the registry key
        they were fetched as (as :meth:`status` shows it; untagged, the only cached tag of
        that name/version) or an image's sha256. Several when the registry re-published
        the ref. :class:`UenvNotFound` when none is cached; :class:`UenvInUse`, with
        nothing removed, while an allocation pins one of them."""
        want = ref.strip()
        entries = self.entries()
        found = [e for e in entries if want and want in (e.ref, e.sha256)]
        if not found and want and ":" not in want:
            found = [e for e in entries if e.ref.split(":", 1)[0] == want]
            if len({e.ref for e in found}) > 1:
                refs = ", ".join(sorted({e.ref for e in found}))
                raise UenvNotFound(
                    f"uenv {want}: several tags are cached ({refs})",
                    hint="Name one with its tag, e.g. --image=" + sorted({e.ref for e in found})[0],
                )
        if not found:
            cached = ", ".join(sorted({e.ref or e.sha256 for e in entries})) or "none"
            raise UenvNotFound(
                f"uenv {want} is not cached on this node (cached: {cached})",
                hint="See what each node caches with `lattice cache status`.",
            )
        users: dict[str, set[str]] = {}
        with contextlib.suppress(OSError):
            for pin in self._pins.iterdir():
                with contextlib.suppress(OSError):
                    users.setdefault(pin.read_text().strip(), set()).add(pin.name)
        busy = sorted(set().union(*(users.get(e.path.name, set()) for e in found)))
        if busy:
            raise UenvInUse(
                f"image {want} is in use by allocation(s) {', '.join(busy)}",
                hint="It can be evicted once they end; `lattice status ID` shows them.",
                allocations=tuple(busy),
            )
        for e in found:
            with contextlib.suppress(FileNotFoundError):
                e.path.unlink()
            with contextlib.suppress(FileNotFoundError):
                e.path.with_suffix(".ref").unlink()
            log.info("uenv cache: removed %s (%s, %d bytes)", e.ref or e.sha256, e.path, e.size)
        return found

    def status(self) -> dict[str, object]:
        entries = self.entries()
        return {
            "enabled": self.enabled,
            "cache_dir": str(self.dir),
            "max_bytes": self.max_bytes,
            "used_bytes": sum(e.size for e in entries),
            "images": [
                {
                    "ref": e.ref,
                    "sha256": e.sha256,
                    "size": e.size,
                    "last_access": e.last_access,
                    "in_use": e.in_use,
                }
                for e in reversed(entries)
            ],
        }
