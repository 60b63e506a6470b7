"""Where checkpoints live (spec: Checkpoint Broker, "Checkpoint Destinations"): the
``checkpoint_root`` setting parsed, and the layout under it,
``{checkpoint_root}/{tenant}/{project}/{alloc}/checkpoints/{id}/``. Pure functions."""

from __future__ import annotations

import os
import re
from typing import Literal

import msgspec
from lattice_common.errors import ValidationError
from lattice_common.logstore import DEFAULT_PROJECT
from lattice_common.types import Allocation

__all__ = [
    "CHECKPOINTS_DIR",
    "AllocationKey",
    "CheckpointRoot",
    "allocation_key",
    "checkpoint_relpath",
    "checkpoints_relpath",
    "parse_checkpoint_root",
]

CHECKPOINTS_DIR = "checkpoints"
# ids are chosen by Lattice (ckpt-N): a plain name; names starting with a dot are
# reserved (the probe directory, copies being written)
_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._@+=-]*")
_SCHEME = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*)://")


class CheckpointRoot(msgspec.Struct, frozen=True):
    """``kind`` fs: ``path`` is an absolute directory; s3: ``bucket`` and a key
    ``prefix`` ("" or without slashes at either end)."""

    kind: Literal["fs", "s3"]
    path: str = ""
    bucket: str = ""
    prefix: str = ""

    def __str__(self) -> str:
        if self.kind == "s3":
            return f"s3://{self.bucket}/{self.prefix}".rstrip("/")
        return self.path


class AllocationKey(msgspec.Struct, frozen=True, order=True):
    """The three segments above ``checkpoints/`` that name one allocation's checkpoints."""

    tenant: str
    project: str
    alloc: str


def allocation_key(alloc: Allocation) -> AllocationKey:
    """An allocation's place in the layout, as the node agent writes it
    (lattice_agent.checkpoint.paths): an empty project is ``default`` (as for its logs)."""
    return AllocationKey(
        _component(alloc.spec.tenant, DEFAULT_PROJECT),
        _component(alloc.spec.project, DEFAULT_PROJECT),
        _component(alloc.id, "allocation"),
    )


def _component(name: str, fallback: str) -> str:
    # the node agent's rule (lattice_agent.checkpoint.paths._component), so both compute
    # the same path: a name never climbs out of the root or into another's directory
    name = name.replace("/", "_").replace("\0", "_").strip()
    return fallback if name in ("", ".", "..") else name


def parse_checkpoint_root(text: str) -> CheckpointRoot:
    """``/absolute/path`` or ``s3://bucket[/prefix]``; anything else is a
    ValidationError that says what to write instead."""
    raw = text.strip()
    if not raw:
        raise ValidationError(
            "checkpoint.checkpoint_root is empty",
            hint="Set checkpoint.checkpoint_root to a shared directory (e.g. "
            "/scratch/checkpoints) or to s3://BUCKET/PREFIX.",
        )
    m = _SCHEME.match(raw)
    if m:
        scheme = m.group(1).lower()
        if scheme != "s3":
            raise ValidationError(
                f"checkpoint.checkpoint_root {raw!r}: unknown scheme {scheme}://",
                details={"supported": "s3://, or an absolute path"},
                hint="Use s3://BUCKET/PREFIX for an S3-compatible service (endpoint and "
                "credentials in the storage section) or an absolute path for NFS.",
            )
        bucket, _, prefix = raw[m.end() :].partition("/")
        if not bucket:
            raise ValidationError(
                f"checkpoint.checkpoint_root {raw!r}: no bucket",
                hint="Write s3://BUCKET or s3://BUCKET/PREFIX (e.g. s3://lattice-checkpoints).",
            )
        prefix = prefix.strip("/")
        for seg in prefix.split("/") if prefix else []:
            if seg in ("", ".", ".."):
                raise ValidationError(
                    f"checkpoint.checkpoint_root {raw!r}: empty, '.' or '..' in the prefix",
                    hint="Write the prefix as plain names separated by single slashes.",
                )
        return CheckpointRoot("s3", bucket=bucket, prefix=prefix)
    if raw.startswith("s3:"):
        raise ValidationError(
            f"checkpoint.checkpoint_root {raw!r}: not an S3 URL",
            hint="Write s3://BUCKET/PREFIX (two slashes after s3:).",
        )
    if not os.path.isabs(raw):
        raise ValidationError(
            f"checkpoint.checkpoint_root {raw!r}: a relative path",
            hint="Give an absolute path on the file system every node mounts (the same "
            "path on all of them), e.g. /scratch/checkpoints.",
        )
    return CheckpointRoot("fs", path=os.path.normpath(raw))


def _checkpoint_id(value: str) -> str:
    if not _ID.fullmatch(value or ""):
        raise ValidationError(
            f"checkpoint id {value!r} cannot be a path segment",
            hint="A checkpoint id is non-empty and uses only letters, digits and . _ @ + = - "
            "(no slashes, not starting with a dot), e.g. ckpt-3.",
        )
    return value


def checkpoints_relpath(key: AllocationKey) -> str:
    """``{tenant}/{project}/{alloc}/checkpoints`` (no slash at either end)."""
    return "/".join(
        (
            _component(key.tenant, DEFAULT_PROJECT),
            _component(key.project, DEFAULT_PROJECT),
            _component(key.alloc, "allocation"),
            CHECKPOINTS_DIR,
        )
    )


def checkpoint_relpath(key: AllocationKey, checkpoint_id: str) -> str:
    """``{tenant}/{project}/{alloc}/checkpoints/{id}`` (no slash at either end)."""
    return f"{checkpoints_relpath(key)}/{_checkpoint_id(checkpoint_id)}"
