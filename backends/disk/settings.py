"""The disk tier's options (``options:`` of a ``backend: disk`` tier in YAML) and start-up checks.

:class:`DiskSettings` is plain validated data, read by
:class:`~tiercache.backends.disk.backend.DiskBackend` and its
:mod:`~tiercache.backends.disk.index`; :func:`check_context` refuses an
engine context the tier cannot serve, before anything touches the disk.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field

from tiercache.backend import BackendContext, BackendSettings
from tiercache.config.schema import ConfigError


class DiskSettings(BackendSettings):
    """Options of a disk tier (``options:`` of a ``backend: disk`` tier in YAML)."""

    root: Path = Field(description="Directory holding the tier; namespaced sub-trees go under it.")
    io_threads: int = Field(
        default=4, ge=1, le=64, description="Worker threads doing the file I/O."
    )
    fsync: Literal["none", "batch", "always"] = Field(
        default="batch",
        description="none: never; batch: a job's files and directories before it is reported; "
        "always: every file and its directory as it is written.",
    )
    direct_io: Literal["auto", "on", "off"] = Field(
        default="auto",
        description="O_DIRECT I/O: auto = where the filesystem allows it (else buffered), "
        "on = required (start-up error otherwise), off = buffered I/O.",
    )
    reuse_files: bool = Field(
        default=True,
        description="Keep deleted chunks' files (inside the budget) and overwrite them in place "
        "for new chunks; false: unlink them, returning the space to the filesystem at once.",
    )


def check_context(context: BackendContext) -> None:
    """ConfigError unless the namespace digest is 8 bytes and the sizes make sense."""
    if len(context.namespace) != 8:
        raise ConfigError(f"disk tier {context.tier_name}: namespace digest must be 8 bytes")
    if context.chunk_bytes <= 0 or context.capacity_bytes < 0:
        raise ConfigError(
            f"disk tier {context.tier_name}: chunk_bytes {context.chunk_bytes} and capacity "
            f"{context.capacity_bytes} must be positive"
        )
