"""Chunk keys: raw bytes naming one chunk of KV for one engine namespace.

Layout::

    namespace_digest (8 bytes) | prefix_hash (engine's chained block hash) | group_idx (4 bytes, big endian)

The prefix hash is the engine's chained hash of the *last* block of the chunk,
so it covers every token from the start of the sequence to the end of the
chunk: equal keys mean equal prefixes. The namespace digest covers everything
that makes two byte-identical hashes mean different KV (the checkpoint's
content, dtype, attention backend and KV layout as the workers registered it,
block and kernel block size, chunk size, global KV heads and bytes per head,
pipeline stages, hash algorithm, tenant salt), so two engines share chunks
exactly when they could use each other's bytes. Once ``model_identity`` is
known the model's path is left out: a checkpoint copied elsewhere shares, one
replaced in place does not.

The TP rank and size are *not* in the digest when the KV heads are known
(``kv_heads > 0``): lower tiers hold store shards named by KV head
(:mod:`tiercache.shards`), so engines of any TP size share them. Without the
head count (tests, old callers) the TP size and bytes per chunk stay in.
The P/D fingerprint (:func:`tiercache.pd.handoff.fingerprint`) always has them:
a hand-off moves whole rank chunks.

Keys are plain ``bytes``: cheap to hash, compare and ship, no tuple garbage.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Sequence
from dataclasses import asdict, dataclass

NAMESPACE_DIGEST_BYTES = 8
GROUP_IDX_BYTES = 4
# The group-index field of a chunk's *state* key (KeySpace.state_key): the chunk with the recurrent
# state at its end (connector/kv_groups.py); no KV-cache group index comes near it.
STATE_KEY_GROUP = 0x53544154  # "STAT"
# The group-index field of a *partial* chunk's key (KeySpace.partial_key): a chunk's first blocks,
# stored while a request's computed tokens end inside it (connector/partial_chunks.py).
PARTIAL_KEY_GROUP = 0x50415254  # "PART"

# Hash algorithms whose chained block hashes are equal across processes (with
# vLLM's fixed default seed). Others are process-random unless PYTHONHASHSEED is set.
_STABLE_HASH_ALGOS = frozenset({"sha256", "sha256_cbor"})


@dataclass(frozen=True)
class Namespace:
    """Everything that decides whether two engines' KV bytes are interchangeable."""

    model: str
    kv_dtype: str
    kv_layout: str
    block_size: int
    chunk_tokens: int
    tp_size: int
    bytes_per_chunk: int
    hash_algo: str
    tenant_salt: str = ""
    process_nonce: str = ""
    kv_heads: int = 0  # global KV heads (1 for MLA's latent); 0: unknown, TP size in the digest
    pp_size: int = 1
    shard_bytes: int = 0  # one KV head's bytes of one chunk (one store shard)
    model_identity: str = ""  # the checkpoint's content (connector/model_identity.py); "" unknown
    attention_identity: str = ""  # attention backend, KV layout as registered, kernel block size
    kv_groups: str = ""  # a hybrid model's KV-cache groups ("full,sliding_window:256"); "" for one full group

    @property
    def stable_across_processes(self) -> bool:
        """True when another process computing the same tokens gets the same keys."""
        return not self.process_nonce

    def digest(self) -> bytes:
        """The 8-byte namespace digest that prefixes every key."""
        fields = asdict(self)
        if self.kv_heads > 0:  # store shards are named by head: any TP size shares them
            del fields["tp_size"], fields["bytes_per_chunk"]
        if self.model_identity:  # the checkpoint's content names it, not its path
            del fields["model"]
        if not self.kv_groups:  # one full-attention group: the digest of before hybrid models
            del fields["kv_groups"]
        canonical = json.dumps(fields, sort_keys=True, separators=(",", ":")).encode()
        return hashlib.blake2b(canonical, digest_size=NAMESPACE_DIGEST_BYTES).digest()

    @staticmethod
    def hash_algo_nonce(hash_algo: str) -> str:
        """A per-process nonce when the engine's block hashes are process-random, else ''."""
        if hash_algo in _STABLE_HASH_ALGOS or os.environ.get("PYTHONHASHSEED") is not None:
            return ""
        return os.urandom(8).hex()


