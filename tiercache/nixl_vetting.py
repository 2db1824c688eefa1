"""Vetting a peer's NIXL agent metadata in a throwaway process before our agent loads it.

A peer's agent metadata (its name, UCX worker address and registered memory)
is parsed by NIXL and UCX in C and C++. Some malformed inputs do not raise:
UCX *asserts* and aborts the whole process (a worker address whose version
nibble is wrong: ``address.c: Assertion `*addr_version == UCP_OBJECT_VERSION_V2'
failed``). A cache server that loaded a tenant's HELLO metadata directly could
be killed by one flipped byte; so could a P/D consumer by a producer's.

:class:`MetadataVetter` keeps one child process (``python -m
tiercache.nixl_vetting``) with its own NIXL agent (UCX, no memory registered).
:meth:`MetadataVetter.vet` hands the child the metadata; the child loads it
(``add_remote_agent``) and unloads it at once, and answers the agent's name
or NIXL's refusal. If the child dies or does not answer within ``timeout_s``,
the metadata is refused with the child's last words (UCX's assertion) and the
next call starts a fresh child. Only metadata a fresh agent of the same NIXL
and UCX loaded and survived reaches the caller's agent. Accepted metadata is
remembered (by digest, a bounded LRU) so a client's reconnects cost nothing.

Limits: the child is an agent with no peers; an input that is harmless to a
fresh agent but crashes one with other peers loaded would pass (none is
known). The check is as strict as the installed NIXL/UCX, no stricter.

Cost: one process (~a NIXL agent's memory) per vetter, started on first use
(or by :meth:`start`), and one pipe round trip plus a NIXL load per new
metadata (about a millisecond here).

Threads: :meth:`vet` may be called from any thread; calls are serialised by a
lock (one child, one request at a time); a call that waits longer than
``timeout_s`` for the lock is refused ("busy"), so a client sending a stream
of new metadata delays others' NIXL set-up by at most that, never stalls it.
The event loop calls it through ``asyncio.to_thread``.
"""

from __future__ import annotations

import hashlib
import logging
import os
import select
import struct
import subprocess
import sys
import tempfile
import threading
import time
from collections import OrderedDict
from collections.abc import Sequence

logger = logging.getLogger(__name__)

MAX_METADATA_BYTES = 1 << 20  # larger metadata is refused before the child sees it
_REMEMBERED = 256  # digests of accepted metadata kept
_OK, _REFUSED = 0, 1
_REPLY_HEAD = struct.Struct("<BI")
_REQUEST_HEAD = struct.Struct("<Q")
_READY = b"R"  # the child's first byte: its agent exists (importing NIXL takes a second or more)


class MetadataRefused(ValueError):
    """NIXL refused the metadata, or loading it killed (or stalled) the vetting process.

    ``transient``: no verdict on the metadata itself (the vetter was busy, or the load
    did not finish in time): the same bytes may pass later.
    """

    def __init__(self, message: str, transient: bool = False) -> None:
        super().__init__(message)
        self.transient = transient


