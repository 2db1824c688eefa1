"""Cache poisoning through a shared cache server: a writer without the MAC key cannot make a chunk load.

The threat: another client of the server (a second token of the same tenant
space, a compromised engine, whoever runs or breaks into the server) replaces
the value of a chunk an engine stored. Without end-to-end integrity the engine
loaded whatever came back as that chunk's KV. Now the server tier stores
frames (tiercache/integrity.py) and verifies them on load; with a ``mac_key``
only frames written with the same key load.

Everything is real: one ``tiercache serve`` subprocess on loopback with two
tokens of one tenant space (``engine`` and ``intruder``: they share chunks, so
the intruder *can* overwrite the engine's, which is the point), the tier
(:class:`ServerBackend`) against it over real sockets, the intruder a raw
:class:`ServerClient`. Over TCP, and over NIXL when it works here.

* engine-less: every forgery an intruder without the key can make (an xxh3
  frame of its own bytes, a MAC frame under its own key, raw bytes, the
  engine's valid frame of another key replayed) is a failed key, counted in
  ``checksum_failures``, the view zeroed or untouched. Negative controls: the
  same overwrite framed *with* the key loads the intruder's bytes; and
  without a ``mac_key`` an xxh3 frame of the intruder's bytes loads (xxh3
  stops damage, not a writer).
* one real engine (vLLM, tiny random-weight model, float32): it stores a
  prompt with a ``mac_key``; the intruder overwrites one chunk with noised KV
  framed without the key; the engine's next run recomputes that chunk and its
  greedy tokens equal a run without tiercache. Negative control, in the same
  engine process: the same overwrite framed with the key loads, and the tokens
  change.
"""

from __future__ import annotations

import pathlib
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
from tiercache.backends.server.backend import ServerBackend, ServerSettings

from tests.e2e.conftest import engine_spec
from tests.server.harness import ServerProcess, free_port
from tiercache.backend import BackendContext
from tiercache.integrity import MacKey, compact_header_len, encode_frame, read_header
from tiercache.server import protocol as p
from tiercache.server.client import ServerClient
from tiercache.server.nixl_path import nixl_available
from tiercache.server.tenants import SPACE_BYTES
from tiercache.testing.conformance import SENTINEL, make_key, make_payload, wait_for_jobs
from tiercache.testing.engine_runner import EngineRun, random_prompts, run_engine
from tiercache.testing.random_llama import make_model_dir

CHUNK = 16 * 1024
NS = b"poison-n"
MAC_SECRET = "the-engines-own-mac-secret-0123"
INTRUDER_SECRET = "the-intruders-guess-at-a-secret"
TOKENS = {"engine": "token-of-the-engine-0123456789", "intruder": "token-of-the-intruder-012345"}
DATA_PATHS = ["tcp", *(["nixl"] if nixl_available() else [])]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    tenants = [{"name": "engine", "token": TOKENS["engine"]},
               {"name": "intruder", "token": TOKENS["intruder"], "space": "engine"}]
    proc = ServerProcess(tmp_path_factory.mktemp("poison"), tenants=tenants, max_value_bytes=CHUNK,
                         nixl="auto" if nixl_available() else "off",
                         tiers=[{"name": "cpu", "backend": "cpu", "capacity": "8MiB"}]).start()
    yield proc
    proc.kill()
    assert "internal" not in proc.log(), proc.log()


class Tier:
    """One ServerBackend (an engine's server tier) and its jobs, from the test's thread."""

    def __init__(self, server: ServerProcess, mac_key: str | None, data_path: str = "tcp") -> None:
        settings = ServerSettings(address=server.address, token=TOKENS["engine"], mac_key=mac_key,
                                  data_path=data_path, overwrite=True)
        context = BackendContext(tier_name="server", namespace=NS, chunk_bytes=CHUNK, capacity_bytes=1 << 30)
        self.backend = ServerBackend(settings, context)
        self._job = 0

    def put(self, chunks: dict[bytes, bytes]) -> None:
        self._job += 1
        self.backend.submit_put(self._job, list(chunks), [memoryview(v) for v in chunks.values()])
        assert wait_for_jobs(self.backend, [self._job])[self._job].ok

    def get(self, keys: list[bytes]) -> tuple[tuple[bytes, ...], dict[bytes, bytes]]:
        """The failed keys, and what each view held after the job."""
        self._job += 1
        views = [bytearray([SENTINEL]) * CHUNK for _ in keys]
        self.backend.submit_get(self._job, keys, [memoryview(v) for v in views])
        result = wait_for_jobs(self.backend, [self._job])[self._job]
        return result.failed_keys, {k: bytes(v) for k, v in zip(keys, views)}

    def close(self) -> None:
        self.backend.close()


