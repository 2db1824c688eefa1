"""Prefill/decode hand-off, engine-agnostic: no vLLM import.

Owns: :mod:`.handoff` (hand-off params and the peer check), :mod:`.channel` (side-channel
framing and tags), :mod:`.producer` (the producer's endpoint), :mod:`.link` (a consumer's link to
a producer), :mod:`.blocks` (KV blocks as NIXL descriptors), :mod:`.heads` (hand-offs across TP
sizes), :mod:`.read_plans`, :mod:`.nixl_reads`, :mod:`.peer_tier` (the producers as a read-only
tier of the consumer's pipeline).
May import: tiercache.transfer (device, layout), tiercache.keys, tiercache.shards, tiercache.faults,
tiercache.config. Not the manager (the connector joins them), not vLLM.
"""
