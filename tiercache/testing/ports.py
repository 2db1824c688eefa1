"""Free loopback TCP ports for tests and benchmarks that start servers and engines."""

from __future__ import annotations

import random
import socket


def free_port() -> int:
    """A free TCP port below the ephemeral range (vLLM's own ZMQ sockets live there)."""
    rng = random.Random()
    for _ in range(200):
        port = rng.randint(20000, 30000)
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError("no free port in 20000-30000")
