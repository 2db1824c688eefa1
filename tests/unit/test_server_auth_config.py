"""The cache server's auth, tenant and TLS settings: refused at start-up, naming the key, never the secret.

Each refusal has its control: the same config with the one fix is accepted.
Covers the server config (tiercache/server/config.py, config_auth.py, tls.py),
the client tier's options (backends/server/settings.py) and ``tiercache serve``
itself refusing to start (exit 1 before binding) on a non-loopback host
without authentication.
"""

from __future__ import annotations

import pathlib
import subprocess
import sys

import pytest
from tiercache.backends.server.settings import ServerSettings

from tests.server.harness import ROOT, free_port
from tiercache.config.schema import ConfigError
from tiercache.server.auth import TokenTable
from tiercache.server.config import load_server_config
from tiercache.server.tenants import SPACE_BYTES, space_of

SECRET = "Zq7-very-secret-token-value"


def refused(**overrides: object) -> str:
    with pytest.raises(ConfigError) as err:
        load_server_config(None, **overrides)
    text = str(err.value)
    assert SECRET not in text and "Zq7" not in text, "a config error echoed a secret"
    return text


def test_default_auth_needs_a_token() -> None:
    text = refused()
    assert "auth_token: auth is 'token' (the default) but no token is configured" in text
    assert "tenants" in text and "auth: none" in text
    assert load_server_config(None, auth_token=SECRET).auth == "token"  # control


def test_empty_token_is_an_error_never_open(monkeypatch: pytest.MonkeyPatch) -> None:
    assert "auth_token: Value error, an empty token is not allowed" in refused(auth_token="")
    assert "auth_token: Value error, an empty token" in refused(auth_token="   ")
    text = refused(tenants=[{"name": "a", "token": ""}, {"name": "b", "token": SECRET}])
    assert "tenants.0.token: Value error, an empty token is not allowed" in text
    monkeypatch.setenv("TIERCACHE_SERVER_AUTH_TOKEN", "")  # the silent way out
    assert "auth_token: Value error, an empty token" in refused()
    monkeypatch.setenv("TIERCACHE_SERVER_AUTH_TOKEN", SECRET)  # control: a real one from env
    config = load_server_config(None)
    assert [t.name for t in config.tenant_list()] == ["default"] and config.tenant_list()[0].admin
    assert SECRET not in repr(config) and SECRET not in str(config.model_dump())


def test_non_loopback_without_auth_is_refused() -> None:
    for host in ("0.0.0.0", "::", "10.1.2.3", "cache.example.com", ""):
        text = refused(auth="none", host=host)
        assert f"host: {host} is not a loopback address and auth is 'none'" in text
    for host in ("127.0.0.1", "::1", "localhost", "127.0.0.5"):  # control: loopback may run open
        assert load_server_config(None, auth="none", host=host).tenant_list() == ()
    assert load_server_config(None, host="0.0.0.0", auth_token=SECRET).host == "0.0.0.0"  # with a token
    assert "auth: 'none' but auth_token or tenants are set" in refused(auth="none", auth_token=SECRET)


def test_duplicate_tokens_and_names_are_errors() -> None:
    text = refused(tenants=[{"name": "a", "token": SECRET}, {"name": "b", "token": SECRET}])
    assert "tenants.1.token: the same token as tenants.0" in text
    text = refused(tenants=[{"name": "a", "token": SECRET}, {"name": "a", "token": SECRET + "x"}])
    assert "tenants.1.name: 'a' is listed twice (tenants.0)" in text
    assert "set either auth_token" in refused(auth_token=SECRET, tenants=[{"name": "a", "token": "t2"}])
    assert "tenants.0.name" in refused(tenants=[{"name": "bad name!", "token": SECRET}])
    assert "tenants.0.tokn: unknown key" in refused(tenants=[{"name": "a", "tokn": SECRET}])
    config = load_server_config(None, tenants=[  # control: distinct tokens, a shared space
        {"name": "a", "token": SECRET}, {"name": "b", "token": SECRET + "b", "space": "a"},
        {"name": "ops", "token": SECRET + "o", "admin": True},
    ])
    table = TokenTable.from_config(config)
    assert [(t.name, t.space, t.admin) for t in table.tenants] == [
        ("a", space_of("a"), False), ("b", space_of("a"), False), ("ops", space_of("ops"), True)]


def test_key_bound_leaves_room_for_the_space_prefix() -> None:
    assert "max_key_bytes: 12 leaves too little room" in refused(auth_token=SECRET, max_key_bytes=12)
    assert load_server_config(None, auth_token=SECRET, max_key_bytes=SPACE_BYTES + 8).max_key_bytes == 16
    assert load_server_config(None, auth="none", max_key_bytes=8).max_key_bytes == 8  # no prefix


