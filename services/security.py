"""Safe defaults: the bind policy, TLS material for gRPC, and the credentials of clients.

Bind policy (:func:`check_binds`). Every daemon binds 127.0.0.1 unless told otherwise. A daemon
that binds any address that is not loopback -- its gRPC ``listen``, a PS's ``data_listen``, the
metrics endpoint -- must hold a cluster token (``cluster_token_file``), or the operator must say
``allow_insecure: true``: then the daemon starts, logs a WARNING, and the dispatcher's status shows
it (``shardline status``). Otherwise the daemon refuses to start (exit code 2) with a message that
names the address and both ways out. "Loopback" (:func:`is_loopback`) is 127.0.0.0/8, ``::1``,
``localhost`` and host names that resolve to loopback addresses only; ``0.0.0.0``, ``::`` and an
empty host (every interface) are not.

TLS (:func:`load_server_tls`, :func:`load_ca`). ``tls_cert_file`` + ``tls_key_file`` make a
daemon's gRPC server speak TLS; ``tls_ca_file`` is the CA bundle its gRPC clients (daemons calling
other daemons, the CLI, training scripts) verify servers with: set, every outgoing gRPC channel
uses TLS. The cluster token then travels encrypted. The data plane is not encrypted (it stays
HMAC-authenticated, services/auth.py); metrics stay plain HTTP.

Clients in training scripts (:func:`client_credentials`): a token or CA not passed explicitly is
read from the files named by ``SHARDLINE_CLUSTER_TOKEN_FILE`` / ``SHARDLINE_TLS_CA_FILE`` (the same
variables the daemons read), so a script runs unchanged against ``shardline up``'s cluster.
"""

from __future__ import annotations

import ipaddress
import logging
import os
import secrets
import socket
import ssl
from dataclasses import dataclass
from typing import Callable, Mapping

from shardline.services.errors import ShardlineConfigError

__all__ = ["ServerTLS", "DaemonSecurity", "is_loopback", "check_binds", "load_server_tls", "load_ca",
           "daemon_security", "client_credentials", "write_new_token", "tls_hint", "TOKEN_FILE_ENV", "CA_FILE_ENV"]

TOKEN_FILE_ENV = "SHARDLINE_CLUSTER_TOKEN_FILE"
CA_FILE_ENV = "SHARDLINE_TLS_CA_FILE"
# secrets.token_urlsafe(48) is 64 characters: 384 random bits.
NEW_TOKEN_BYTES = 48

log = logging.getLogger("shardline.security")


# -- the bind policy -------------------------------------------------------------------------------

def _resolve(host: str) -> list[str]:
    return [info[4][0] for info in socket.getaddrinfo(host, None, proto=socket.IPPROTO_TCP)]


def is_loopback(host: str, resolve: Callable[[str], list[str]] = _resolve) -> bool:
    """True if binding ``host`` exposes nothing beyond this machine.

    127.0.0.0/8, ``::1`` (also IPv4-mapped ``::ffff:127.x.y.z``, with or without brackets) and
    ``localhost`` are loopback; a host name is loopback if it resolves (``resolve``: the addresses
    of a name) to loopback addresses only. The wildcard addresses ``0.0.0.0``/``::``, an empty host,
    any other address and a name that does not resolve (fail closed) are not.
    """
    if not isinstance(host, str):
        return False
    host = host.strip()
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    if not host:
        return False
    if host.lower() in ("localhost", "localhost.", "ip6-localhost", "ip6-loopback"):
        return True
    try:
        return _address_is_loopback(ipaddress.ip_address(host.split("%", 1)[0]))
    except ValueError:
        pass
    try:
        addresses = resolve(host)
    except (OSError, UnicodeError):
        return False
    parsed = []
    for text in addresses:
        try:
            parsed.append(ipaddress.ip_address(str(text).split("%", 1)[0]))
        except ValueError:
            return False
    return bool(parsed) and all(_address_is_loopback(a) for a in parsed)


def _address_is_loopback(address: ipaddress.IPv4Address | ipaddress.IPv6Address) -> bool:
    mapped = getattr(address, "ipv4_mapped", None)
    return (mapped or address).is_loopback


