"""The checkpoint store that the configuration names: ``checkpoint.checkpoint_root`` is a
directory (NFS) or ``s3://bucket/prefix``; S3 uses the ``storage`` section's endpoint,
region and credentials, the same ones the log store and backups use."""

from __future__ import annotations

from lattice_common.config import LatticeConfig, StorageConfig
from lattice_common.errors import ValidationError

from lattice_checkpoint.storage.base import (
    DEFAULT_PROBE_BYTES,
    DEFAULT_PROBE_TIMEOUT_S,
    CheckpointStore,
)
from lattice_checkpoint.storage.layout import parse_checkpoint_root
from lattice_checkpoint.storage.local import LocalCheckpointStore
from lattice_checkpoint.storage.s3 import S3CheckpointStore

__all__ = ["open_checkpoint_store", "store_from_config"]


def open_checkpoint_store(
    checkpoint_root: str,
    storage: StorageConfig | None = None,
    *,
    probe_bytes: int = DEFAULT_PROBE_BYTES,
    probe_timeout_s: float = DEFAULT_PROBE_TIMEOUT_S,
) -> CheckpointStore:
    """A store for ``checkpoint_root``; ValidationError (with a Hint) for a root that is
    neither an absolute path nor ``s3://bucket[/prefix]``, or S3 credentials given
    halfway. Nothing is contacted here: :meth:`CheckpointStore.probe` says whether the
    destination works."""
    root = parse_checkpoint_root(checkpoint_root)
    if root.kind == "fs":
        return LocalCheckpointStore(
            root.path, probe_bytes=probe_bytes, probe_timeout_s=probe_timeout_s
        )
    cfg = storage or StorageConfig()
    key_id = cfg.s3_access_key_id.get_secret_value() if cfg.s3_access_key_id else ""
    secret = cfg.s3_secret_access_key.get_secret_value() if cfg.s3_secret_access_key else ""
    if bool(key_id) != bool(secret):
        raise ValidationError(
            f"checkpoint.checkpoint_root {checkpoint_root!r}: only one of "
            "storage.s3_access_key_id and storage.s3_secret_access_key is set",
            hint="Set both (secret references such as env://NAME are fine), or neither to "
            "use the AWS credential chain (AWS_ACCESS_KEY_ID, instance profile).",
        )
    return S3CheckpointStore(
        root,
        endpoint_url=cfg.s3_endpoint,
        region=cfg.s3_region,
        access_key_id=key_id or None,
        secret_access_key=secret or None,
        probe_bytes=probe_bytes,
        probe_timeout_s=probe_timeout_s,
    )


def store_from_config(
    cfg: LatticeConfig,
    *,
    probe_bytes: int = DEFAULT_PROBE_BYTES,
    probe_timeout_s: float = DEFAULT_PROBE_TIMEOUT_S,
) -> CheckpointStore:
    """:func:`open_checkpoint_store` for ``cfg.checkpoint.checkpoint_root`` and ``cfg.storage``."""
    return open_checkpoint_store(
        cfg.checkpoint.checkpoint_root,
        cfg.storage,
        probe_bytes=probe_bytes,
        probe_timeout_s=probe_timeout_s,
    )
