"""The disk tier: one file per chunk under a directory, with an index and a byte budget.

Owns: :mod:`.backend` (DiskBackend: start-up, the Backend calls, submission), :mod:`.settings`,
:mod:`.index` (index, free pool, budget, the job record), :mod:`.tasks` (the pool threads' work),
:mod:`.file_io`, :mod:`.layout`.
May import: tiercache's core (backend contract, tiers kit, integrity, config). Not other backends.
"""
