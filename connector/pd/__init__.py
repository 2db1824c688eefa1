"""Prefill/decode hand-off, vLLM side: the P/D role objects the connector's halves hold.

Owns: :mod:`.roles` (the seam: the hooks, null objects when P/D is off),
:mod:`.scheduler_role` (``PDScheduler``: the producer's holds; their records in :mod:`.holds`,
a direct hand-off's blocks per key in :mod:`.direct_blocks`), :mod:`.consumer`
(``PeerOffers``: hand-offs offered to the manager as the peer tier),
:mod:`.worker_role` (``PDWorker``: endpoint and peer tier on a worker),
:mod:`.step` (the one ``pd`` field of each step's messages).

May import: tiercache.pd, tiercache.manager, tiercache.transfer, vLLM.
"""
