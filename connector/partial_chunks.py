"""Partial chunks: the blocks a request filled past its last full chunk, kept for its next turn.

Chunk keys name whole chunks (tiercache.keys), so a conversation's KV past its
last full chunk (the answer and the user's new words since the last
``chunk_tokens`` boundary) would be computed again at every turn, where vLLM's
own prefix cache, which keeps every full block, would reuse it. A **partial
chunk** closes that gap at block granularity:

* **Store**, in the step that fills a block past the request's last full chunk
  (once its prompt is computed: every decode step that completes a block, and
  the step that ends the prompt): the chunk's blocks up to that block, under
  :meth:`KeySpace.partial_key` of its chained hash, which names the prefix and
  its length. The request's previous partial chunk (a prefix of the new one,
  or of a full chunk stored now), or the one its own hit loaded, is dropped.
  Why not once, when the request finishes: that store would be planned in
  ``request_finished``, sent a step later and READY a step after that, and the
  next turn, arriving meanwhile, would miss it whenever other requests keep
  the engine's steps long. It goes through the host tier and down to the lower
  tiers like any chunk (its slot's positions past its blocks are not part of it,
  and never loaded), with one exception: a partial chunk that holds generated
  tokens goes down only once its request finished with it (held back until
  then: ``Cascade.hold_back``). A long answer supersedes its partial chunk at
  every block, and copying each one down would write up to
  ``blocks_per_chunk - 1`` slots per chunk of answer into a disk or a shared
  store that only forgets them; and no other request can want those tokens
  before the answer is out. The prompt's own partial chunk goes down at once:
  another engine's request with the same prompt may want it now. A superseded
  partial chunk is discarded (deleted from owned lower tiers, forgotten by
  shared ones, which keep at most two per request until their own eviction
  takes them: its prompt's and the one it finished with).
* **Lookup**: where a request's hit of full chunks stops (the next turn's
  prompt goes past the chunk the last turn ended in, or ends inside it), that
  chunk's blocks are tried as partial keys, longest first; the first present
  one extends the hit to its last block. At most ``blocks_per_chunk - 1``
  dictionary lookups; shared tiers are asked about the partial keys of every
  chunk past the local hit with the chunk keys (their answer sets the hit's end).
* **Load**: the partial key loads in place of the hit's last chunk, only its
  blocks (a window group's from the block its own end reaches back to:
  kv_groups.kept_from); the full chunk is stored once the engine computed it.

Not for P/D roles (a hand-off has its own prompt tail, connector/prompt_tail.py)
nor state-layer models (vLLM keeps no state after a request's last token).
vLLM's KV events do not announce partial chunks (connector/event_blocks.py
records full chunks only).

Pure functions of a vLLM ``Request``'s ``block_hashes``; no state.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from tiercache.keys import KeySpace


@dataclass(frozen=True)
class PartialChunk:
    """Blocks ``chunk * bpc .. end_block - 1`` of a request under ``key`` (``end_block`` inside the chunk)."""

    key: bytes
    chunk: int
    end_block: int

    def end_token(self, block_size: int) -> int:
        return self.end_block * block_size


def _ending_at(block_hashes: Sequence[bytes], keys: KeySpace, end_block: int) -> PartialChunk:
    """The partial chunk of blocks up to ``end_block`` (not a multiple of blocks_per_chunk)."""
    return PartialChunk(keys.partial_key(bytes(block_hashes[end_block - 1])),
                        (end_block - 1) // keys.blocks_per_chunk, end_block)


def partial_to_store(block_hashes: Sequence[bytes], computed_tokens: int, keys: KeySpace,
                     block_size: int) -> PartialChunk | None:
    """The partial chunk a request that computed ``computed_tokens`` ends in; None on a chunk boundary."""
    end_block = min(computed_tokens // block_size, len(block_hashes))
    if end_block % keys.blocks_per_chunk == 0:
        return None  # no block past the last full chunk (or none at all)
    return _ending_at(block_hashes, keys, end_block)


def partial_candidates(block_hashes: Sequence[bytes], keys: KeySpace, chunk: int) -> list[PartialChunk]:
    """The partial chunks of ``block_hashes`` inside chunk ``chunk`` (the first one a hit misses), longest
    first: every hashed block of it but its last (whose chained hash is the chunk key's)."""
    bpc = keys.blocks_per_chunk
    last = min(len(block_hashes), (chunk + 1) * bpc - 1)
    return [_ending_at(block_hashes, keys, end) for end in range(last, chunk * bpc, -1)]


def partial_keys_from(block_hashes: Sequence[bytes], keys: KeySpace, chunk: int) -> list[bytes]:
    """Every partial key in chunks ``chunk`` onwards: what a shared tier is asked about beside the chunks
    (the hit's end is known only from its answer)."""
    last_chunk = len(block_hashes) // keys.blocks_per_chunk
    return [p.key for c in range(chunk, last_chunk + 1) for p in partial_candidates(block_hashes, keys, c)]