def check_binds(binds: Mapping[str, str], *, has_token: bool, allow_insecure: bool,
                resolve: Callable[[str], list[str]] = _resolve) -> list[str]:
    """Apply the bind policy to ``binds`` (``{what: "HOST:PORT"}``, e.g. ``{"listen": ..., "metrics": ...}``).

    Returns the exposed (non-loopback) binds as ``"what HOST:PORT"`` strings. With exposed binds and
    neither ``has_token`` nor ``allow_insecure`` raises ShardlineConfigError naming each address
    and the two ways out (a token, or ``allow_insecure: true``).
    """
    from shardline.services.daemon import parse_host_port

    exposed = []
    for what, address in binds.items():
        host, _port = parse_host_port(address, what=what)
        if not is_loopback(host, resolve):
            exposed.append(f"{what} {address}")
    if exposed and not has_token and not allow_insecure:
        raise ShardlineConfigError(
            f"refusing to bind {', '.join(exposed)}: not a loopback address, and no cluster token is set, so "
            f"anyone who can reach it could read and change every job. Set cluster_token_file "
            f"(--cluster-token-file or {TOKEN_FILE_ENV}; docs/operations.md, Security), or bind 127.0.0.1, "
            f"or -- on a network you trust -- set allow_insecure: true (--allow-insecure)")
    return exposed


# -- TLS material ----------------------------------------------------------------------------------

@dataclass(frozen=True)
class ServerTLS:
    """PEM bytes of a gRPC server's certificate chain and private key."""

    cert_chain: bytes
    private_key: bytes


def _read(path: str, option: str) -> bytes:
    try:
        with open(path, "rb") as fh:
            return fh.read()
    except OSError as exc:
        raise ShardlineConfigError(f"cannot read {option} {path!r}: {exc.strerror or exc}") from None


def load_server_tls(cert_file: str | None, key_file: str | None) -> ServerTLS | None:
    """The server's TLS material, or None when neither file is set.

    Raises ShardlineConfigError (quoting the option and path) when only one is set, a file cannot
    be read, or the files are not a PEM certificate chain and the private key that matches it.
    """
    if not cert_file and not key_file:
        return None
    if not cert_file or not key_file:
        given, missing = ("tls_cert_file", "tls_key_file") if cert_file else ("tls_key_file", "tls_cert_file")
        raise ShardlineConfigError(f"{given} is set ({cert_file or key_file!r}) but {missing} is not: a TLS "
                                   f"server needs both its certificate and its private key")
    cert, key = _read(cert_file, "tls_cert_file"), _read(key_file, "tls_key_file")
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    try:
        context.load_cert_chain(cert_file, key_file)
    except ssl.SSLError as exc:
        raise ShardlineConfigError(f"tls_cert_file {cert_file!r} and tls_key_file {key_file!r} are not a PEM "
                                   f"certificate and its private key: {exc.reason or exc}") from None
    return ServerTLS(cert, key)


def load_ca(ca_file: str | None) -> bytes | None:
    """PEM bytes of the CA bundle gRPC clients verify servers with; None when unset. Raises
    ShardlineConfigError (quoting the path) if it cannot be read or holds no PEM certificate."""
    if not ca_file:
        return None
    data = _read(ca_file, "tls_ca_file")
    try:
        ssl.create_default_context(cadata=data.decode("ascii"))
    except (ssl.SSLError, UnicodeDecodeError, ValueError) as exc:
        raise ShardlineConfigError(f"tls_ca_file {ca_file!r} holds no PEM CA certificate: {exc}") from None
    return data


# -- a daemon's settings ---------------------------------------------------------------------------

@dataclass(frozen=True)
class DaemonSecurity:
    """What a daemon resolved at start: token, TLS, and whether it runs exposed without a token."""

    token: bytes | None
    server_tls: ServerTLS | None
    tls_ca: bytes | None
    insecure: bool            # binds a non-loopback address without a token (allow_insecure)
    exposed: tuple[str, ...]  # its non-loopback binds, "what HOST:PORT"

    @property
    def summary(self) -> str:
        """One line for the start log: ``token, TLS`` / ``no token (loopback only)`` / ``INSECURE``."""
        auth = "cluster token" if self.token else ("NO AUTHENTICATION (allow_insecure)" if self.insecure
                                                   else "no cluster token (loopback only)")
        client = "; calls other daemons over TLS" if self.tls_ca else ""
        return f"{auth}; gRPC {'TLS' if self.server_tls else 'plaintext'}{client}"


