"""Mode direct: which of a finished prompt's device blocks each handed-off key names.

With one KV-cache group a key names its chunk's blocks, ``blocks_per_chunk``
of them (the prompt's tail: the blocks its tokens span, fewer), as before
hybrid models. With several groups (a hybrid model, connector/kv_groups.py) a
key names ``groups * blocks_per_chunk`` numbers, group-major: group ``g``'s
blocks at positions ``g * bpc ..``, the chunk positions the copiers and the
consumer's load segments use. :data:`NO_BLOCK` (-1) stands where the producer
holds nothing: a sliding-window group's blocks vLLM already freed (its null
block in the request's table) and a tail's positions past its tokens.

Why the consumer never needs a NO_BLOCK position: it loads a window group's
blocks only for the last window before its hit ends (``chunk_segments``
skips the rest), and a hand-off's hit ends at most at the producer's prompt
length, while vLLM frees a window block only once it lies a whole window
behind the tokens computed. If a consumer's positions did name one, its read
of that producer fails (tiercache/pd/read_plans.py) and vLLM recomputes the
request: slower, never wrong.

Pure functions; scheduler thread.
"""

from __future__ import annotations

from collections.abc import Sequence

from tiercache.pd.handoff import NO_BLOCK

__all__ = ["NO_BLOCK", "key_blocks"]


def key_blocks(tables: Sequence[Sequence[int]], chunks: int, bpc: int, tail_blocks: int,
               null_block: int) -> tuple[list[tuple[int, ...]], bool]:
    """Each key's blocks for the first ``chunks`` chunks (as many as every table covers), and
    whether the tail (``tail_blocks`` > 0 blocks after them) could be added (its blocks last).

    ``tables``: the request's block ids per KV-cache group (vLLM's ``get_block_ids``).
    """
    if not tables:
        return [], False
    n = min([chunks] + [len(t) // bpc for t in tables])
    hybrid = len(tables) > 1

    def blocks(start: int, count: int) -> tuple[int, ...]:
        if not hybrid:
            return tuple(tables[0][start:start + count])
        out: list[int] = []
        for table in tables:
            out += [NO_BLOCK if b == null_block else b for b in table[start:start + count]]
            out += [NO_BLOCK] * (bpc - count)  # a tail's positions past its tokens
        return tuple(out)

    held = [blocks(i * bpc, bpc) for i in range(n)]
    with_tail = 0 < tail_blocks and n == chunks and all(len(t) >= n * bpc + tail_blocks for t in tables)
    if with_tail:
        held.append(blocks(n * bpc, tail_blocks))
    return held, with_tail

