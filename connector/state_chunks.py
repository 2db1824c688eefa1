"""State-layer models: which chunk a hit may end at, and the states vLLM offers for storing.

A model with state layers (Mamba, linear attention, short convolutions: vLLM's
``MambaSpec`` in "align" mode) resumes a prefix only from the recurrent state
*at the prefix's last token*. vLLM 0.32 keeps such a state at a block's end only
where a scheduled step ended there (its scheduler splits prefills at block
boundaries; decode passes every block end), not at every block, so tiercache
keeps two things per chunk (connector/kv_groups.py):

* the chunk's **attention** blocks under its chunk key (every chunk a store takes;
  the state groups' positions left out), the inside of any hit, and
* where vLLM offered the state at the chunk's end, the chunk **with** that state
  under its *state key* (:meth:`tiercache.keys.KeySpace.state_key`).

A hit ends at a chunk whose state key is present, after a run of chunk keys
present (:func:`state_hit_chunks`); its last chunk loads from the state key, the
others from their chunk keys. So a hit ends only where a
state was offered at a chunk's end: with ``chunk_tokens`` equal to vLLM's block
size every offered state is one; with larger chunks only steps that ended on a
chunk's end give one (fewer hits, never wrong ones).

The offers come from vLLM's scheduler each step
(``SchedulerOutput.kv_connector_block_state.boundary_state_offloads``: request
-> ``(group id, block id, tokens before the state)``): the exact block holding
the state, since a state group's block table is not positional (vLLM nulls
and frees states between steps). The block holds its state from this step's
forward pass on; the store job this step plans copies it after that pass, and
the scheduler's store pins keep it allocated until then.

Pure functions; scheduler thread only.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

# request id -> chunk -> {vLLM KV-cache group id: block id holding the state at the chunk's end}
StateOffers = dict[str, dict[int, dict[int, int]]]


def state_hit_chunks(keys: Sequence[bytes], hits: int, max_tokens: int, chunk_tokens: int,
                     state_key: Callable[[bytes], bytes], present: Callable[[bytes], bool]) -> int:
    """How many chunks a state-layer model's hit spans: ``n`` chunks ending at most at token
    ``max_tokens``, the largest whose chunk ``n - 1``'s state key is ``present``, given that the
    ``hits`` leading chunk keys are (0 if none is).

    The last chunk loads from its state key alone (it holds the chunk's attention blocks too), so
    its chunk key need not be present: a P/D hand-off of a state-layer model names the chunk keys
    before it and its state key only (connector/pd/state_handoff.py)."""
    last = min(hits + 1, len(keys), max_tokens // chunk_tokens)
    for n in range(last, 0, -1):
        if present(state_key(keys[n - 1])):
            return n
    return 0


def state_keys_to_ask(keys: Sequence[bytes], max_tokens: int, chunk_tokens: int,
                      state_key: Callable[[bytes], bytes]) -> list[bytes]:
    """The state keys a shared tier is asked about beside the chunk keys (every chunk a hit may end at)."""
    return [state_key(k) for k in keys[: max_tokens // chunk_tokens]]


def state_offers(scheduler_output: Any, chunk_tokens: int, state_groups: Iterable[int],
                 limit_tokens: Callable[[str], int | None]) -> StateOffers:
    """This step's offered states at chunk ends, per request and chunk, where every state group offered
    one (``state_groups``: vLLM's group ids). ``limit_tokens``: for a request tiercache stores, the
    tokens a store may cover (its prompt unless decode tokens are offloaded); None: left out."""
    block_state = getattr(scheduler_output, "kv_connector_block_state", None)
    offered = getattr(block_state, "boundary_state_offloads", None) or {}
    wanted = frozenset(state_groups)
    out: StateOffers = {}
    for req_id, entries in offered.items():
        limit = limit_tokens(req_id)
        if limit is None:
            continue
        chunks: dict[int, dict[int, int]] = {}
        for group_id, block_id, tokens in entries:
            if group_id in wanted and tokens > 0 and tokens % chunk_tokens == 0 and tokens <= limit:
                chunks.setdefault(tokens // chunk_tokens - 1, {})[int(group_id)] = int(block_id)
        whole = {c: blocks for c, blocks in chunks.items() if set(blocks) == wanted}
        if whole:
            out[req_id] = whole
    return out


def with_state_blocks(tables: Sequence[Sequence[int]], chunk: int, bpc: int,
                      blocks: Mapping[int, int]) -> list[list[int]]:
    """The request's block tables with each state group's block at chunk ``chunk``'s end replaced by
    the offered one (``blocks``: group index -> block id); the tables are copied, not changed."""
    out = [list(ids) for ids in tables]
    position = chunk * bpc + bpc - 1
    for group, block in blocks.items():
        ids = out[group]
        if len(ids) <= position:
            ids.extend([-1] * (position + 1 - len(ids)))
        ids[position] = block
    return out
