"""The P/D side channel's security pieces without sockets: proofs, release tokens, the config rules, trust, page hashes.

Each check has its negative control beside it: the proof with the right key
and nonces passes, the token for the right request releases, the trusted
address is trusted, the untouched bytes hash equal.
"""

from __future__ import annotations

import pytest
import torch

from tiercache.config.pd import PDConfig, is_loopback, parse_producer
from tiercache.config.schema import ConfigError, load_config
from tiercache.layout import KVBlockLayout, slab_planes
from tiercache.pd import auth
from tiercache.pd.blocks import BlockRegions
from tiercache.pd.page_hashes import block_hash, slot_hashes
from tiercache.pd.trust import ProducerTrust

KEY = b"0123456789abcdef0123456789abcdef"
SECRET = "correct horse battery staple 42"


# ---------------------------------------------------------------- proofs
def test_a_proof_holds_only_for_its_key_its_nonces_and_its_direction() -> None:
    cn, pn = auth.new_nonce(), auth.new_nonce()
    proof = auth.consumer_proof(KEY, cn, pn)
    assert auth.proof_matches(auth.consumer_proof(KEY, cn, pn), proof)  # control: the right one passes
    assert not auth.proof_matches(auth.consumer_proof(b"x" + KEY[1:], cn, pn), proof)  # another key
    assert not auth.proof_matches(auth.consumer_proof(KEY, auth.new_nonce(), pn), proof)  # another connection
    assert not auth.proof_matches(auth.producer_proof(KEY, cn, pn), proof)  # reflected back as the producer's
    assert not auth.proof_matches(auth.consumer_proof(b"", cn, pn), proof)  # no secret at all


def test_proof_matches_refuses_anything_but_a_digest() -> None:
    good = auth.consumer_proof(KEY, b"a" * 32, b"b" * 32)
    for junk in (None, "", good.hex(), good[:-1], good + b"\0", 7, [good]):
        assert not auth.proof_matches(good, junk)
    assert auth.valid_nonce(b"n" * auth.NONCE_BYTES)
    assert not any(auth.valid_nonce(x) for x in (b"n" * 31, "n" * 32, None, 3))
    assert auth.new_nonce() != auth.new_nonce()


# ---------------------------------------------------------------- release tokens
def test_a_release_token_releases_its_request_only() -> None:
    key = auth.new_release_key()
    token = auth.release_token(key, "req-1")
    assert auth.token_matches(key, "req-1", token)  # control
    assert not auth.token_matches(key, "req-2", token)  # another hand-off
    assert not auth.token_matches(auth.new_release_key(), "req-1", token)  # another producer engine
    assert not auth.token_matches(None, "req-1", token)  # the worker has no key yet
    for junk in ("", None, token[:-1], token.upper() + "0", b"x" * 32, 12):
        assert not auth.token_matches(key, "req-1", junk)


# ---------------------------------------------------------------- config
def test_a_non_loopback_side_channel_needs_a_secret() -> None:
    with pytest.raises(ConfigError, match=r"pd\.secret: .*required when pd\.host \(0\.0\.0\.0\)"):
        load_config(pd={"host": "0.0.0.0"})
    for host in ("10.0.0.5", "prefill-1.internal", "::"):
        with pytest.raises(ConfigError, match=r"pd\.secret"):
            load_config(pd={"host": host})
    assert load_config(pd={"host": "0.0.0.0", "secret": SECRET}).pd.secret_key() == SECRET.encode()  # control
    assert load_config(pd={"host": "127.0.0.1"}).pd.secret_key() == b""  # loopback: no secret needed


