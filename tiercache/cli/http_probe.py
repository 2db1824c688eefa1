"""Does a TCP port speak HTTP? One small request, to explain a wrong-kind address.

``tiercache inspect server`` and ``tiercache bench server`` talk tiercache's
binary protocol; pointed at an HTTP port (vLLM's API and ``/metrics``, or a
Prometheus exporter) they would fail with a protocol error. :func:`speaks_http`
sends ``HEAD / HTTP/1.0`` and looks for an ``HTTP/`` status line, so the
command can say what the port is instead. :data:`HTTP_HINT` is that message.
"""

from __future__ import annotations

import socket

HTTP_HINT = (
    "that port speaks HTTP, not the tiercache cache-server protocol: is it an engine's /metrics "
    "(or its API port)? try `tiercache inspect engine http://{address}/metrics`"
)


def speaks_http(host: str, port: int, timeout_s: float = 2.0) -> bool:
    """True when ``host:port`` answers an HTTP request with an HTTP status line."""
    try:
        with socket.create_connection((host, port), timeout=timeout_s) as sock:
            sock.settimeout(timeout_s)
            sock.sendall(f"HEAD / HTTP/1.0\r\nHost: {host}\r\n\r\n".encode())
            reply = sock.recv(16)
    except OSError:
        return False
    return reply.startswith(b"HTTP/")


def http_hint(address: str) -> str | None:
    """:data:`HTTP_HINT` for ``HOST:PORT`` when that port speaks HTTP, else None."""
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit():
        return None
    host = host.strip("[]") or "127.0.0.1"
    return HTTP_HINT.format(address=address) if speaks_http(host, int(port)) else None
