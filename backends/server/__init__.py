"""The cache-server tier: a client of ``tiercache serve`` (tiercache.server) as a lower tier.

Owns: :mod:`.backend` (ServerBackend), :mod:`.settings`, :mod:`.worker` (its I/O threads).
May import: tiercache's core and tiercache.server's client. Not other backends.
"""