def test_the_secret_is_never_shown(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    for bad in ({"secret": "short-secret"}, {"secret": SECRET, "secret_file": str(tmp_path / "f")},
                {"secret": SECRET, "port": "not a port"}, {"secret": SECRET, "host": "0.0.0.0", "mode": "x"}):
        with pytest.raises(ConfigError) as err:
            load_config(pd=bad)
        assert "short-secret" not in str(err.value) and SECRET not in str(err.value)
    cfg = load_config(pd={"secret": SECRET})
    assert SECRET not in repr(cfg) and SECRET not in str(cfg.pd) and SECRET not in repr(cfg.model_dump())
    monkeypatch.setenv("TIERCACHE_PD__SECRET", SECRET)  # the env works through the settings
    assert load_config(pd={"host": "10.1.1.1"}).pd.secret_key() == SECRET.encode()


def test_a_secret_file(tmp_path) -> None:
    path = tmp_path / "pd.secret"
    path.write_text(SECRET + "\nignored\n")
    assert load_config(pd={"host": "0.0.0.0", "secret_file": str(path)}).pd.secret_key() == SECRET.encode()
    path.write_text("tiny\n")
    with pytest.raises(ConfigError, match="pd.secret_file: .*fewer than 16") as err:
        load_config(pd={"secret_file": str(path)})
    assert "tiny" not in str(err.value)
    with pytest.raises(ConfigError, match="pd.secret_file: cannot read"):
        load_config(pd={"secret_file": str(tmp_path / "missing")})


def test_trusted_producers_are_checked_at_start_up() -> None:
    assert parse_producer("10.0.0.1:5700") == ("10.0.0.1", 5700)
    assert parse_producer("Prefill-1.Internal") == ("prefill-1.internal", None)
    assert parse_producer("[::1]:80") == ("::1", 80) and parse_producer("fe80::1") == ("fe80::1", None)
    for bad in ("h:0", "h:x", "", "a b", "[::1]x"):
        with pytest.raises(ConfigError, match="pd.trusted_producers"):
            load_config(pd={"trusted_producers": [bad]})
    assert PDConfig(trusted_producers=("h:1",)).trusted_producers == ("h:1",)


def test_loopback() -> None:
    assert all(is_loopback(h) for h in ("127.0.0.1", "127.9.9.9", "::1", "[::1]", "localhost", "LOCALHOST"))
    assert not any(is_loopback(h) for h in ("0.0.0.0", "::", "10.0.0.1", "localhost.evil.example", "", "1"))


# ---------------------------------------------------------------- trust
def test_whom_a_consumer_trusts() -> None:
    listed = ProducerTrust(["10.0.0.7:5700", "prefill-2"], has_secret=True)
    assert listed.why_not("10.0.0.7", 5700) is None and listed.why_not("PREFILL-2", 1234) is None  # controls
    assert "not in pd.trusted_producers" in (listed.why_not("10.0.0.7", 5701) or "")
    assert listed.why_not("10.0.0.8", 5700) and listed.why_not("127.0.0.1", 5700)  # the list rules, loopback too
    assert ProducerTrust([], has_secret=True).why_not("10.9.9.9", 1) is None  # proven by the secret instead
    bare = ProducerTrust([], has_secret=False)
    assert bare.why_not("127.0.0.1", 5700) is None and bare.why_not("::1", 5700) is None
    why = bare.why_not("evil.example\nFAKE LOG LINE", 5700) or ""
    assert "loopback" in why and "\n" not in why  # the address is shown quoted


# ---------------------------------------------------------------- page hashes
def test_page_hashes_agree_between_a_producer_slot_and_the_consumer_blocks_it_lands_in() -> None:
    bpc, blocks = 2, 8
    kv = {f"layer.{i}": torch.randint(-9, 9, (2, blocks, 16, 2, 8)).float() for i in range(2)}
    layout = KVBlockLayout.from_kv_caches(kv, blocks)
    ours = BlockRegions.from_layout(layout)
    slot = layout.slot_bytes(bpc)
    for planes_layout in (False, True):
        slab = torch.zeros((4, slot), dtype=torch.uint8)
        planes = slab_planes(slab, layout.page_bytes, bpc) if planes_layout else None
        for r, region in enumerate(layout.regions):  # blocks 5, 2 -> slot 3, positions 0, 1
            for pos, block in enumerate((5, 2)):
                if planes is not None:
                    planes[r][3 * bpc + pos].copy_(region[block])
                else:
                    off = layout.region_offsets(bpc)[r] + pos * layout.page_bytes[r]
                    slab[3, off:off + layout.page_bytes[r]].copy_(region[block])
        got = slot_hashes(3, slab.data_ptr(), slot, layout.page_bytes,
                          BlockRegions.from_planes(planes) if planes is not None else None)
        assert got == [block_hash(ours, 5), block_hash(ours, 2)]  # control: equal bytes, equal hashes
        assert block_hash(ours, 5) != block_hash(ours, 2)
        layout.regions[1][2][7] ^= 1  # one bit of one page of block 2
        assert block_hash(ours, 2) != got[1] and block_hash(ours, 5) == got[0]
        layout.regions[1][2][7] ^= 1