def chunks(first: int, n: int, version: int = 0) -> dict[bytes, bytes]:
    keys = [NS + make_key(i)[len(NS):] for i in range(first, first + n)]
    return {k: make_payload(k, CHUNK, version) for k in keys}


def overwrite(server: ServerProcess, key: bytes, value: bytes, timeout_s: float = 30.0) -> None:
    """The intruder replaces ``key``'s value (delete, then put: whatever the overwrite policy).

    FULL and BUSY mean "not now" (every host slot pinned or being written, or the key
    still being copied down to the server's disk tier right after the engine's stores):
    the put is asked again until ``timeout_s``. Seen once in a full run on a loaded machine.
    """
    deadline = time.monotonic() + timeout_s
    with ServerClient(server.address, token=TOKENS["intruder"], client_name="intruder") as raw:
        while True:
            raw.delete([key])
            status = raw.put([key], [value])
            if status not in ([p.Status.BUSY], [p.Status.FULL]) or time.monotonic() > deadline:
                break
            time.sleep(0.1)  # polling the server's own answer, not timing a race
        assert status == [p.Status.OK], status


def stored_frame(server: ServerProcess, key: bytes, room: int = CHUNK) -> bytes:
    """The value stored under ``key`` (a frame of at most ``room`` payload bytes), read by the intruder."""
    with ServerClient(server.address, token=TOKENS["intruder"], client_name="intruder") as raw:
        frame = bytearray(compact_header_len(len(key)) + room)
        statuses, sizes = raw.get([key], [memoryview(frame)])
        assert statuses == [p.Status.OK], statuses
    return bytes(frame[: sizes[0]])


def forgeries(key: bytes, other: bytes, server: ServerProcess) -> dict[str, bytes]:
    """What an intruder without the engine's key can write as ``key``'s value."""
    evil = make_payload(key, CHUNK, version=66)
    return {
        "xxh3 frame": encode_frame(NS, key, evil),
        "own key": encode_frame(NS, key, evil, mac=MacKey(INTRUDER_SECRET)),
        "raw bytes": evil,
        "replayed frame of another key": stored_frame(server, other),
    }


@pytest.mark.parametrize("data_path", DATA_PATHS)
def test_forged_chunks_are_refused_and_counted(server: ServerProcess, data_path: str) -> None:
    tier = Tier(server, MAC_SECRET, data_path)
    try:
        good = chunks(0, 6)
        keys = list(good)
        tier.put(good)
        attacks = forgeries(keys[0], keys[5], server)
        for key, (name, value) in zip(keys, attacks.items()):
            overwrite(server, key, value)
        failed, got = tier.get(keys)
        assert failed == tuple(keys[: len(attacks)]), list(attacks)
        for key in keys[: len(attacks)]:
            assert got[key] in (bytes(CHUNK), bytes([SENTINEL]) * CHUNK)  # zeroed (TCP) or untouched
        for key in keys[len(attacks):]:
            assert got[key] == good[key]  # the rest of the job is unharmed
        stats = tier.backend.stats()
        assert stats["checksum_failures"] == len(attacks) and stats["get_failures"] == len(attacks)
    finally:
        tier.close()


