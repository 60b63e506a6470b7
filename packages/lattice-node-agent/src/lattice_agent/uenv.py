"""uenv SquashFS environments: the registry index and the node-local image cache.

* **Registry** (``node_agent.uenv_registry``): a directory with ``index.json`` mapping
  ``name/version[:tag]`` to ``{"file": <path relative to the directory>, "sha256": <hex>,
  "size": <bytes>}``. Empty = uenv disabled on this node: a job asking for one fails to
  start with :class:`UenvDisabled`.
* **Cache** (``node_agent.uenv_cache_dir``, ``uenv_cache_max_bytes``): images are copied in
  as ``<sha256>.sqfs`` while their SHA-256 is computed; a mismatch with the index is refused
  (:class:`UenvHashMismatch`) and the copy removed, so only verified content is ever named
  by its hash (a cache hit is not re-hashed). Every use sets the file's access time; above
  the size limit the least recently used images are removed, never one that is pinned.
* **Pins**: ``acquire(ref, alloc_id)`` pins the image for an allocation as a file
  ``<cache>/pins/<alloc_id>`` (so the pin outlives an agent restart); ``release(alloc_id)``
  removes it when the allocation has been reaped.

Mounting is done by the allocation's wrapper (``lattice_agent.spawn``) inside a private
mount namespace: only the job's processes see the image, and the mount disappears with
the last of them (nothing to unmount on the host).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import re
import time
from dataclasses import dataclass
from pathlib import Path

__all__ = [
    "DEFAULT_MOUNT_POINT",
    "CacheEntry",
    "UenvCache",
    "UenvDisabled",
    "UenvError",
    "UenvHashMismatch",
    "UenvImage",
    "UenvNotFound",
    "UenvRegistry",
    "parse_ref",
]

log = logging.getLogger(__name__)

DEFAULT_MOUNT_POINT = "/user-environment"
_REF = re.compile(
    r"^([A-Za-z0-9][A-Za-z0-9._+-]*)/([A-Za-z0-9][A-Za-z0-9._+-]*)(?::([A-Za-z0-9._+-]+))?$"
)
_CHUNK = 1 << 20


class UenvError(Exception):
    """A uenv could not be resolved, fetched or mounted; the message is the user-facing cause."""


class UenvDisabled(UenvError):
    pass


class UenvNotFound(UenvError):
    pass


class UenvHashMismatch(UenvError):
    pass


def parse_ref(ref: str) -> tuple[str, str, str]:
    """``name/version[:tag]`` -> (name, version, tag or "")."""
    m = _REF.match(ref.strip())
    if m is None:
        raise UenvNotFound(f"uenv {ref}: not of the form name/version[:tag]")
    return m.group(1), m.group(2), m.group(3) or ""


@dataclass(frozen=True)
class UenvImage:
    """One index entry, resolved: the reference it answers, the file and what it must be."""

    ref: str
    path: Path
    sha256: str
    size: int


class UenvRegistry:
    """A directory registry: ``<root>/index.json`` (read on every resolve: images can be
    published while the agent runs)."""

    def __init__(self, root: Path | str) -> None:
        self.root = Path(root)

    def index(self) -> dict[str, dict[str, object]]:
        path = self.root / "index.json"
        try:
            data = json.loads(path.read_text())
        except FileNotFoundError:
            raise UenvError(f"uenv registry {self.root}: no index.json") from None
        except (OSError, ValueError) as e:
            raise UenvError(f"uenv registry {self.root}: unreadable index.json: {e}") from e
        if not isinstance(data, dict):
            raise UenvError(f"uenv registry {self.root}: index.json is not an object")
        return {str(k): v for k, v in data.items() if isinstance(v, dict)}

    def resolve(self, ref: str) -> UenvImage:
        """The entry for ``ref``: an exact key, or for a ref without tag the only tagged
        entry of that name/version. Otherwise :class:`UenvNotFound` naming what exists."""
        name, version, tag = parse_ref(ref)
        index = self.index()
        key = f"{name}/{version}" + (f":{tag}" if tag else "")
        entry = index.get(key)
        if entry is None and not tag:
            tagged = [k for k in index if k.startswith(f"{key}:")]
            if len(tagged) == 1:
                key = tagged[0]
                entry = index[key]
        if entry is None:
            same = sorted(k for k in index if k.split("/", 1)[0] == name)
            if same:
                raise UenvNotFound(f"uenv {ref}: not in the registry; available: {', '.join(same)}")
            names = sorted({k.split("/", 1)[0] for k in index})
            raise UenvNotFound(
                f"uenv {ref}: no uenv named {name!r} in the registry; "
                f"available: {', '.join(names) or 'none'}"
            )
        try:
            file = self.root / str(entry["file"])
            sha = str(entry["sha256"]).lower()
            size = int(entry.get("size", -1))  # type: ignore[call-overload]
        except (KeyError, TypeError, ValueError) as e:
            raise UenvError(f"uenv {ref}: bad registry entry {key!r}: {e}") from e
        if not re.fullmatch(r"[0-9a-f]{64}", sha):
            raise UenvError(f"uenv {ref}: bad sha256 in registry entry {key!r}")
        return UenvImage(ref=key, path=file, sha256=sha, size=size)


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

    @property
    def enabled(self) -> bool:
        return self.registry is not None

    @property
    def _pins(self) -> Path:
        return self.dir / "pins"

    # ------------------------------------------------------------------ fetch

    def fetch(self, ref: str) -> Path:
        """The cached image for ``ref`` (copied and verified first when not cached)."""
        if self.registry is None:
            raise UenvDisabled(
                f"uenv {ref}: uenv is not enabled on this node (node_agent.uenv_registry is empty)"
            )
        image = self.registry.resolve(ref)
        self.dir.mkdir(parents=True, exist_ok=True)
        target = self.dir / f"{image.sha256}.sqfs"
        if not target.is_file():
            self._copy_verified(image, target)
            (self.dir / f"{image.sha256}.ref").write_text(image.ref + "\n")
        self._touch(target)
        self.evict(keep={target.name})
        return target

    def acquire(self, ref: str, alloc_id: str) -> Path:
        """:meth:`fetch` and pin the image for ``alloc_id`` (not evicted until released)."""
        path = self.fetch(ref)
        self._pins.mkdir(parents=True, exist_ok=True)
        (self._pins / alloc_id).write_text(path.name)
        return path

    def release(self, alloc_id: str) -> None:
        if self.registry is None:
            return  # disabled: nothing was ever pinned
        with contextlib.suppress(OSError):
            (self._pins / alloc_id).unlink()

    def _copy_verified(self, image: UenvImage, target: Path) -> None:
        tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
        digest = hashlib.sha256()
        try:
            with open(image.path, "rb") as src, open(tmp, "wb") as dst:
                while chunk := src.read(_CHUNK):
                    digest.update(chunk)
                    dst.write(chunk)
        except FileNotFoundError:
            tmp.unlink(missing_ok=True)
            raise UenvError(f"uenv {image.ref}: image file {image.path} missing") from None
        except OSError as e:
            tmp.unlink(missing_ok=True)
            raise UenvError(f"uenv {image.ref}: could not copy {image.path}: {e}") from e
        got = digest.hexdigest()
        if got != image.sha256:
            tmp.unlink(missing_ok=True)
            raise UenvHashMismatch(
                f"uenv {image.ref}: image hash mismatch (expected {image.sha256}, got {got})"
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