class KeySpace:
    """Builds chunk keys for one namespace and one KV-cache group."""

    __slots__ = ("namespace", "digest", "blocks_per_chunk", "_group_suffix")

    def __init__(self, namespace: Namespace, blocks_per_chunk: int) -> None:
        if blocks_per_chunk <= 0:
            raise ValueError("blocks_per_chunk must be positive")
        self.namespace = namespace
        self.digest = namespace.digest()
        self.blocks_per_chunk = blocks_per_chunk
        self._group_suffix = [g.to_bytes(GROUP_IDX_BYTES, "big") for g in range(8)]

    def chunk_key(self, last_block_hash: bytes, group_idx: int = 0) -> bytes:
        suffix = (
            self._group_suffix[group_idx]
            if group_idx < len(self._group_suffix)
            else group_idx.to_bytes(GROUP_IDX_BYTES, "big")
        )
        return self.digest + last_block_hash + suffix

    def chunk_keys(
        self, block_hashes: Sequence[bytes], start_chunk: int = 0, group_idx: int = 0
    ) -> list[bytes]:
        """Keys of every *full* chunk covered by ``block_hashes``, from ``start_chunk`` on."""
        bpc = self.blocks_per_chunk
        digest = self.digest
        suffix = (
            self._group_suffix[group_idx]
            if group_idx < len(self._group_suffix)
            else group_idx.to_bytes(GROUP_IDX_BYTES, "big")
        )
        num_chunks = len(block_hashes) // bpc
        return [
            digest + bytes(block_hashes[(i + 1) * bpc - 1]) + suffix
            for i in range(start_chunk, num_chunks)
        ]


    def state_key(self, chunk_key: bytes) -> bytes:
        """The key of chunk ``chunk_key`` stored *with* the recurrent state at its end (a state-layer
        model's chunk a hit may end at; connector/kv_groups.py): the chunk key, another group field."""
        return chunk_key[:-GROUP_IDX_BYTES] + STATE_KEY_GROUP.to_bytes(GROUP_IDX_BYTES, "big")

    def partial_key(self, last_block_hash: bytes) -> bytes:
        """The key of a *partial* chunk: a chunk's blocks up to and including the block whose chained
        hash is ``last_block_hash`` (a block inside the chunk, never its last: that is the chunk key).
        The hash covers every earlier token, so the key names the prefix and its length; the group
        field keeps it apart from every chunk and state key (connector/partial_chunks.py)."""
        return self.digest + last_block_hash + PARTIAL_KEY_GROUP.to_bytes(GROUP_IDX_BYTES, "big")

    def tail_key(self, parent_hash: bytes, first_token: int, tokens: Sequence[int], extra: bytes = b"",
                 group_idx: int = 0) -> bytes:
        """Key of a prompt's *partial* last chunk: ``tokens`` from position ``first_token`` on.

        ``parent_hash`` is the engine's chained hash of the block just before
        ``first_token`` (empty at the start of the sequence), so the key covers
        every token of the prompt, as a chunk key does; ``extra`` carries what the
        engine hashes beside the tokens (cache salt, LoRA). Same layout and length
        as a chunk key (its prefix hash is 32 bytes of BLAKE2b), and never equal to
        one: the hash is personalised. Used by P/D hand-offs only (tiercache.connector.prompt_tail).
        """
        h = hashlib.blake2b(digest_size=32, person=b"tiercache-tail")
        h.update(len(parent_hash).to_bytes(2, "big") + parent_hash)
        h.update(first_token.to_bytes(8, "big") + len(tokens).to_bytes(8, "big"))
        h.update(b"".join(int(t).to_bytes(8, "big", signed=True) for t in tokens))
        h.update(extra)
        return self.digest + h.digest() + group_idx.to_bytes(GROUP_IDX_BYTES, "big")


def split_key(key: bytes) -> tuple[bytes, bytes, int]:
    """Return (namespace digest, prefix hash, group index) of a key."""
    if len(key) < NAMESPACE_DIGEST_BYTES + GROUP_IDX_BYTES + 1:
        raise ValueError(f"not a chunk key: {len(key)} bytes")
    digest = key[:NAMESPACE_DIGEST_BYTES]
    prefix_hash = key[NAMESPACE_DIGEST_BYTES:-GROUP_IDX_BYTES]
    group = int.from_bytes(key[-GROUP_IDX_BYTES:], "big")
    return digest, prefix_hash, group
