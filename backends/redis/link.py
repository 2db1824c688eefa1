"""The Redis tier's link to Redis: the live client, whether Redis is up, the reconnect thread.

:class:`Link` owns the client's life: it creates the client, probes, and
replaces it after an outage, so callers only ever ask it for the live client
(never waiting for I/O) and report trouble. The jobs run on lanes of
:class:`~tiercache.tiers.worker_lanes.WorkerLanes`. The threading and failure
contracts are told in :mod:`tiercache.backends.redis.backend` (Threads,
Failures), whose :class:`RedisBackend` drives them.

Credentials and TLS. An attempt refused for its credentials or its TLS
(:class:`~tiercache.backends.redis.auth.RedisAuthError`,
:class:`~tiercache.backends.redis.auth.RedisTLSError`) is logged at ERROR, in
words naming the user and the server and never the password: at start-up, and
again whenever it follows a success or another kind of failure (a password
rotated or a user disabled at run time); repeats are DEBUG. The tier stays
down meanwhile (every job a miss: the engine recomputes) and keeps trying with
backoff, so it comes back by itself once the server's ACL or the
``password_file`` is put right. Such attempts also count in ``auth_failures``
where the backend's counter set names it.
"""

from __future__ import annotations

import enum
import logging
import random
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from redis.exceptions import RedisClusterException, RedisError
from tiercache.backends.redis.auth import RedisAuthError, RedisTLSError
from tiercache.backends.redis.client import Client, close_client

from tiercache.counters import Counters

if TYPE_CHECKING:
    from tiercache.backends.redis.settings import RedisSettings

# The tier's one logger: its backend module's name, the name log configurations filter on.
logger = logging.getLogger(f"{__package__}.backend")


class LinkState(enum.Enum):
    STARTING = "starting"  # the first connection attempt has not finished
    UP = "up"
    DOWN = "down"


class Link:
    """The current client, whether Redis is reachable, and the reconnect thread.

    ``client()`` never waits for I/O: it returns the client while the tier is
    up and None while it is down. Only the reconnect thread connects; it sleeps
    while the tier is up and wakes when a user reports trouble.
    """

    def __init__(
        self, settings: RedisSettings, counters: Counters, name: str,
        make_client: Callable[[], Client],
    ) -> None:
        self._settings = settings
        self._counters = counters
        self._name = name
        self._make_client = make_client
        self._cond = threading.Condition()
        self._state = LinkState.STARTING
        self._client: Client | None = None
        self._retry_at = 0.0
        self._backoff = settings.reconnect_initial_s
        self._ever_up = False
        self._closing = False
        self._failed_with: type[BaseException] | None = None  # the last attempt's error type
        self._counts_auth = "auth_failures" in counters.snapshot()
        self._thread = threading.Thread(target=self._serve, name=f"{name}-reconnect", daemon=True)
        self._thread.start()

    @property
    def state(self) -> LinkState:
        return self._state

    def client(self, wait_for_start: bool = False) -> Client | None:
        """The client if the tier is up, else None. ``wait_for_start``: while the very first
        connection attempt runs, wait for it (bounded by the socket timeouts)."""
        with self._cond:
            if wait_for_start and self._state is LinkState.STARTING:
                limit = 2 * (self._settings.connect_timeout + self._settings.socket_timeout)
                self._cond.wait_for(
                    lambda: self._state is not LinkState.STARTING or self._closing, timeout=limit
                )
            return self._client if self._state is LinkState.UP and not self._closing else None

    def trouble(self, client: Client, exc: BaseException) -> None:
        """A user of ``client`` hit a connection-level error: count it; the tier goes down."""
        self._counters.add(connection_errors=1)
        with self._cond:
            if client is not self._client or self._state is not LinkState.UP:
                return  # an error of a client already replaced, or already known
            self._state = LinkState.DOWN
            self._backoff = self._settings.reconnect_initial_s
            self._retry_at = time.monotonic() + self._jittered(self._backoff)
            self._cond.notify_all()
        logger.warning("redis tier %s: down (%s: %s); reconnecting with backoff",
                       self._name, type(exc).__name__, exc)

    def close(self) -> None:
        """Stop the reconnect thread and close the client."""
        with self._cond:
            self._closing = True
            self._cond.notify_all()
        self._thread.join()
        with self._cond:
            client, self._client = self._client, None
        if client is not None:
            close_client(client)

    # ---------------------------------------------------------- reconnect thread
    def _serve(self) -> None:
        while self._await_attempt():
            self._attempt()

    def _await_attempt(self) -> bool:
        """Sleep until a connection attempt is due; False when closing."""
        with self._cond:
            while not self._closing:
                if self._state is LinkState.UP:
                    self._cond.wait()
                    continue
                delay = self._retry_at - time.monotonic()
                if delay <= 0:
                    return True
                self._cond.wait(timeout=delay)
            return False

    def _attempt(self) -> None:
        self._counters.add(connect_attempts=1)
        try:
            client = self._make_client()
        except (RedisError, OSError, RedisClusterException) as exc:
            self._attempt_failed(exc)
            return
        except Exception as exc:  # unforeseen: logged in full, retried like any failure
            logger.exception("redis tier %s: connecting failed unexpectedly", self._name)
            self._attempt_failed(exc)
            return
        with self._cond:
            old, self._client = self._client, client
            self._state = LinkState.UP
            self._failed_with = None
            self._backoff = self._settings.reconnect_initial_s
            again, self._ever_up = self._ever_up, True
            self._cond.notify_all()
        if again:
            self._counters.add(reconnects=1)
            logger.warning("redis tier %s: reconnected", self._name)
        if old is not None:
            close_client(old)

    def _attempt_failed(self, exc: BaseException) -> None:
        refused = isinstance(exc, (RedisAuthError, RedisTLSError))
        with self._cond:
            first = self._state is LinkState.STARTING
            if not first:  # waits: initial, 2x initial, 4x initial, ... up to the maximum
                self._backoff = min(2 * self._backoff, self._settings.reconnect_max_s)
            self._state = LinkState.DOWN
            wait = self._jittered(self._backoff)
            self._retry_at = time.monotonic() + wait
            news, self._failed_with = self._failed_with is not type(exc), type(exc)
            self._cond.notify_all()
        if refused and self._counts_auth:
            self._counters.add(auth_failures=1)
        if refused:  # a configuration to fix, not an outage to wait out: say it loudly, once
            log = logger.error if first or news else logger.debug
            log("redis tier %s: %s; every job misses until this is fixed (next attempt in %.2fs)",
                self._name, exc, wait)
            return
        log = logger.warning if first else logger.debug
        log("redis tier %s: cannot connect (%s: %s); next attempt in %.2fs",
            self._name, type(exc).__name__, exc, wait)

    def _jittered(self, seconds: float) -> float:
        return seconds * (1.0 + 0.25 * random.random())
