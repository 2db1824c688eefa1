"""The standalone cache server: the engine's manager and tiers behind a TCP service.

Modules, one job each:

* :mod:`~tiercache.server.protocol` - frame header, message bodies, bounds, typed decode errors
* :mod:`~tiercache.server.wire` - socket reads/writes (inbox buffer, scatter-gather sends)
* :mod:`~tiercache.server.auth` - the shared-token check (constant time)
* :mod:`~tiercache.server.config` - the server's own config file
* :mod:`~tiercache.server.slab` - the host memory: fixed slots with a length trailer
* :mod:`~tiercache.server.store` - manager + slab + lower tiers; two-phase put/get
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
