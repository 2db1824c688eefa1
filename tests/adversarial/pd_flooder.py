"""A connection flooder for the P/D side channel: holds N connections open and reopens each one the producer drops.

Run as ``python -m tests.adversarial.pd_flooder PORT COUNT SOURCES`` (``SOURCES``:
comma-separated loopback addresses its connections come from, round robin).
It never says a word on them. It prints ``ready`` once all COUNT are open (or
refused at once), then keeps reopening until its standard input closes, and
prints how many connections it made in all.
"""

from __future__ import annotations

import selectors
import socket
import sys


def _open(port: int, source: str) -> socket.socket | None:
    try:
        sock = socket.create_connection(("127.0.0.1", port), timeout=2, source_address=(source, 0))
    except OSError:
        return None
    sock.setblocking(False)
    return sock


def main(port: int, count: int, sources: list[str]) -> None:
    sel = selectors.DefaultSelector()
    sel.register(sys.stdin, selectors.EVENT_READ, "stdin")
    made = 0
    for i in range(count):
        source = sources[i % len(sources)]
        sock = _open(port, source)
        made += 1
        if sock is not None:
            sel.register(sock, selectors.EVENT_READ, source)
    print("ready", flush=True)
    while True:
        for key, _ in sel.select(timeout=1.0):
            if key.data == "stdin":
                if not sys.stdin.readline():
                    print(f"made {made}", flush=True)
                    return
                continue
            sock = key.fileobj
            try:
                data = sock.recv(4096)  # type: ignore[union-attr]
            except OSError:
                data = b""
            if data:
                continue
            sel.unregister(sock)
            sock.close()  # type: ignore[union-attr]
            again = _open(port, key.data)  # dropped by the producer: at it again
            made += 1
            if again is not None:
                sel.register(again, selectors.EVENT_READ, key.data)


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3].split(","))
