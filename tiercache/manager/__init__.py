"""Management, scheduler side: which chunk lives in which tier, and what to move. Never moves bytes.

Owns: :mod:`.offloading` (the OffloadingManager, the scheduler's one entry point), :mod:`.directory`
(per-tier chunk maps and budgets), :mod:`.cascade` (demotions and promotions between tiers),
:mod:`.plans` (the load/store/demote plans it hands out), :mod:`.policies` (eviction: LRU, ARC).
May import: tiercache.keys, tiercache.events, tiercache.config. Not transfer/, tiers/, pd/, nor any backend.
"""
