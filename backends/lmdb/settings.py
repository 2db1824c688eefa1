"""The LMDB tier's options (``tiers[i].options`` of a ``backend: lmdb`` tier in YAML).

Plain validated data: :class:`LMDBSettings` is read by the backend
(:mod:`tiercache.backends.lmdb.backend`) and by the environment layer
(:mod:`tiercache.backends.lmdb.env`), which opens LMDB with them.
"""

from __future__ import annotations

from pathlib import Path

from pydantic import Field

from tiercache.backend import BackendSettings
from tiercache.config.schema import ByteSize


class LMDBSettings(BackendSettings):
    """Options of an ``lmdb`` tier (``tiers[i].options`` in YAML)."""

    path: Path = Field(description="Directory of the LMDB environment (created if missing).")
    map_size: ByteSize | None = Field(
        default=None,
        description=(
            "LMDB map size in bytes. Default: the capacity of every rank of the engine plus "
            "headroom for LMDB's pages (default_map_size). Set it when other engines share "
            "the environment."
        ),
    )
    max_readers: int = Field(
        default=126, ge=1,
        description="Reader slots; set by the first process that opens the environment.",
    )
    sync: bool = Field(
        default=False,
        description=(
            "fsync on every commit. False: an OS crash may lose the latest puts (they become "
            "misses); LMDB stays consistent, and every load is checksummed anyway."
        ),
    )
    io_threads: int = Field(
        default=1, ge=1, le=64,
        description="I/O threads. All run gets; the first also runs puts and deletes, in order.",
    )
    subdir: bool = Field(
        default=True, description="True: path is a directory; False: path is the data file itself."
    )
    readonly: bool = Field(
        default=False, description="Open read-only (another process writes); puts fail."
    )
