"""The lower tiers as the core sees them: finding backend plugins and wrapping them.

Owns: :mod:`.registry` (backend name -> class, plugin constructor), :mod:`.sharded_backend`
(per-KV-head shards over any backend), :mod:`.tier_io` (host slots <-> backends, worker side),
:mod:`.housekeeping` (delete lanes), :mod:`.chunk_digests` (integrity for tiers that do not
verify), :mod:`.shared_lookup` (scheduler-side lookups of shared tiers), :mod:`.worker_lanes`
(the kit backends run their jobs on: job record, worker lanes, job desk, log rate limit).
May import: tiercache.backend, tiercache.shards, tiercache.layout, tiercache.faults, tiercache.config,
tiercache.buffers, tiercache.counters.
Not manager/, transfer/, pd/: backends/ build on this room, never the reverse.
"""