class MetadataVetter:
    """Loads metadata in a child's NIXL agent first; see the module docstring.

    ``timeout_s``: how long one load may take (and the longest wait for the lock);
    ``start_timeout_s``: how long a child may take to start (not counted in ``timeout_s``).
    ``command``: the child's argv (tests substitute a child that misbehaves).
    """

    def __init__(self, timeout_s: float = 10.0, command: Sequence[str] | None = None,
                 start_timeout_s: float = 60.0) -> None:
        self.timeout_s = timeout_s
        self.start_timeout_s = start_timeout_s
        self._ready = False
        self._command = list(command or [sys.executable, "-m", "tiercache.nixl_vetting"])
        self._lock = threading.Lock()
        self._child: subprocess.Popen[bytes] | None = None
        self._stderr: tempfile._TemporaryFileWrapper[bytes] | None = None
        self._accepted: OrderedDict[bytes, str] = OrderedDict()
        self.children_started = 0  # how many children were started (a crash or stall starts another)

    def start(self) -> None:
        """Start the child now (otherwise the first :meth:`vet` does)."""
        with self._lock:
            self._ensure_child()

    def ready(self, timeout_s: float) -> bool:
        """Wait up to ``timeout_s`` for the child to have started (starting one if needed); whether it has.

        Call it before the exchange that yields the metadata, so that :meth:`vet` then
        costs a load, not a child's start-up (a peer may close a link idle that long).
        """
        if not self._lock.acquire(timeout=timeout_s):
            return False
        try:
            child = self._ensure_child()
            if not self._ready:
                self._await_ready(child, min(timeout_s, self.start_timeout_s))
            return True
        except TimeoutError:
            return False  # still starting: kept, the next call waits on
        except (OSError, EOFError):
            self._stop_child()
            return False
        finally:
            self._lock.release()

    def vet(self, metadata: bytes) -> str:
        """The agent name ``metadata`` loads as; MetadataRefused if NIXL refuses it or it kills the child."""
        if not 0 < len(metadata) <= MAX_METADATA_BYTES:
            raise MetadataRefused(f"NIXL metadata of {len(metadata)} bytes (1..{MAX_METADATA_BYTES} allowed)")
        digest = hashlib.blake2b(metadata, digest_size=16).digest()
        if not self._lock.acquire(timeout=self.timeout_s):  # others' metadata ahead of ours: do not wait for ever
            raise MetadataRefused(f"the vetting process is busy (waited {self.timeout_s:.1f} s)", transient=True)
        try:
            name = self._accepted.get(digest)
            if name is not None:
                self._accepted.move_to_end(digest)
                return name
            name = self._ask(metadata)
            self._accepted[digest] = name
            if len(self._accepted) > _REMEMBERED:
                self._accepted.popitem(last=False)
            return name
        finally:
            self._lock.release()

    def close(self) -> None:
        with self._lock:
            self._stop_child()

    def _ask(self, metadata: bytes) -> str:
        child = self._ensure_child()
        assert child.stdin is not None and child.stdout is not None
        try:
            if not self._ready:
                self._await_ready(child, self.start_timeout_s)
        except (OSError, EOFError, TimeoutError) as exc:
            why = self._last_words() or repr(exc)
            self._stop_child()
            raise MetadataRefused(f"the vetting process did not start: {why}", transient=True) from None
        deadline = time.monotonic() + self.timeout_s
        try:
            child.stdin.write(_REQUEST_HEAD.pack(len(metadata)) + metadata)
            child.stdin.flush()
            status, size = _REPLY_HEAD.unpack(_read_exactly(child.stdout, _REPLY_HEAD.size, deadline))
            text = _read_exactly(child.stdout, min(size, 4096), deadline).decode("utf-8", "replace")
        except TimeoutError:
            self._stop_child()
            raise MetadataRefused(f"loading this NIXL metadata took over {self.timeout_s:.1f} s", transient=True) from None
        except (OSError, EOFError) as exc:
            why = self._last_words() or f"it died ({exc})"
            self._stop_child()
            raise MetadataRefused(f"loading this NIXL metadata killed the vetting process: {why}") from None
        if status != _OK:
            raise MetadataRefused(f"NIXL refused the metadata: {text}")
        return text

    def _await_ready(self, child: subprocess.Popen[bytes], timeout_s: float) -> None:
        if _read_exactly(child.stdout, 1, time.monotonic() + timeout_s) != _READY:
            raise EOFError("it did not say it was ready")
        self._ready = True

    def _ensure_child(self) -> subprocess.Popen[bytes]:
        if self._child is not None and self._child.poll() is None:
            return self._child
        self._stop_child()
        self._stderr = tempfile.TemporaryFile()  # noqa: SIM115 - lives as long as the child; the child truncates it per request
        self._child = subprocess.Popen(self._command, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                       stderr=self._stderr, close_fds=True)
        self._ready = False
        self.children_started += 1
        return self._child

    def _last_words(self) -> str:
        if self._stderr is None:
            return ""
        if self._child is not None:
            try:
                self._child.wait(timeout=1.0)  # let an aborting child finish writing
            except subprocess.TimeoutExpired:
                pass
        self._stderr.seek(0)
        lines = [line for line in self._stderr.read()[-4096:].decode("utf-8", "replace").splitlines() if line.strip()]
        return lines[-1].strip()[:500] if lines else ""

    def _stop_child(self) -> None:
        child, self._child = self._child, None
        if child is not None:
            child.kill()
            child.wait()
            for pipe in (child.stdin, child.stdout):
                if pipe is not None:
                    pipe.close()
        if self._stderr is not None:
            self._stderr.close()
            self._stderr = None


def _read_exactly(pipe: object, size: int, deadline: float) -> bytes:
    fd = pipe.fileno()  # type: ignore[attr-defined]
    out = b""
    while len(out) < size:
        left = deadline - time.monotonic()
        if left <= 0 or not select.select([fd], [], [], left)[0]:
            raise TimeoutError
        chunk = os.read(fd, size - len(out))
        if not chunk:
            raise EOFError("end of stream")
        out += chunk
    return out


def main() -> None:
    """The child: vet requests from stdin until it closes (each answered on stdout)."""
    replies = os.fdopen(os.dup(1), "wb")  # the answers' own descriptor: nothing NIXL prints can reach it
    os.dup2(2, 1)
    from nixl._api import nixl_agent, nixl_agent_config

    agent = nixl_agent(f"tiercache-vetter-{os.getpid()}", nixl_agent_config(backends=["UCX"], enable_prog_thread=False))
    stdin = sys.stdin.buffer
    replies.write(_READY)
    replies.flush()
    while head := stdin.read(_REQUEST_HEAD.size):
        (size,) = _REQUEST_HEAD.unpack(head)
        metadata = stdin.read(size)
        os.ftruncate(2, 0)  # stderr holds this request's output only: the parent reads it if we die
        os.lseek(2, 0, os.SEEK_SET)
        try:
            name = agent.add_remote_agent(metadata)
            name = name.decode() if isinstance(name, bytes) else str(name)
            agent.remove_remote_agent(name)
            status, text = _OK, name
        except Exception as exc:  # noqa: BLE001 - NIXL's refusal: an answer, not a death
            status, text = _REFUSED, str(exc)[:1000] or type(exc).__name__
        data = text.encode("utf-8", "replace")
        replies.write(_REPLY_HEAD.pack(status, len(data)) + data)
        replies.flush()


if __name__ == "__main__":
    main()
