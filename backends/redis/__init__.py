"""The Redis tier: chunks as framed values in Redis (standalone or cluster).

Owns: :mod:`.backend` (RedisBackend: its jobs, lookups, threads), :mod:`.client`, :mod:`.link`
(the connection and its reconnect thread), :mod:`.commands` (pipelined SET/GET/EXISTS/UNLINK),
:mod:`.settings`, :mod:`.auth` (credentials, TLS, and the words for their failures).
Its I/O threads are tiercache.tiers.worker_lanes'.
May import: tiercache's core. Not other backends.
"""