def test_negative_control_a_writer_with_the_key_does_poison(server: ServerProcess) -> None:
    """The refusals above are the MAC's doing: the same overwrite framed with the key loads."""
    tier = Tier(server, MAC_SECRET)
    try:
        good = chunks(100, 2)
        key = next(iter(good))
        tier.put(good)
        evil = make_payload(key, CHUNK, version=66)
        overwrite(server, key, encode_frame(NS, key, evil, mac=MacKey(MAC_SECRET)))
        failed, got = tier.get(list(good))
        assert failed == () and got[key] == evil  # the poisoned bytes reached the caller's buffer
        assert tier.backend.stats()["checksum_failures"] == 0
    finally:
        tier.close()


def test_negative_control_without_a_mac_key_an_xxh3_frame_poisons(server: ServerProcess) -> None:
    """xxh3 frames stop damage and foreign values (raw bytes are still refused), not a writer."""
    tier = Tier(server, None)
    try:
        good = chunks(200, 3)
        keys = list(good)
        tier.put(good)
        evil = make_payload(keys[0], CHUNK, version=66)
        overwrite(server, keys[0], encode_frame(NS, keys[0], evil))
        overwrite(server, keys[1], evil)  # unframed: what any client could write before framing
        failed, got = tier.get(keys)
        assert failed == (keys[1],) and got[keys[0]] == evil and got[keys[2]] == good[keys[2]]
        assert tier.backend.stats()["checksum_failures"] == 1
    finally:
        tier.close()


def test_engines_sharing_the_key_share_chunks_and_keyless_ones_refuse_them(server: ServerProcess) -> None:
    writer, reader, keyless = Tier(server, MAC_SECRET), Tier(server, MAC_SECRET), Tier(server, None)
    try:
        good = chunks(300, 3)
        writer.put(good)
        failed, got = reader.get(list(good))
        assert failed == () and got == good  # two engines, one secret: they share
        failed, _ = keyless.get(list(good))
        assert failed == tuple(good)  # a tier without the key cannot check MAC frames: refused
        assert keyless.backend.stats()["checksum_failures"] == 3
    finally:
        for tier in (writer, reader, keyless):
            tier.close()


# ---------------------------------------------------------------------------- a real engine
ENGINE_CHUNK = 128  # tokens per chunk: a 400-token prompt stores 3 chunks
PROMPTS = random_prompts(1, 400, seed=57)


def engine_rounds() -> list[dict[str, Any]]:
    plain = {"prompts": PROMPTS, "max_tokens": 10, "sequential": True}
    after = {**plain, "reset_prefix_cache_before": True, "reset_connector": True}  # hits: the server's
    return [plain, {**after, "barrier": "unkeyed"}, {**after, "barrier": "keyed"}]


def tokens(result: dict[str, Any], rnd: int) -> list[list[int]]:
    return [r["output_token_ids"] for r in result["rounds"][rnd]["requests"]]


def metric(result: dict[str, Any], rnd: int, name: str, label: str) -> float:
    samples = result["rounds"][rnd]["tiercache_metrics"]
    return sum(v for k, v in samples.items() if k.startswith(name) and label in k)


def stored_key(disk_root: pathlib.Path, want: int, timeout_s: float = 120.0) -> bytes:
    """A chunk key the engine stored, once ``want`` are on the server (its disk tier names files
    after the store's keys: the tenant space, then the engine's key)."""
    deadline = time.monotonic() + timeout_s
    while True:
        names = sorted(f.name.removesuffix(".chunk") for f in disk_root.rglob("*.chunk"))
        if len(names) >= want:
            return bytes.fromhex(names[0])[SPACE_BYTES:]
        assert time.monotonic() < deadline, f"{len(names)} chunks on the server, waited for {want}"
        time.sleep(0.2)  # polling an observable condition (files), not timing a race


def noised(frame: bytes) -> tuple[bytes, bytes]:
    """The namespace and a noised copy of the KV in a stored frame (values changed, shape kept)."""
    head = read_header(frame)
    kv = np.frombuffer(frame, np.float32, offset=head.header_len).copy()
    kv += np.random.default_rng(7).standard_normal(kv.size).astype(np.float32)
    return head.namespace, kv.tobytes()


