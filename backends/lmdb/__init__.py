"""The LMDB tier: chunks as framed values in an LMDB environment shared by processes.

Owns: :mod:`.backend` (LMDBBackend: its jobs, errors, counters), :mod:`.settings`, :mod:`.env`,
:mod:`.frames`, :mod:`.transactions`. Its I/O threads are tiercache.tiers.worker_lanes'.
May import: tiercache's core. Not other backends.
"""
