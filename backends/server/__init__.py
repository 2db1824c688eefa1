"""The cache-server tier: a client of ``tiercache serve`` (tiercache.server) as a lower tier.

Owns: :mod:`.backend` (ServerBackend), :mod:`.settings`, :mod:`.worker` (its I/O threads),
:mod:`.frames` (each chunk's frame: built on put, verified on load).
May import: tiercache's core and tiercache.server's client. Not other backends.
"""