@pytest.mark.e2e
def test_engine_recomputes_a_chunk_forged_without_the_key(tmp_path_factory: pytest.TempPathFactory) -> None:
    tmp = tmp_path_factory.mktemp("poison-engine")
    model = make_model_dir("tiny", tmp / "models")
    tenants = [{"name": "engine", "token": TOKENS["engine"]},
               {"name": "intruder", "token": TOKENS["intruder"], "space": "engine"}]
    server = ServerProcess(tmp / "srv", port=free_port(), tenants=tenants, max_value_bytes=4 << 20,
                           tiers=[{"name": "cpu", "backend": "cpu", "capacity": "256MiB"},
                                  {"name": "disk", "backend": "disk", "capacity": "256MiB",
                                   "options": {"root": str(tmp / "srv-disk"), "fsync": "batch"}}]).start()
    tier = {"name": "server", "backend": "server", "capacity": "1GiB",
            "options": {"address": server.address, "token": TOKENS["engine"], "mac_key": MAC_SECRET,
                        "data_path": "tcp", "timeout_s": 5, "backoff_max_s": 0.5}}
    try:
        baseline = run_engine(engine_spec(model, ENGINE_CHUNK, None, engine_rounds()[:1]),
                              timeout_s=400, workdir=tmp / "baseline")
        run = EngineRun(engine_spec(model, ENGINE_CHUNK, [tier], engine_rounds()), tmp / "engine")
        try:
            run.wait_for("unkeyed", timeout_s=400)
            key = stored_key(tmp / "srv-disk", want=3)
            namespace, evil = noised(stored_frame(server, key, 4 << 20))
            overwrite(server, key, encode_frame(namespace, key, evil))  # the intruder has no key
            run.release("unkeyed")
            run.wait_for("keyed", timeout_s=400)
            overwrite(server, key, encode_frame(namespace, key, evil, mac=MacKey(MAC_SECRET)))
            run.release("keyed")
            result = run.result(timeout_s=400)
        finally:
            run.kill()
    finally:
        server.kill()
    failed = [metric(result, r, "tiercache_failed_chunks_total", 'op="load"') for r in range(3)]
    hits = [metric(result, r, "tiercache_hit_tokens_total", 'tier="server"') for r in range(3)]
    assert tokens(result, 0) == tokens(baseline, 0)
    # the forged chunk was refused on load (one failed chunk), recomputed: tokens exact
    assert failed[1] - failed[0] == 1 and hits[1] > hits[0], (failed, hits)
    assert tokens(result, 1) == tokens(baseline, 0)
    # negative control: the same bytes framed with the key load (no failure), and the tokens change
    assert failed[2] == failed[1] and hits[2] - hits[1] >= 3 * ENGINE_CHUNK, (failed, hits)
    assert tokens(result, 2) != tokens(baseline, 0)


def test_a_refused_chunk_is_replaced_by_the_engines_next_store(server: ServerProcess) -> None:
    """overwrite false (the default): a forged chunk costs one recompute, not a miss until eviction."""
    settings = ServerSettings(address=server.address, token=TOKENS["engine"], mac_key=MAC_SECRET)
    assert settings.overwrite is False
    tier = Tier(server, MAC_SECRET)
    tier.backend.close()
    tier.backend = ServerBackend(settings, BackendContext(tier_name="server", namespace=NS, chunk_bytes=CHUNK,
                                                          capacity_bytes=1 << 30))
    try:
        good = chunks(400, 2)
        keys = list(good)
        tier.put(good)
        overwrite(server, keys[0], encode_frame(NS, keys[0], make_payload(keys[0], CHUNK, version=66)))
        failed, _ = tier.get(keys)
        assert failed == (keys[0],)
        tier.put({keys[1]: good[keys[1]]})  # a store of another key: the forged one stays refused
        assert tier.get(keys)[0] == (keys[0],)
        tier.put(good)  # the engine recomputed and stores again: this store replaces the forgery
        failed, got = tier.get(keys)
        assert failed == () and got == good
        stats = tier.backend.stats()
        assert stats["replaced"] == 1 and stats["checksum_failures"] == 2
    finally:
        tier.close()
