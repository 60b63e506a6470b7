"""OCI image references (``--image``): parsed and validated once, by the API at submit
and by the agent before any tool sees them.

Docker's reference grammar (distribution/reference), restricted to what is safe as a
command argument and a file name: no shell metacharacters, whitespace or "..", sha256
digests only.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

_LABEL = r"[A-Za-z0-9](?:[A-Za-z0-9-]*[A-Za-z0-9])?"
_DOMAIN = rf"{_LABEL}(?:\.{_LABEL})*(?::[0-9]+)?"
_COMPONENT = r"[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*"
_REF = re.compile(
    rf"(?P<name>(?:{_DOMAIN}/)?{_COMPONENT}(?:/{_COMPONENT})*)"
    r"(?::(?P<tag>[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}))?"
    r"(?:@(?P<digest>sha256:[0-9a-f]{64}))?"
)
MAX_REF_LENGTH = 512


class ImageRefError(ValueError):
    """Not an image reference; the message says what was expected."""


@dataclass(frozen=True)
class ImageRef:
    """A parsed image reference: ``[registry/]path[:tag][@sha256:...]``."""

    name: str
    tag: str | None
    digest: str | None

    @property
    def registry(self) -> str:
        """The registry host[:port] (docker.io when the first component is not a host)."""
        first, sep, _ = self.name.partition("/")
        if sep and ("." in first or ":" in first or first == "localhost"):
            return first
        return "docker.io"

    @property
    def hostname(self) -> str:
        return self.registry.rsplit(":", 1)[0] if ":" in self.registry else self.registry

    def by_digest(self, digest: str) -> str:
        return f"{self.name}@{digest}"


def parse_image_ref(ref: str) -> ImageRef:
    """Parse and validate ``ref``; raises :class:`ImageRefError` for anything else."""
    text = ref if isinstance(ref, str) else ""
    m = _REF.fullmatch(text)
    if not text or m is None or len(text) > MAX_REF_LENGTH:
        raise ImageRefError(
            f"image {ref!r}: not a valid image reference (expected registry/name:tag or "
            "registry/name@sha256:<digest>)"
        )
    return ImageRef(name=m.group("name"), tag=m.group("tag"), digest=m.group("digest"))
