"""A P/D prompt's partial last chunk: which tokens and blocks it covers, and its key.

Chunk keys name whole chunks only (tiercache.keys), so a prompt whose length is
not a multiple of ``chunk_tokens`` ends in a *tail* no chunk key covers. Plain
offloading never stores it (a prefix cache hit stops at the last whole chunk,
as vLLM's own does). A P/D hand-off does: the producer stores (mode via_host)
or holds (mode direct) the tail under a tail key (:meth:`KeySpace.tail_key`)
beside the prompt's chunks, the params name it last (``tail_tokens``), and the
consumer, having computed the same key from its own tokens, loads it too: its
engine then computes only the prompt's last token, as after vLLM's
NixlConnector, instead of up to ``chunk_tokens - 1`` tokens.

The key covers the tail's tokens, the engine's chained hash of the block before
them (which covers every earlier token and what vLLM hashes beside them) and
the cache salt and LoRA adapter. Requests whose KV depends on more than their
token ids (prompt embeddings, multimodal inputs) have no tail: they recompute it.

Pure functions of a vLLM ``Request`` (duck-typed: the fields read are named
below); no state.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from tiercache.keys import KeySpace

# A tail of one token gains nothing: the consumer's engine computes the prompt's
# last token in any case (vLLM must compute at least one).
MIN_TAIL_TOKENS = 2


@dataclass(frozen=True)
class PromptTail:
    """The partial chunk at index ``chunk`` (the prompt's number of whole chunks): ``tokens`` tokens."""

    key: bytes
    chunk: int
    tokens: int

    def blocks(self, block_size: int) -> int:
        """Engine blocks the tail spans (its last one partly filled)."""
        return -(-self.tokens // block_size)


def prompt_tail(request: Any, keys: KeySpace, chunk_tokens: int, block_size: int) -> PromptTail | None:
    """The tail of ``request``'s prompt, or None when it has none worth handing off (or cannot have one).

    Reads ``num_prompt_tokens``, ``prompt_token_ids``, ``block_hashes`` and, when
    present, ``prompt_embeds``, ``mm_features``, ``cache_salt``, ``lora_request``.
    """
    n = request.num_prompt_tokens
    chunk, tokens = divmod(n, chunk_tokens)
    token_ids = getattr(request, "prompt_token_ids", None)
    if tokens < MIN_TAIL_TOKENS or token_ids is None or len(token_ids) != n:
        return None
    if getattr(request, "prompt_embeds", None) is not None or getattr(request, "mm_features", None):
        return None  # KV that token ids do not determine
    first = chunk * chunk_tokens
    full_blocks = first // block_size
    hashes = request.block_hashes
    if len(hashes) < full_blocks:
        return None  # the engine has not hashed the prompt yet
    parent = bytes(hashes[full_blocks - 1]) if full_blocks else b""
    lora = getattr(request, "lora_request", None)
    extra = f"salt={getattr(request, 'cache_salt', None) or ''}\0lora={lora.lora_name if lora else ''}".encode()
    return PromptTail(keys.tail_key(parent, first, token_ids[first:n], extra), chunk, tokens)