def daemon_security(args, binds: Mapping[str, str]) -> DaemonSecurity:
    """Load ``args``' token and TLS files and apply the bind policy to ``binds`` (see
    :func:`check_binds`). ``args`` has ``cluster_token_file``, ``allow_insecure``, ``tls_cert_file``,
    ``tls_key_file`` and ``tls_ca_file``. Raises ShardlineConfigError (the daemon exits 2); logs the
    WARNING of an insecure start."""
    from shardline.services.auth import load_token

    token = load_token(args.cluster_token_file)
    server_tls = load_server_tls(args.tls_cert_file, args.tls_key_file)
    tls_ca = load_ca(args.tls_ca_file)
    if server_tls is not None and tls_ca is None:
        raise ShardlineConfigError(
            f"tls_cert_file is set ({args.tls_cert_file!r}) but tls_ca_file is not: the daemons of a TLS cluster "
            f"call each other over TLS too, so each needs the CA that signed the servers' certificates")
    exposed = check_binds(binds, has_token=token is not None, allow_insecure=bool(args.allow_insecure))
    insecure = bool(exposed) and token is None
    if insecure:
        log.warning("INSECURE: serving %s without a cluster token (allow_insecure is set): anyone who can reach "
                    "these addresses can read and change every job. Set cluster_token_file (docs/operations.md, "
                    "Security)", ", ".join(exposed))
    return DaemonSecurity(token, server_tls, tls_ca, insecure, tuple(exposed))


# -- clients ---------------------------------------------------------------------------------------

def client_credentials(cluster_token: bytes | None = None, tls_ca: bytes | None = None,
                       environ: Mapping[str, str] | None = None) -> tuple[bytes | None, bytes | None]:
    """``(token, ca)`` for a client: each as given, else read from the file its environment
    variable names (``SHARDLINE_CLUSTER_TOKEN_FILE``, ``SHARDLINE_TLS_CA_FILE``; empty = unset),
    else None. Raises ShardlineConfigError if a named file is unusable."""
    from shardline.services.auth import load_token

    environ = os.environ if environ is None else environ
    if cluster_token is None:
        cluster_token = load_token(environ.get(TOKEN_FILE_ENV) or None)
    if tls_ca is None:
        tls_ca = load_ca(environ.get(CA_FILE_ENV) or None)
    return cluster_token, tls_ca


def write_new_token(path: str | os.PathLike) -> bytes:
    """Write a fresh random token (``secrets.token_urlsafe``, 384 bits) to ``path``, readable by
    its owner only (0600, written to a private temporary file and renamed); returns it."""
    token = secrets.token_urlsafe(NEW_TOKEN_BYTES).encode("ascii")
    path = os.fspath(path)
    tmp = f"{path}.tmp.{os.getpid()}"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(token + b"\n")
        os.chmod(tmp, 0o600)  # whatever the umask
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise
    return token


def tls_hint(details: str | None, tls: bool) -> str:
    """Why a gRPC connection failed, when its error ``details`` point at TLS ('' otherwise); ``tls``:
    the client used TLS. For the messages of unreachable-server errors."""
    text = (details or "").lower()
    if tls and "wrong_version_number" in text:
        return "; the server does not speak TLS (is tls_ca_file set for a cluster without TLS?)"
    if tls and ("certificate" in text or "handshake" in text):
        return ("; TLS handshake failed: the server's certificate is not signed by the CA of tls_ca_file, or not "
                "issued for this host")
    if not tls and "socket closed" in text:
        return ("; the server closed the connection at once: if the cluster uses TLS, set tls_ca_file "
                f"({CA_FILE_ENV}, --tls-ca-file) to the CA that signed its certificates")
    return ""
