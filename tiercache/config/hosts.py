"""Address rules every network-facing config shares: which hosts count as this machine only.

A loopback bind (``localhost``, 127.0.0.0/8, ``::1``) is the one place where
running without a secret is allowed (the P/D side channel without
``pd.secret``, the cache server with ``auth: none``). No name is resolved:
any host name but ``localhost`` counts as reachable from elsewhere.
Pure functions; any thread.
"""

from __future__ import annotations

import ipaddress


def is_loopback(host: str) -> bool:
    """``host`` is a loopback address (``localhost``, 127.0.0.0/8, ``::1``, bracketed or not)."""
    host = host.strip().strip("[]")
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
