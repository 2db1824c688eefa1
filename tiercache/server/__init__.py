"""The standalone cache server: the engine's manager and tiers behind a TCP service.

Modules, one job each:

* :mod:`~tiercache.server.protocol` - frame header, message bodies, bounds, typed decode errors
* :mod:`~tiercache.server.wire` - socket reads/writes (inbox buffer, scatter-gather sends)
* :mod:`~tiercache.server.tls_stream` - the same streams over TLS (server handshake on first I/O)
* :mod:`~tiercache.server.tls` - TLS config sections and their ``ssl`` contexts
* :mod:`~tiercache.server.auth` - token -> tenant (every configured token compared, constant time)
* :mod:`~tiercache.server.tenants` - a connection's tenant and key space; request scoping
* :mod:`~tiercache.server.tenant_stats` - what STATS/HEALTH show a non-admin tenant
* :mod:`~tiercache.server.nixl_owners` - NIXL agent names bound to the tenant that loaded them
* :mod:`~tiercache.server.config` - the server's own config file (auth rules: ``config_auth``)
* :mod:`~tiercache.server.slab` - the host memory: fixed slots with a length trailer
* :mod:`~tiercache.server.store` - manager + slab + lower tiers; two-phase put/get
* :mod:`~tiercache.server.budgets` - slots and in-flight bytes per connection and per tenant
* :mod:`~tiercache.server.deadlines` - per-request receive/send deadlines (stalled clients cut off)
* :mod:`tiercache.admission` (shared with the P/D side channel) - connection caps; the oldest unauthenticated make way
* :mod:`~tiercache.server.tier_pump` - the store's backend jobs: deletes, demotions, staged reads
* :mod:`~tiercache.server.connection` - one client connection (HELLO, then requests)
* :mod:`~tiercache.server.service` - listen, accept, drain on SIGTERM
* :mod:`~tiercache.server.nixl_path` - the server's NIXL (UCX) data path
* :mod:`~tiercache.server.nixl_client` - the client's NIXL agent, registered memory, progress
* :mod:`~tiercache.server.metrics` - Prometheus collectors
* :mod:`~tiercache.server.client` - a blocking client connection (client tier, CLI, tests)
* :mod:`~tiercache.server.loadgen` - N verified clients for ``bench server`` and the load test
* ``serve_cli``, ``inspect_cli``, ``bench_cli`` - ``tiercache serve|inspect|bench server``

The client tier an engine names in YAML (``backend: server``) is
:mod:`tiercache.backends.server.backend`.
"""
