"""The Redis tier's commands: pipelined SET, GET, EXISTS and UNLINK of chunk frames.

:class:`Commands` turns a job's keys and views into pipelines (``SET`` of a
frame whose payload is the caller's view, unjoined; ``GET`` verified into the
caller's view), counts what happened, and reports a lost server to the
:class:`~tiercache.backends.redis.link.Link`. It runs on the lanes' threads
(and ``exists`` also on the owner's thread, for the blocking ``contains``);
it keeps no state of its own but the settings. Keys, frames, failures and
buffers are told in :mod:`tiercache.backends.redis.backend`.
"""

from __future__ import annotations

import enum
import logging
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any, TypeVar

import numpy as np
from tiercache.backends.redis.client import TROUBLE, Client, Framed
from tiercache.backends.redis.link import Link
from tiercache.backends.redis.settings import RedisSettings

from tiercache import integrity
from tiercache.backend import BackendContext
from tiercache.counters import Counters
from tiercache.tiers.worker_lanes import BackendJob, Outcome

# The tier's one logger: its backend module's name, the name log configurations filter on.
logger = logging.getLogger(f"{__package__}.backend")

#: Prefix of every Redis key this tier writes (a shared server stays inspectable).
KEY_TAG = b"tc:"
#: Keys per pipeline round trip for the small commands (EXISTS, UNLINK).
SMALL_BATCH = 1024
#: Seconds between WARNING lines for one repeated error reply (the rest are DEBUG).
ERROR_REPLY_LOG_S = 60.0

_I = TypeVar("_I")


def redis_key(key: bytes) -> bytes:
    """The Redis key of a chunk key."""
    return KEY_TAG + key


class _Load(enum.Enum):
    OK = "ok"
    MISSING = "missing"
    CORRUPT = "corrupt"  # failed verification: damaged, foreign, or not this key's frame
    WRONG_SIZE = "wrong_size"  # intact, but the caller's buffer has another length
    ERROR = "error"  # an error reply for this key


