"""Normalising what callers hand a backend: keys to ``bytes``, views to flat byte memoryviews."""

from __future__ import annotations

from typing import Any


def as_key_bytes(key: Any) -> Any:
    """A key as ``bytes`` (from any bytes-like object); anything else as it is, to be refused."""
    return bytes(key) if isinstance(key, (bytes, bytearray, memoryview)) else key


def flat_byte_view(view: Any, writable: bool) -> memoryview | None:
    """``view`` as a flat unsigned-byte memoryview over the same memory; None if unusable."""
    try:
        mv = memoryview(view)
        if not mv.c_contiguous or (writable and mv.readonly):
            return None
        return mv if mv.format == "B" and mv.ndim == 1 else mv.cast("B")
    except (TypeError, ValueError, BufferError):
        return None
