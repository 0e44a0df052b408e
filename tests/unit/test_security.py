"""The bind policy, TLS files and client credentials of services/security.py (no daemon)."""

import os
import stat
from types import SimpleNamespace

import pytest

from shardline.services import security
from shardline.services.auth import load_token
from shardline.services.errors import ShardlineConfigError

TOKEN = b"unit-token-0123456789abcdef"


def no_resolve(host):
    raise AssertionError(f"{host!r} should not need a name lookup")


@pytest.mark.parametrize("host", ["127.0.0.1", "127.1.2.3", "127.255.255.254", "::1", "[::1]", "localhost",
                                  "LOCALHOST", "::ffff:127.0.0.1", " 127.0.0.1 "])
def test_loopback_addresses(host):
    assert security.is_loopback(host, resolve=no_resolve)


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "[::]", "", "10.0.0.5", "192.168.1.1", "::ffff:10.0.0.1",
                                  "fe80::1", "128.0.0.1", "[]"])
def test_not_loopback_addresses(host):
    assert not security.is_loopback(host, resolve=no_resolve)


def test_host_names_are_loopback_only_if_every_address_is():
    table = {"only-lo": ["127.0.0.1", "::1"], "mixed": ["127.0.0.1", "10.0.0.7"], "remote": ["10.0.0.7"],
             "empty": [], "junk": ["not-an-address"]}

    def resolve(host):
        if host not in table:
            raise OSError("Name or service not known")
        return table[host]

    assert security.is_loopback("only-lo", resolve=resolve)
    for host in ("mixed", "remote", "empty", "junk", "unknown-host"):  # unknown: fail closed
        assert not security.is_loopback(host, resolve=resolve), host


def test_real_resolver_sees_localhost_name():
    assert security.is_loopback("localhost")
    assert not security.is_loopback("0.0.0.0")


def test_check_binds_refuses_exposed_without_token_naming_address_and_ways_out():
    with pytest.raises(ShardlineConfigError) as e:
        security.check_binds({"listen": "127.0.0.1:7100", "data_listen": "0.0.0.0:7200"},
                             has_token=False, allow_insecure=False, resolve=no_resolve)
    msg = str(e.value)
    assert "data_listen 0.0.0.0:7200" in msg and "listen 127.0.0.1" not in msg
    assert "cluster_token_file" in msg and "allow_insecure" in msg


def test_check_binds_allows_loopback_token_or_allow_insecure():
    binds = {"listen": "0.0.0.0:0", "metrics": "0.0.0.0:0"}
    assert security.check_binds({"listen": "127.0.0.1:0", "metrics": "[::1]:0"}, has_token=False,
                                allow_insecure=False, resolve=no_resolve) == []
    assert security.check_binds(binds, has_token=True, allow_insecure=False, resolve=no_resolve) == \
        ["listen 0.0.0.0:0", "metrics 0.0.0.0:0"]
    assert security.check_binds(binds, has_token=False, allow_insecure=True, resolve=no_resolve) == \
        ["listen 0.0.0.0:0", "metrics 0.0.0.0:0"]


def test_check_binds_rejects_a_bad_address():
    with pytest.raises(ShardlineConfigError, match="'nope'"):
        security.check_binds({"listen": "nope"}, has_token=False, allow_insecure=False)


def _args(**kw):
    base = dict(cluster_token_file=None, allow_insecure=False, tls_cert_file=None, tls_key_file=None, tls_ca_file=None)
    base.update(kw)
    return SimpleNamespace(**base)


def test_daemon_security_insecure_flag_and_warning(tmp_path, caplog):
    sec = security.daemon_security(_args(), {"listen": "127.0.0.1:0"})
    assert not sec.insecure and sec.token is None and "loopback only" in sec.summary
    with pytest.raises(ShardlineConfigError, match="0.0.0.0:0"):
        security.daemon_security(_args(), {"listen": "0.0.0.0:0"})
    with caplog.at_level("WARNING", logger="shardline.security"):
        sec = security.daemon_security(_args(allow_insecure=True), {"listen": "0.0.0.0:0"})
    assert sec.insecure and sec.exposed == ("listen 0.0.0.0:0",) and "INSECURE" in caplog.text
    token_file = tmp_path / "token"
    token_file.write_bytes(TOKEN)
    sec = security.daemon_security(_args(cluster_token_file=str(token_file), allow_insecure=True),
                                   {"listen": "0.0.0.0:0"})
    assert sec.token == TOKEN and not sec.insecure  # a token: exposed, but authenticated


