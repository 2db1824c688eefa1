"""A stranger process on the P/D side channel: tries to learn the producer's memory and READ or WRITE it.

Run as ``python -m tests.adversarial.pd_stranger PORT SLAB_ADDR SLOT_BYTES SECRET_HEX FINGERPRINT_JSON``
(``-`` for no secret; the fingerprint as a client could read it in ``kv_transfer_params``). It speaks the side channel's handshake with the secret it is given,
records every byte the producer sent, and, if the answer gave it agent
metadata, loads that agent into a NIXL agent of its own and READs the
producer's first slot, then WRITEs a pattern over it. Without metadata it
still tries the READ and the WRITE against the producer's slab address (as
if it had guessed it). Prints one JSON line: what it received and what worked.
"""

from __future__ import annotations

import json
import socket
import sys

import numpy as np

from tiercache.pd import auth
from tiercache.pd.channel import make_agent, recv_message, send_message

PATTERN = 0x5A


def _transfer(agent, op: str, buf: np.ndarray, remote: int, size: int, peer: str) -> str:  # type: ignore[no-untyped-def]
    try:
        handle = agent.initialize_xfer(op, agent.get_xfer_descs([(int(buf.ctypes.data), size, 0)], "DRAM"),
                                       agent.get_xfer_descs([(remote, size, 0)], "DRAM"), peer)
        state = agent.transfer(handle)
        for _ in range(1_000_000):
            if state in ("DONE", "ERR"):
                break
            state = agent.check_xfer_state(handle)
        agent.release_xfer_handle(handle)
        return "ok" if state == "DONE" else f"state {state}"
    except Exception as exc:
        return f"refused: {type(exc).__name__}"


def main(port: int, slab_addr: int, slot_bytes: int, key: bytes, fingerprint: dict) -> dict:
    received: list[bytes] = []
    answer: dict = {}
    with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
        ours = auth.new_nonce()
        send_message(sock, {"op": "hello", "nonce": ours})
        challenge = recv_message(sock)
        received.append(repr(challenge).encode())
        theirs = challenge.get("nonce", b"")
        send_message(sock, {"op": "prove", "proof": auth.consumer_proof(key, ours, theirs),
                            "fingerprint": fingerprint})
        try:
            answer = recv_message(sock)
            received.append(repr(answer).encode())
        except Exception:
            pass
        sock.settimeout(0.5)
        try:
            received.append(sock.recv(1 << 20))
        except OSError:
            pass
    agent = make_agent("stranger")
    buf = np.zeros(slot_bytes, dtype=np.uint8)
    reg = agent.register_memory([(int(buf.ctypes.data), buf.nbytes, 0, "")], "DRAM")
    peer = "tiercache-producer"  # its name is unknown without the answer: a guess
    if "metadata" in answer:
        peer = agent.add_remote_agent(bytes(answer["metadata"]))
        peer = peer.decode() if isinstance(peer, bytes) else str(peer)
    read = _transfer(agent, "READ", buf, slab_addr, slot_bytes, peer)
    got = buf.tobytes()
    buf[:] = PATTERN
    wrote = _transfer(agent, "WRITE", buf, slab_addr, slot_bytes, peer)
    agent.deregister_memory(reg)
    return {"received": b"".join(received).hex(), "answer_keys": sorted(answer), "read": read, "wrote": wrote,
            "read_sum": int(np.frombuffer(got, dtype=np.uint8).sum(dtype=np.int64)) if read == "ok" else -1}


if __name__ == "__main__":
    port_, addr_, size_, secret_, fp_ = sys.argv[1:6]
    print(json.dumps(main(int(port_), int(addr_), int(size_), b"" if secret_ == "-" else bytes.fromhex(secret_),
                          json.loads(fp_))))
