"""Prefill/decode hand-off descriptions: what a producer tells a consumer, and the peer check.

A producer engine (kv_role ``kv_producer``) finishes a prefill and returns
``kv_transfer_params`` in the shape vLLM's NixlConnector uses, so proxies and
routers written for vLLM's P/D forward them unchanged::

    {"do_remote_prefill": True, "do_remote_decode": False,
     "remote_engine_id": ..., "remote_host": ..., "remote_port": ...,
     "remote_block_ids": [slot or block, ...], "remote_request_id": ..., "tp_size": ...,
     "tiercache": {"version": 6, "mode": "via_host" | "direct",
                   "chunk_keys": [hex, ...], "tail_tokens": int, "ends_with_state": bool,
                   "fingerprint": {...}, "release_token": hex}}

``remote_host``/``remote_port`` name the producer's side channel (rank 0;
rank r listens on port + r); ``chunk_keys`` are the prompt's chunk keys the
producer holds for the consumer, in prompt order. In mode ``via_host``
``remote_block_ids`` names the producer's host slot holding each key; in mode
``direct`` it names the producer's KV blocks, ``blocks_per_chunk`` per key, as
vLLM's NixlConnector does (the consumer READs them directly and checks their
tags, see tiercache.pd.channel); for a hybrid model (several KV-cache groups in
the fingerprint's ``kv_groups``) every key, the tail's too, names
``groups * blocks_per_chunk``, group-major, with :data:`NO_BLOCK` (-1) where the
producer holds none (a window group's freed blocks; connector/pd/direct_blocks.py).
``tail_tokens`` > 0 says the last key is the prompt's partial last chunk of that
many tokens (connector/prompt_tail.py): one slot, or the blocks it spans,
``ceil(tail_tokens / block_size)``. ``ends_with_state`` (a state-layer model,
connector/pd/state_handoff.py; never with a tail) says the last key is the
*state key* of the chunk after the others (:meth:`tiercache.keys.KeySpace.state_key`:
that chunk with the recurrent state at its end), the state a consumer resumes
from; the consumer checks it against the state key of its own chunk there. ``fingerprint`` is the producer's key
namespace (model, dtype, layout, block and chunk size, TP size, ...); ``release_token`` is what the consumer's read notice must echo for
the producer to release the hand-off (:func:`tiercache.pd.auth.release_token`:
a forged or replayed-for-another-request notice leaves it held). The consumer
trusts none of these: it reads only from producers its own config trusts
(:mod:`tiercache.pd.trust`), and checks what it read (tags, page hashes). The consumer refuses a hand-off whose fingerprint differs from its
own, naming every difference (:func:`mismatches`), except a TP size that
differs by a ratio tiercache.pd.heads can read head by head
(:func:`tiercache.pd.heads.tp_mismatches`).

Pure data: no vLLM, no NIXL, no sockets.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from tiercache.keys import Namespace

PARAMS_VERSION = 6  # 6: ends_with_state; 5: release_token; 4: tail_tokens (a consumer of another version refuses, and recomputes)
MODES = ("via_host", "direct")
NO_BLOCK = -1  # mode direct, a hybrid model: a key's position the producer holds no block for


class HandoffError(ValueError):
    """Malformed or incompatible hand-off parameters (the consumer then recomputes)."""


def fingerprint(namespace: Namespace) -> dict[str, Any]:
    """What must match between producer and consumer (the process nonce is not shared)."""
    out = asdict(namespace)
    out.pop("process_nonce", None)
    return out


def mismatches(ours: dict[str, Any], theirs: dict[str, Any]) -> list[str]:
    """One line per differing field, e.g. ``kv_dtype: ours torch.bfloat16, peer torch.float32``."""
    lines = []
    for name in sorted(set(ours) | set(theirs)):
        a, b = ours.get(name, "<absent>"), theirs.get(name, "<absent>")
        if a != b:
            lines.append(f"{name}: ours {a!r}, peer {b!r}")
    return lines


@dataclass(frozen=True)
class Handoff:
    """One prompt's chunks held by a producer for a consumer."""

    engine_id: str
    host: str
    port: int  # side channel of the producer's TP rank 0
    request_id: str  # the producer's request id (sent back in the read notification)
    keys: tuple[bytes, ...]
    # via_host: the producer's host slot of each key; direct: its KV blocks, the
    # keys' blocks one after the other (len(keys) * blocks_per_chunk of them)
    slots: tuple[int, ...]
    fingerprint: dict[str, Any]
    tp_size: int = 1
    mode: str = "via_host"
    tail_tokens: int = 0  # > 0: the last key is the prompt's partial last chunk, of this many tokens
    release_token: str = ""  # the read notice's proof that it comes from the consumer given this hand-off
    ends_with_state: bool = False  # the last key is the state key of the chunk after the others

    @property
    def full_keys(self) -> tuple[bytes, ...]:
        """The chunk keys of whole chunks (all but the tail's or the state key)."""
        return self.keys[:-1] if self.tail_tokens or self.ends_with_state else self.keys

    @property
    def state_key(self) -> bytes | None:
        """A state-layer model's last key: the next chunk with the state at its end."""
        return self.keys[-1] if self.ends_with_state else None

    @property
    def tail_key(self) -> bytes | None:
        return self.keys[-1] if self.tail_tokens else None

    def blocks_of(self, blocks_per_chunk: int) -> list[tuple[int, ...]]:
        """Mode direct: the producer's blocks of each key (the tail's: the blocks left over, fewer).

        A hybrid model's key names ``groups * blocks_per_chunk`` (pass that): group-major,
        NO_BLOCK where the producer holds none (connector/pd/direct_blocks.py).
        """
        b = self.slots
        return [tuple(b[i * blocks_per_chunk:(i + 1) * blocks_per_chunk]) for i in range(len(self.keys))]

    def to_params(self) -> dict[str, Any]:
        return {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "remote_engine_id": self.engine_id,
            "remote_host": self.host,
            "remote_port": self.port,
            "remote_block_ids": list(self.slots),
            "remote_request_id": self.request_id,
            "tp_size": self.tp_size,
            "tiercache": {
                "version": PARAMS_VERSION,
                "mode": self.mode,
                "chunk_keys": [k.hex() for k in self.keys],
                "tail_tokens": self.tail_tokens,
                "ends_with_state": self.ends_with_state,
                "fingerprint": dict(self.fingerprint),
                "release_token": self.release_token,
            },
        }

    @classmethod
    def from_params(cls, params: dict[str, Any]) -> Handoff | None:
        """The hand-off in ``params``; None when they are not a tiercache remote prefill.

        Raises HandoffError (naming the field) when they claim to be one but are malformed.
        """
        if not isinstance(params, dict) or not params.get("do_remote_prefill"):
            return None
        ours = params.get("tiercache")
        if ours is None:
            return None  # another connector's hand-off: not ours to read
        try:
            if not isinstance(ours, dict) or ours.get("version") != PARAMS_VERSION:
                raise HandoffError(f"tiercache.version: expected {PARAMS_VERSION}, got {ours!r:.80}")
            keys = tuple(bytes.fromhex(k) for k in ours["chunk_keys"])
            mode = ours.get("mode", "via_host")
            if mode not in MODES:
                raise HandoffError(f"tiercache.mode: expected one of {MODES}, got {mode!r:.40}")
            slots = tuple(int(s) for s in params["remote_block_ids"])
            fp = ours["fingerprint"]
            if not isinstance(fp, dict):
                raise HandoffError("tiercache.fingerprint: not a mapping")
            tail_tokens = int(ours.get("tail_tokens", 0))
            chunk_tokens, block_size = int(fp.get("chunk_tokens", 0)), int(fp.get("block_size", 0))
            if tail_tokens and not (keys and 0 < tail_tokens < chunk_tokens):
                raise HandoffError(f"tiercache.tail_tokens: expected 1..{chunk_tokens - 1} after a key, "
                                   f"got {tail_tokens}")
            ends_with_state = ours.get("ends_with_state", False)
            if not isinstance(ends_with_state, bool) or (ends_with_state and (tail_tokens or not keys)):
                raise HandoffError(f"tiercache.ends_with_state: expected a bool, true only after a key and "
                                   f"without a tail, got {ends_with_state!r:.40}")
            groups = group_count(str(fp.get("kv_groups", "")))
            expected = _slots_expected(mode, len(keys), tail_tokens, chunk_tokens, block_size, groups)
            lowest = NO_BLOCK if mode == "direct" and groups > 1 else 0
            if len(slots) != expected or any(s < lowest for s in slots):
                raise HandoffError(f"remote_block_ids: expected {'one slot' if mode == 'via_host' else 'the blocks'}"
                                   f" per chunk key ({len(keys)} keys, {expected} numbers >= {lowest}), "
                                   f"got {list(slots)!r:.80}")
            port = int(params["remote_port"])
            if not 0 < port < 65536:
                raise HandoffError(f"remote_port: {port} out of range")
            host = params["remote_host"]
            if not isinstance(host, str) or not 0 < len(host) <= 255:
                raise HandoffError("remote_host: expected a host name or address")
            token = ours.get("release_token", "")
            if not isinstance(token, str) or len(token) > 128:
                raise HandoffError("tiercache.release_token: expected a hex string")
            return cls(
                engine_id=str(params["remote_engine_id"]),
                host=host,
                port=port,
                request_id=str(params["remote_request_id"]),
                keys=keys,
                slots=slots,
                fingerprint=fp,
                tp_size=int(params.get("tp_size", 1)),
                mode=mode,
                tail_tokens=tail_tokens,
                release_token=token,
                ends_with_state=ends_with_state,
            )
        except HandoffError:
            raise
        except (KeyError, TypeError, ValueError) as exc:
            raise HandoffError(f"malformed tiercache hand-off parameters: {type(exc).__name__}: {exc}") from exc


def group_count(kv_groups: str) -> int:
    """How many KV-cache groups a namespace's ``kv_groups`` field describes ("" is one full group)."""
    return len(kv_groups.split(",")) if kv_groups else 1


def _slots_expected(mode: str, keys: int, tail_tokens: int, chunk_tokens: int, block_size: int,
                    groups: int = 1) -> int:
    """How many ``remote_block_ids`` a hand-off of ``keys`` keys names (HandoffError: a bad fingerprint)."""
    if mode == "via_host":
        return keys
    if block_size <= 0 or chunk_tokens <= 0 or chunk_tokens % block_size:
        raise HandoffError(f"tiercache.fingerprint: chunk_tokens {chunk_tokens} is not a multiple of "
                           f"block_size {block_size}")
    if groups > 1:  # every key, the tail's too, names groups * blocks_per_chunk (NO_BLOCK where none)
        return keys * groups * (chunk_tokens // block_size)
    if not tail_tokens:
        return keys * (chunk_tokens // block_size)
    return (keys - 1) * (chunk_tokens // block_size) + -(-tail_tokens // block_size)
