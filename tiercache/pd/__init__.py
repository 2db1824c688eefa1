"""Prefill/decode hand-off, engine-agnostic: no vLLM import.

Owns: :mod:`.handoff` (hand-off params and the peer check), :mod:`.channel` (side-channel
messages and framing, slot tags, NIXL agents), :mod:`.auth` (the handshake's proofs, release
tokens), :mod:`.side_channel` (the producer's side-channel server: bounded connections,
authentication), :mod:`.producer` (the producer's endpoint), :mod:`.trust` (whom a consumer
reads from), :mod:`.page_hashes` (a hand-off's integrity), :mod:`.peer_chunks` (a handed-off
chunk as the consumer knows it), :mod:`.link` (a consumer's links to producers: handshakes), :mod:`.blocks` (KV blocks as NIXL
descriptors), :mod:`.heads` (hand-offs across TP sizes), :mod:`.read_plans` (which producer bytes
land where), :mod:`.nixl_reads` (READs posted and polled), :mod:`.tagged_reads` (a hand-off READ
checked by its tags), :mod:`.transfer_log` (what the reads report to the metrics),
:mod:`.peer_tier` (the producers as a read-only tier of the consumer's pipeline).
May import: tiercache.jobs, tiercache.transfer (device), tiercache.layout, tiercache.keys, tiercache.shards, tiercache.faults,
tiercache.config. Not the manager (the connector joins them), not vLLM.
"""
