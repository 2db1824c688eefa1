"""The disk tier: one file per chunk under a directory, with an index and a byte budget.

Owns: :mod:`.backend` (DiskBackend), :mod:`.index`, :mod:`.file_io`, :mod:`.layout`.
May import: tiercache's core (backend contract, tiers kit, integrity, config). Not other backends.
"""