class Commands:
    """A job's pipelines on the live client; ``deleting``: keys gets and lookups miss."""

    def __init__(
        self, settings: RedisSettings, context: BackendContext, counters: Counters, link: Link,
        deleting: Mapping[bytes, int], storable: Callable[[Any], bool],
    ) -> None:
        self.settings = settings
        self._namespace = context.namespace
        self._mac = integrity.MacKey.from_secret(settings.mac_key)  # None: xxh3 frames
        self._counters = counters
        self._link = link
        self._deleting = deleting
        self._storable = storable
        self._last_error_reply = ("", 0.0)  # the last error reply logged at WARNING, and when

    def put(self, client: Client | None, job: BackendJob) -> Outcome:
        ok: list[bytes] = []
        moved = errors = 0
        ex = ("EX", self.settings.ttl_seconds) if self.settings.ttl_seconds else ()

        def command(pair: tuple[bytes, memoryview]) -> tuple[Any, ...]:
            key, view = pair
            header = integrity.frame_header(self._namespace, key, view, mac=self._mac)
            return ("SET", redis_key(key), Framed(header, view), *ex)

        pairs = list(zip(job.keys, job.views))
        for batch, replies in self._pipelines(client, pairs, self.settings.pipeline_batch, command):
            for (key, view), reply in zip(batch, replies):
                if isinstance(reply, BaseException):
                    errors += self._reply_error(client, reply)
                else:
                    ok.append(key)
                    moved += view.nbytes
        failed = _missing(job.keys, ok)
        self._counters.add(puts=len(ok), put_failures=len(failed), server_errors=errors)
        return ok, failed, moved

    def get(self, client: Client | None, job: BackendJob) -> Outcome:
        ok: list[bytes] = []
        moved = corrupt = errors = 0
        pairs = [(k, v) for k, v in zip(job.keys, job.views) if k not in self._deleting]
        batches = self._pipelines(client, pairs, self.settings.pipeline_batch,
                                  lambda pair: ("GET", redis_key(pair[0])))
        for batch, replies in batches:
            for i, (key, view) in enumerate(batch):
                outcome = self._unframe(client, key, replies[i], view)
                replies[i] = None  # let a large reply go as soon as it is used
                if outcome is _Load.OK:
                    ok.append(key)
                    moved += view.nbytes
                corrupt += outcome is _Load.CORRUPT
                errors += outcome is _Load.ERROR
        failed = _missing(job.keys, ok)
        self._counters.add(gets=len(ok), get_failures=len(failed), checksum_failures=corrupt,
                           server_errors=errors)
        return ok, failed, moved

    def exists(self, client: Client | None, keys: list[bytes]) -> list[bool]:
        """Pipelined EXISTS of each key; False for keys being deleted, and on trouble."""
        held = [False] * len(keys)
        asked = [i for i, k in enumerate(keys) if self._storable(k) and k not in self._deleting]
        answered = 0
        batches = self._pipelines(client, asked, SMALL_BATCH,
                                  lambda i: ("EXISTS", redis_key(keys[i])))
        for batch, replies in batches:
            for i, reply in zip(batch, replies):
                held[i] = reply == 1
            answered += len(batch)
        self._counters.add(lookups=len(keys), lookup_failures=len(asked) - answered)
        return held

    def delete(self, client: Client | None, job: BackendJob) -> Outcome:
        done = 0
        batches = self._pipelines(client, job.keys, SMALL_BATCH,
                                  lambda key: ("UNLINK", redis_key(key)))
        for _, replies in batches:
            done += sum(not isinstance(r, BaseException) for r in replies)
        if done < len(job.keys):  # those chunks stay until TTL or eviction: only stale hits
            self._counters.add(delete_failures=len(job.keys) - done)
        return [], [], 0

    # ------------------------------------------------------------------ helpers
    def _unframe(self, client: Client | None, key: bytes, reply: Any, out: memoryview) -> _Load:
        """Verify ``reply`` as ``key``'s frame, then copy its payload into ``out`` (else untouched)."""
        if reply is None:
            return _Load.MISSING
        if isinstance(reply, BaseException):
            return _Load.ERROR if self._reply_error(client, reply) else _Load.MISSING
        try:
            payload = integrity.compact_payload(memoryview(reply), self._namespace, key, mac=self._mac)
        except integrity.IntegrityError as exc:
            logger.warning("redis tier: dropping chunk %s: %s", key.hex(), exc)
            return _Load.CORRUPT
        if payload.nbytes != out.nbytes:
            return _Load.WRONG_SIZE
        np.copyto(np.frombuffer(out, dtype=np.uint8), np.frombuffer(payload, dtype=np.uint8))
        return _Load.OK

    def _pipelines(
        self, client: Client | None, items: list[_I], size: int,
        command: Callable[[_I], tuple[Any, ...]],
    ) -> Iterator[tuple[list[_I], list[Any]]]:
        """``(batch, replies)`` per pipeline of ``size`` items, while ``client`` is the live one.

        A connection-level error reports trouble and ends the iteration; an
        error reply of one command is an exception object in its reply's place.
        """
        for batch in _batches(items, size):
            if client is None or self._link.client() is not client:
                return
            pipe = client.pipeline(transaction=False)
            try:
                for item in batch:
                    pipe.execute_command(*command(item))
                replies = pipe.execute(raise_on_error=False)
            except TROUBLE as exc:
                self._link.trouble(client, exc)
                return
            yield batch, replies

    def _reply_error(self, client: Client | None, error: BaseException) -> int:
        """Classify an error in one command's place: 1 if the server refused it, 0 if trouble."""
        if isinstance(error, TROUBLE):
            if client is not None:
                self._link.trouble(client, error)
            return 0
        # The same refusal of every key (NOPERM, OOM): one WARNING a minute, the rest DEBUG.
        text, now = str(error), time.monotonic()
        last_text, last_at = self._last_error_reply  # a race between lanes: one more line at most
        repeat = text == last_text and now - last_at < ERROR_REPLY_LOG_S
        if not repeat:
            self._last_error_reply = (text, now)
        (logger.debug if repeat else logger.warning)("redis tier: error reply: %s", text)
        return 1


def _batches(items: list[Any], size: int) -> Iterable[list[Any]]:
    for i in range(0, len(items), size):
        yield items[i : i + size]


def _missing(keys: list[bytes], ok: list[bytes]) -> list[bytes]:
    """``keys`` that are not in ``ok``, in order (a key may appear more than once)."""
    if len(ok) == len(keys):
        return []
    done = set(ok)
    return [k for k in keys if k not in done]
