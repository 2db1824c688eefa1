"""Test certificates made with the ``openssl`` command: a throwaway CA, a server and a client.

:func:`make_certs` writes, into a directory of the test's own, a self-signed
CA (``ca.crt``), a server certificate for ``localhost`` and ``127.0.0.1``
(``server.crt``/``server.key``) and a client certificate (``client.crt``/
``client.key``), both signed by the CA, plus a second, unrelated CA
(``other-ca.crt``) for tests that must see verification fail. Keys are P-256
(fast to make), certificates last two days. Without ``openssl`` on PATH the
calling test skips.

Used by the Redis tier's TLS tests (tests/integration/redis_servers.py); any
test that needs a CA-signed loopback server may use it.
"""

from __future__ import annotations

import dataclasses
import pathlib
import shutil
import subprocess

import pytest

#: Subject alternative names of the server certificate: what a client may call it.
SERVER_NAMES = ("localhost", "127.0.0.1")
#: Subject alternative name of a certificate that fits none of SERVER_NAMES.
WRONG_NAME = "redis.invalid"


@dataclasses.dataclass(frozen=True)
class CertFiles:
    """Paths of one test PKI (see the module docstring)."""

    ca: pathlib.Path
    server_cert: pathlib.Path
    server_key: pathlib.Path
    client_cert: pathlib.Path
    client_key: pathlib.Path
    other_ca: pathlib.Path
    wrong_name_cert: pathlib.Path
    wrong_name_key: pathlib.Path


def require_openssl() -> str:
    found = shutil.which("openssl")
    if found is None:
        pytest.skip("the openssl command is not on PATH (apt-get install openssl)")
    return found


def make_certs(directory: pathlib.Path) -> CertFiles:
    """Make a CA, a server and a client certificate under ``directory`` (created)."""
    openssl = require_openssl()
    directory.mkdir(parents=True, exist_ok=True)

    def run(*args: str) -> None:
        proc = subprocess.run([openssl, *args], cwd=directory, capture_output=True, text=True,
                              timeout=30, check=False)
        if proc.returncode != 0:
            raise RuntimeError(f"openssl {' '.join(args)}: {proc.stderr}")

    def make_ca(name: str) -> None:
        run("req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1",
            "-nodes", "-days", "2", "-subj", f"/CN=tiercache test {name}",
            "-addext", "basicConstraints=critical,CA:TRUE",
            "-addext", "keyUsage=critical,keyCertSign,cRLSign",
            "-keyout", f"{name}.key", "-out", f"{name}.crt")

    def make_leaf(name: str, san: str, usage: str) -> None:
        run("req", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
            "-subj", f"/CN=tiercache test {name}", "-keyout", f"{name}.key", "-out", f"{name}.csr")
        (directory / f"{name}.ext").write_text(
            f"subjectAltName={san}\nextendedKeyUsage={usage}\n"
            "basicConstraints=critical,CA:FALSE\nkeyUsage=critical,digitalSignature\n"
            "authorityKeyIdentifier=keyid,issuer\nsubjectKeyIdentifier=hash\n"
        )
        run("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.crt", "-CAkey", "ca.key",
            "-CAcreateserial", "-days", "2", "-extfile", f"{name}.ext", "-out", f"{name}.crt")

    make_ca("ca")
    make_ca("other-ca")
    names = ",".join(f"IP:{n}" if n[0].isdigit() else f"DNS:{n}" for n in SERVER_NAMES)
    # Redis uses its server certificate for the cluster bus too (both ends): client use as well.
    make_leaf("server", names, "serverAuth,clientAuth")
    make_leaf("client", "DNS:tiercache-client", "clientAuth")
    make_leaf("wrong-name", f"DNS:{WRONG_NAME}", "serverAuth,clientAuth")
    return CertFiles(
        ca=directory / "ca.crt",
        server_cert=directory / "server.crt", server_key=directory / "server.key",
        client_cert=directory / "client.crt", client_key=directory / "client.key",
        other_ca=directory / "other-ca.crt",
        wrong_name_cert=directory / "wrong-name.crt", wrong_name_key=directory / "wrong-name.key",
    )
