"""P/D of a state-layer model: which chunks a producer hands off, and the state it resumes from.

A consumer of a state-layer model (Mamba, linear attention, short
convolutions: connector/state_chunks.py) can resume a prompt only from the
recurrent state at a chunk's end, and vLLM 0.32 keeps such a state only where a
prefill step ended (its scheduler splits a prompt at its last block boundary,
so one is there; with ``max_num_batched_tokens`` smaller than the prompt, at
every step end too). So a hand-off of ``n`` chunks names the chunk keys of
chunks ``0 .. n-2`` and the **state key** of chunk ``n - 1`` (the chunk with the
state at its end; ``Handoff.ends_with_state``), where ``n`` is the largest
count whose state the producer has and whose end lies before the prompt's last
token (the consumer computes at least that one, as vLLM does). No prompt tail:
its state (after the prompt's last token) is not at a block boundary, vLLM
offers none there. The consumer computes the tokens after the hand-off's end
(fewer than a chunk and a block).

* **via_host**: the chunk keys and the state key are host-tier chunks the
  producer stored (the state key in the step vLLM offered the state:
  connector/scheduler_stores.py); :func:`via_host_state_keys` picks ``n`` from what
  the host tier holds, as a consumer's lookup would (``state_hit_chunks``).
* **direct**: the state lives in one device block per state group, which vLLM
  nulls and frees a step after the state moved on, long before the request
  finishes. :class:`OfferedStates` takes its own reference on the block when
  vLLM offers it (the last offered state before the prompt's last token, per
  request) and gives it up once the hand-off's own pins hold it, or the
  request ends without one; :func:`state_key_blocks` names each key's blocks,
  a state group's positions :data:`NO_BLOCK` except the state key's last one.

Scheduler thread only.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from tiercache.connector.block_pins import BlockPins
from tiercache.connector.pd.direct_blocks import NO_BLOCK, key_blocks
from tiercache.connector.pd.step import DirectHold
from tiercache.connector.state_chunks import StateOffers, state_hit_chunks

if TYPE_CHECKING:
    from vllm.v1.request import Request

    from tiercache.manager.directory import TierDirectory


def state_handoff_keys(keys: Sequence[bytes], chunks: int, state_key: Callable[[bytes], bytes]) -> list[bytes]:
    """The keys of a hand-off of ``chunks`` chunks: the chunk keys before the last, then its state key."""
    return [*keys[:chunks - 1], state_key(keys[chunks - 1])]


def state_key_blocks(tables: Sequence[Sequence[int]], chunks: int, bpc: int, state_groups: Sequence[int],
                     state_blocks: Mapping[int, int], null_block: int) -> list[tuple[int, ...]]:
    """Mode direct: each key's blocks (``groups * bpc``, group-major, connector/pd/direct_blocks.py) for
    a hand-off of ``chunks`` chunks: the attention groups' blocks of each chunk, a state group's
    positions NO_BLOCK except the last key's last one, the offered state (``state_blocks``: group
    index -> block). Fewer than ``chunks`` keys when a table does not cover them."""
    end = chunks * bpc
    own = [list(t) for t in tables]
    for g in state_groups:
        own[g] = [null_block] * end
        own[g][end - 1] = state_blocks[g]
    held, _ = key_blocks(own, chunks, bpc, 0, null_block)
    return held


def via_host_state_keys(keys: Sequence[bytes], prompt_tokens: int, chunk_tokens: int, host: TierDirectory,
                        state_key: Callable[[bytes], bytes]) -> list[bytes]:
    """via_host: the chunk keys up to a chunk the ``host`` tier holds (ready or storing) with its state,
    then that state key (none: an empty hand-off, the consumer computes the prompt)."""
    def in_host(key: bytes) -> bool:
        return key in host.ready or key in host.storing

    held = next((i for i, key in enumerate(keys) if not in_host(key)), len(keys))
    # the hit a consumer's lookup finds in these keys (it computes at least the prompt's last token)
    n = state_hit_chunks(keys, held, prompt_tokens - 1, chunk_tokens, state_key, in_host)
    return state_handoff_keys(keys, n, state_key) if n else []


def direct_state_hold(keys: Sequence[bytes], tables: Sequence[Sequence[int]], state: OfferedState | None,
                      bpc: int, state_groups: Sequence[int], null_block: int,
                      state_key: Callable[[bytes], bytes]) -> DirectHold | None:
    """Mode direct: the hand-off ending at the offered ``state`` (None: no hand-off): its keys and blocks."""
    if state is None or state.chunk >= len(keys):
        return None
    blocks = state_key_blocks(tables, state.chunk + 1, bpc, state_groups, state.blocks, null_block)
    if len(blocks) <= state.chunk:
        return None
    return DirectHold(tuple(state_handoff_keys(keys, state.chunk + 1, state_key)), tuple(blocks))


def handed_off_prompt(request: Request | None) -> int | None:
    """The prompt's length of a request handed off to a consumer (``do_remote_decode``), else None."""
    if request is None or not (request.kv_transfer_params or {}).get("do_remote_decode"):
        return None
    return int(request.num_prompt_tokens)


@dataclass(frozen=True)
class OfferedState:
    """A state vLLM offered at chunk ``chunk``'s end: its block per state group (pinned by us)."""

    chunk: int
    blocks: dict[int, int]  # state group index -> block id


class OfferedStates:
    """Mode direct producer: per request, the last offered state a hand-off can end at, pinned."""

    def __init__(self, pins: BlockPins, chunk_tokens: int) -> None:
        self.pins = pins
        self.chunk_tokens = chunk_tokens
        self._states: dict[str, OfferedState] = {}

    def offered(self, offers: StateOffers, prompt_tokens: Callable[[str], int | None]) -> None:
        """This step's offers (connector/state_chunks.py ``state_offers``): keep each handed-off request's
        latest before its prompt's last token, pinned, and unpin the one it replaces.
        ``prompt_tokens(request id)``: the prompt's length of a request handed off, else None."""
        for req_id, chunks in offers.items():
            prompt = prompt_tokens(req_id)
            usable = [c for c in chunks if prompt is not None and (c + 1) * self.chunk_tokens <= prompt - 1]
            old = self._states.get(req_id)
            if not usable or (old is not None and old.chunk >= max(usable)):
                continue
            chunk = max(usable)
            state = OfferedState(chunk, dict(chunks[chunk]))
            self.pins.pin(list(state.blocks.values()))
            self._states[req_id] = state
            if old is not None:
                self.pins.unpin(list(old.blocks.values()))

    def get(self, req_id: str) -> OfferedState | None:
        return self._states.get(req_id)

    def drop(self, req_id: str) -> None:
        """The request ended (its hand-off pinned what it names) or was preempted: our pin goes."""
        state = self._states.pop(req_id, None)
        if state is not None:
            self.pins.unpin(list(state.blocks.values()))

    def __len__(self) -> int:
        return len(self._states)


__all__ = ["NO_BLOCK", "OfferedState", "OfferedStates", "direct_state_hold", "handed_off_prompt",
           "state_handoff_keys", "state_key_blocks", "via_host_state_keys"]
