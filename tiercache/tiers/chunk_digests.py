"""The core's own integrity check, for lower tiers that do not verify what they return.

Built-in lower tiers frame every chunk with :mod:`tiercache.integrity` and
verify it on load (disk, LMDB, Redis, the cache server:
``Backend.verifies_integrity``). The framing lives in each backend, so a
plugin that skips it, or a medium that hands back other bytes with an "ok",
would put wrong KV into vLLM's blocks with nothing to notice.

For such tiers :class:`ChunkDigests` keeps the xxh3_64 of every chunk this
worker wrote (computed from the host slot when the put is handed over; the
slot is pinned until the put is reported) and checks every chunk a get
reports ok against it before anyone uses the bytes: a mismatch is a failed
key (fault ``integrity``), recomputed by vLLM. A chunk with no digest here
(written by another engine or an earlier run, or forgotten: the table keeps
the newest ``max_entries``) cannot be checked and is accepted as the
backend reported it.

Threading: the worker's main thread (TierIO's).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence

import xxhash

MAX_ENTRIES = 1 << 18  # about 50 MB of digests; beyond it the oldest chunks go unchecked


def digest(view: memoryview) -> int:
    return xxhash.xxh3_64_intdigest(view)


class ChunkDigests:
    """Digests of the chunks one tier received from this worker (bounded, newest kept)."""

    def __init__(self, max_entries: int = MAX_ENTRIES) -> None:
        self.max_entries = max_entries
        self._known: OrderedDict[bytes, int] = OrderedDict()

    def of(self, keys: Sequence[bytes], views: Sequence[memoryview]) -> dict[bytes, int]:
        """The digests of a put's chunks (kept by the caller until the put is reported)."""
        return {key: digest(view) for key, view in zip(keys, views)}

    def stored(self, digests: dict[bytes, int], ok_keys: Iterable[bytes]) -> None:
        """A put was reported: its ok chunks are now on the medium with these digests."""
        known = self._known
        for key in ok_keys:
            value = digests.get(key)
            if value is None:
                continue
            known[key] = value
            known.move_to_end(key)
        while len(known) > self.max_entries:
            known.popitem(last=False)

    def forget(self, keys: Iterable[bytes]) -> None:
        for key in keys:
            self._known.pop(key, None)

    def wrong(self, keys: Sequence[bytes], views: Sequence[memoryview], ok_keys: Iterable[bytes]) -> list[bytes]:
        """The ok keys of a get whose bytes differ from what this worker wrote."""
        ok = set(ok_keys)
        known = self._known
        bad: list[bytes] = []
        for key, view in zip(keys, views):
            expected = known.get(key)
            if key in ok and expected is not None and digest(view) != expected:
                bad.append(key)
        if bad:
            self.forget(bad)
        return bad
