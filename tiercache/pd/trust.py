"""Whom a P/D consumer reads from: the producers it trusts, checked before anything connects.

A hand-off names its producer (``remote_host``/``remote_port``), and those
params come from the client's request through the proxy: an address there is
a claim, not a credential. :class:`ProducerTrust` decides from the consumer's
own config (``pd.trusted_producers``, ``pd.secret``):

* ``trusted_producers`` given: only the producers listed, each ``host`` (any
  port) or ``host:port`` (the producer's ``pd.port``, its TP rank 0; the
  consumer reads rank ``r`` at ``port + r``); with a secret, a listed producer
  must also prove it holds it (the handshake, :mod:`tiercache.pd.link`);
* no list, a secret: any address, but nothing is read before the producer
  proved it holds the secret (mutual authentication);
* neither: loopback addresses only.

Hosts compare as written in the params, an IP address in its canonical form
and a name in lower case; no name is looked up here. The scheduler checks a
hand-off when it learns it (connector/pd/consumer.py: refused, the prompt is
computed), and the reader again before it connects (tiercache.pd.peer_tier).

Pure: no I/O, any thread.
"""

from __future__ import annotations

from collections.abc import Sequence

from tiercache.config.pd import is_loopback, normal_host, parse_producer


class ProducerTrust:
    """The consumer's rule for producer addresses (see the module)."""

    def __init__(self, trusted: Sequence[str] = (), has_secret: bool = False) -> None:
        self.entries = [parse_producer(e) for e in trusted]
        self.has_secret = has_secret

    def why_not(self, host: str, port: int) -> str | None:
        """Why the producer at ``host:port`` (its rank 0) is not read from; None: it may be."""
        where = f"{host!r:.80}:{port}"
        if self.entries:
            h = normal_host(host)
            if any(h == eh and (ep is None or ep == port) for eh, ep in self.entries):
                return None
            return f"producer {where} is not in pd.trusted_producers"
        if self.has_secret or is_loopback(host):
            return None
        return (f"producer {where} is not a loopback address, and this consumer has neither pd.secret nor "
                "pd.trusted_producers")