@pytest.fixture(scope="module")
def tls_files(tmp_path_factory):
    from tls_helpers import make_tls_files

    return make_tls_files(tmp_path_factory.mktemp("tls"))


def test_tls_files_load_and_validate(tls_files, tmp_path):
    tls = security.load_server_tls(str(tls_files.cert), str(tls_files.key))
    assert tls.cert_chain.startswith(b"-----BEGIN CERTIFICATE") and b"PRIVATE KEY" in tls.private_key
    assert security.load_ca(str(tls_files.ca)).startswith(b"-----BEGIN CERTIFICATE")
    assert security.load_server_tls(None, None) is None and security.load_ca(None) is None
    with pytest.raises(ShardlineConfigError, match=r"tls_cert_file is set \('.*server.crt'\) but tls_key_file is not"):
        security.load_server_tls(str(tls_files.cert), None)
    with pytest.raises(ShardlineConfigError, match="tls_key_file is set .* but tls_cert_file is not"):
        security.load_server_tls(None, str(tls_files.key))
    missing = str(tmp_path / "missing.key")
    with pytest.raises(ShardlineConfigError, match=f"cannot read tls_key_file '{missing}'"):
        security.load_server_tls(str(tls_files.cert), missing)
    with pytest.raises(ShardlineConfigError, match="not a PEM certificate and its private key"):
        security.load_server_tls(str(tls_files.cert), str(tls_files.other_key))  # a key of another certificate
    junk = tmp_path / "junk.pem"
    junk.write_text("hello\n")
    with pytest.raises(ShardlineConfigError, match=f"tls_ca_file '{junk}' holds no PEM CA certificate"):
        security.load_ca(str(junk))
    with pytest.raises(ShardlineConfigError, match="tls_ca_file is not"):
        security.daemon_security(_args(tls_cert_file=str(tls_files.cert), tls_key_file=str(tls_files.key)),
                                 {"listen": "127.0.0.1:0"})


def test_client_credentials_from_environment(tmp_path, tls_files):
    token_file = tmp_path / "token"
    token_file.write_bytes(TOKEN + b"\n")
    env = {security.TOKEN_FILE_ENV: str(token_file), security.CA_FILE_ENV: str(tls_files.ca)}
    token, ca = security.client_credentials(environ=env)
    assert token == TOKEN and ca.startswith(b"-----BEGIN CERTIFICATE")
    assert security.client_credentials(b"given-token-0123456789", b"ca", environ=env) == (b"given-token-0123456789", b"ca")
    assert security.client_credentials(environ={security.TOKEN_FILE_ENV: ""}) == (None, None)
    with pytest.raises(ShardlineConfigError, match="cannot read cluster token file"):
        security.client_credentials(environ={security.TOKEN_FILE_ENV: str(tmp_path / "nope")})


def test_new_token_file_is_private_random_and_loadable(tmp_path):
    old = os.umask(0)
    try:
        path = tmp_path / "cluster.token"
        first = security.write_new_token(path)
        assert stat.S_IMODE(path.stat().st_mode) == 0o600
        assert load_token(str(path)) == first and len(first) >= 43  # >= 32 random bytes, urlsafe
        second = security.write_new_token(path)  # overwritten: a new token each time
        assert second != first and load_token(str(path)) == second
        assert stat.S_IMODE(path.stat().st_mode) == 0o600
        assert [p.name for p in tmp_path.iterdir()] == ["cluster.token"]  # no temporary file left
    finally:
        os.umask(old)


def test_status_security_lines():
    from shardline.cli import security_lines

    warnings, summary = security_lines({"insecure": True, "cluster_token": False, "tls": False,
                                        "insecure_nodes": ["ps-a"]})
    assert [w.split(":")[0:2] for w in warnings] == [["WARNING", " INSECURE"]] * 2 and "ps-a" in warnings[1]
    assert summary == "security: authentication NONE, gRPC plaintext"
    assert security_lines({"cluster_token": True, "tls": True}) == \
        ([], "security: authentication cluster token, gRPC TLS")
    assert security_lines({}) == ([], "security: authentication none (loopback only), gRPC plaintext")