def test_tenants_and_auth_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TIERCACHE_SERVER_TENANTS", f'[{{"name": "a", "token": "{SECRET}"}}]')
    assert [t.name for t in load_server_config(None).tenant_list()] == ["a"]
    monkeypatch.delenv("TIERCACHE_SERVER_TENANTS")
    monkeypatch.setenv("TIERCACHE_SERVER_AUTH", "none")
    assert load_server_config(None).auth == "none"


def test_tls_files_must_load(tmp_path: pathlib.Path) -> None:
    from tests.integration.tls_certs import make_certs

    certs = make_certs(tmp_path / "pki")
    missing = tmp_path / "nope.crt"
    text = refused(auth_token=SECRET, tls={"cert_file": str(missing), "key_file": str(certs.server_key)})
    assert "tls.cert_file: Path does not point to a file" in text
    text = refused(auth_token=SECRET, tls={"cert_file": str(certs.server_cert), "key_file": str(certs.client_key)})
    assert "tls: Value error, cert_file/key_file: cannot load the certificate and key" in text
    text = refused(auth_token=SECRET, tls={"cert_file": str(certs.server_cert), "key_file": str(certs.server_key),
                                           "client_ca_file": str(certs.server_key)})
    assert "client_ca_file: cannot load the CA bundle" in text
    config = load_server_config(None, auth_token=SECRET, tls={  # control
        "cert_file": str(certs.server_cert), "key_file": str(certs.server_key), "client_ca_file": str(certs.ca)})
    assert config.tls is not None and config.tls.client_ca_file == certs.ca


def test_client_tier_token_and_tls_options(tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from pydantic import ValidationError

    from tests.integration.tls_certs import make_certs

    monkeypatch.delenv("TIERCACHE_SERVER_TOKEN", raising=False)
    with pytest.raises(ValidationError, match="token\n.*an empty token is not allowed"):
        ServerSettings(address="127.0.0.1:1", token="")
    monkeypatch.setenv("TIERCACHE_SERVER_TOKEN", "")
    with pytest.raises(ValidationError, match="an empty token"):
        ServerSettings(address="127.0.0.1:1")
    monkeypatch.setenv("TIERCACHE_SERVER_TOKEN", SECRET)  # control: the env fallback
    settings = ServerSettings(address="127.0.0.1:1")
    assert settings.token is not None and settings.token.get_secret_value() == SECRET
    assert SECRET not in repr(settings) and settings.overwrite is False and settings.tls_context() is None
    certs = make_certs(tmp_path / "pki")
    with pytest.raises(ValidationError, match="cert_file and key_file: set both"):
        ServerSettings(address="127.0.0.1:1", tls={"ca_file": str(certs.ca), "cert_file": str(certs.client_cert)})
    with pytest.raises(ValidationError, match="ca_file: cannot load the CA bundle"):
        ServerSettings(address="127.0.0.1:1", tls={"ca_file": str(certs.client_key)})
    good = ServerSettings(address="127.0.0.1:1", tls={
        "ca_file": str(certs.ca), "cert_file": str(certs.client_cert), "key_file": str(certs.client_key)})
    assert good.tls_context() is not None


def test_serve_refuses_to_start_open_on_a_public_address(tmp_path: pathlib.Path) -> None:
    config = tmp_path / "server.yaml"
    port = free_port()
    config.write_text(f"host: 0.0.0.0\nport: {port}\nauth: none\nnixl: off\n"
                      "tiers: [{name: cpu, backend: cpu, capacity: 1MiB}]\n")
    out = subprocess.run([sys.executable, "-m", "tiercache.server.serve_cli", "--config", str(config)],
                         capture_output=True, text=True, cwd=ROOT, timeout=120, check=False)
    assert out.returncode == 1 and "INVALID" in out.stderr
    assert "host: 0.0.0.0 is not a loopback address and auth is 'none'" in out.stderr


def test_one_token_variable_for_server_engines_and_cli(monkeypatch: pytest.MonkeyPatch) -> None:
    """TIERCACHE_SERVER_TOKEN (the engines' and the CLI's name) is also the server's auth_token,
    unless the server's tokens are named otherwise (tenants, auth_token) or auth is none."""
    monkeypatch.setenv("TIERCACHE_SERVER_TOKEN", SECRET)
    assert load_server_config(None).tenant_list()[0].token.get_secret_value() == SECRET
    assert ServerSettings(address="127.0.0.1:7470").token.get_secret_value() == SECRET  # the engine's side
    other = "another-long-tenant-token-value"
    with_tenants = load_server_config(None, tenants=[{"name": "a", "token": other}])
    assert [t.token.get_secret_value() for t in with_tenants.tenant_list()] == [other]
    assert load_server_config(None, auth="none").tenant_list() == ()
    assert load_server_config(None, auth_token=other).tenant_list()[0].token.get_secret_value() == other
    monkeypatch.delenv("TIERCACHE_SERVER_TOKEN")
    refused()  # control: without it the default config has no token
