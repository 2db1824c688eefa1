"""Management, scheduler side: which chunk lives in which tier, and what to move. Never moves bytes.

Owns: :mod:`.offloading` (the OffloadingManager, the scheduler's one entry point, composed of
the parts below and reaching them by name), :mod:`.directory` (per-tier chunk maps and budgets),
:mod:`.holds` (every pin, hold/release paired), :mod:`.cascade` (demotions and what lower tiers
hold), :mod:`.deletes` (what lower tiers' backends must delete), :mod:`.plans` (the
load/store/demote plans it hands out), :mod:`.policies` (eviction: LRU, ARC).
May import: tiercache.keys, tiercache.jobs (a plan's chunk sources), tiercache.events, tiercache.config. Not transfer/, tiers/, pd/, nor any backend.
"""
