"""The LMDB tier: chunks as framed values in an LMDB environment shared by processes.

Owns: :mod:`.backend` (LMDBBackend), :mod:`.env`, :mod:`.frames`.
May import: tiercache's core. Not other backends.
"""
