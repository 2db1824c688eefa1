"""The Redis tier: chunks as framed values in Redis (standalone or cluster).

Owns: :mod:`.backend` (RedisBackend), :mod:`.client`, :mod:`.link` (the connection and its
reconnect thread), :mod:`.settings`.
May import: tiercache's core. Not other backends.
"""
