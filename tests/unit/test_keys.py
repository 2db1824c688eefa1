"""Chunk keys: layout, chunking of block hashes, and what the namespace separates."""

from __future__ import annotations

import dataclasses
import hashlib

import pytest

from tiercache.keys import KeySpace, Namespace, split_key


def ns(**changes: object) -> Namespace:
    base = Namespace(
        model="m", kv_dtype="torch.float32", kv_layout="default", block_size=32, chunk_tokens=128,
        tp_size=1, bytes_per_chunk=1 << 19, hash_algo="sha256",
    )
    return dataclasses.replace(base, **changes)  # type: ignore[arg-type]


def hashes(n: int) -> list[bytes]:
    return [hashlib.sha256(str(i).encode()).digest() for i in range(n)]


def test_key_layout_and_split() -> None:
    space = KeySpace(ns(), blocks_per_chunk=4)
    h = hashes(8)
    keys = space.chunk_keys(h)
    assert len(keys) == 2
    digest, prefix, group = split_key(keys[1])
    assert digest == space.digest and len(digest) == 8
    assert prefix == h[7] and group == 0  # the chunk's last block hash covers its prefix
    assert space.chunk_key(h[3], group_idx=3)[-4:] == (3).to_bytes(4, "big")
    assert space.chunk_key(h[3], group_idx=300)[-4:] == (300).to_bytes(4, "big")


def test_partial_chunks_have_no_key_and_start_chunk() -> None:
    space = KeySpace(ns(), blocks_per_chunk=4)
    assert space.chunk_keys(hashes(3)) == []
    assert space.chunk_keys(hashes(11), start_chunk=1) == space.chunk_keys(hashes(11))[1:]


@pytest.mark.parametrize(
    "change",
    [{"model": "other"}, {"kv_dtype": "torch.bfloat16"}, {"block_size": 16}, {"tp_size": 2},
     {"bytes_per_chunk": 1}, {"hash_algo": "sha256_cbor"}, {"tenant_salt": "t"}, {"chunk_tokens": 256}],
)
def test_namespace_separates_incompatible_engines(change: dict) -> None:
    assert ns().digest() != ns(**change).digest()
    assert ns().digest() == ns().digest()  # stable across calls and processes


def test_process_random_hashes_get_a_nonce(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    assert Namespace.hash_algo_nonce("sha256") == ""
    nonce = Namespace.hash_algo_nonce("xxhash")
    assert nonce and not ns(process_nonce=nonce).stable_across_processes
    monkeypatch.setenv("PYTHONHASHSEED", "0")
    assert Namespace.hash_algo_nonce("xxhash") == ""


def test_split_key_rejects_short() -> None:
    with pytest.raises(ValueError):
        split_key(b"short")
