"""Prometheus collectors of the cache server, in a registry of their own.

Updated on the event loop thread (request handlers, the stats refresh);
served on ``/metrics`` by prometheus_client's HTTP thread, which only reads.
"""

from __future__ import annotations

import logging

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

logger = logging.getLogger(__name__)

_SECONDS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0, 5.0)


class ServerMetrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.requests = Counter("tiercache_server_requests", "Requests served, by type.", ["type"], registry=r)
        self.request_seconds = Histogram(
            "tiercache_server_request_seconds", "Seconds from a request's header to its reply, by type.",
            ["type"], buckets=_SECONDS, registry=r,
        )
        self.keys = Counter(
            "tiercache_server_keys", "Keys handled, by operation and outcome.", ["op", "status"], registry=r
        )
        self.bytes = Counter(
            "tiercache_server_bytes", "Value bytes moved, by direction (in: puts, out: gets) and path.",
            ["direction", "path"], registry=r,
        )
        self.refused = Counter(
            "tiercache_server_refused_messages", "Messages refused, by reason (the ERROR code).",
            ["reason"], registry=r,
        )
        self.connections = Gauge("tiercache_server_connections", "Open client connections.", registry=r)
        self.used_bytes = Gauge("tiercache_server_tier_used_bytes", "Bytes held, by tier.", ["tier"], registry=r)
        self.capacity_bytes = Gauge(
            "tiercache_server_tier_capacity_bytes", "Byte budget, by tier.", ["tier"], registry=r
        )
        self.chunks = Gauge("tiercache_server_tier_chunks", "Chunks held, by tier.", ["tier"], registry=r)

    def serve(self, port: int, host: str) -> None:
        start_http_server(port, addr=host, registry=self.registry)
        logger.info("tiercache server metrics on http://%s:%d/metrics", host, port)
