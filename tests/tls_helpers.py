"""Test TLS material made at test time with the ``openssl`` CLI (scripts/install-system-deps.sh
installs it): a CA, a server certificate it signed for 127.0.0.1 and localhost, and an unrelated
self-signed certificate and key (a server the CA does not vouch for, a key that matches nothing)."""

from __future__ import annotations

import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

INSTALL_HINT = "openssl is not installed: run scripts/install-system-deps.sh (apt package openssl)"


@dataclass(frozen=True)
class TLSFiles:
    ca: Path           # the CA certificate clients verify with
    cert: Path         # server certificate signed by the CA (SAN IP:127.0.0.1, DNS:localhost)
    key: Path          # its private key
    other_cert: Path   # a self-signed certificate for 127.0.0.1 the CA did not sign
    other_key: Path    # its key


def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True, timeout=60)


def make_tls_files(directory: Path) -> TLSFiles:
    """Write the files into ``directory`` and return their paths. Raises RuntimeError (with the
    install hint) if openssl is missing."""
    if shutil.which("openssl") is None:
        raise RuntimeError(INSTALL_HINT)
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
    _openssl("req", "-x509", *ec, "-keyout", "ca.key", "-out", "ca.crt", "-days", "2", "-subj", "/CN=shardline test CA",
             "-addext", "basicConstraints=critical,CA:TRUE", "-addext", "keyUsage=critical,keyCertSign,cRLSign", cwd=d)
    _openssl("req", *ec, "-keyout", "server.key", "-out", "server.csr", "-subj", "/CN=127.0.0.1", cwd=d)
    (d / "server.ext").write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\nbasicConstraints=CA:FALSE\n"
                                  "keyUsage=digitalSignature,keyEncipherment\nextendedKeyUsage=serverAuth\n")
    _openssl("x509", "-req", "-in", "server.csr", "-CA", "ca.crt", "-CAkey", "ca.key", "-CAcreateserial",
             "-out", "server.crt", "-days", "2", "-extfile", "server.ext", cwd=d)
    _openssl("req", "-x509", *ec, "-keyout", "other.key", "-out", "other.crt", "-days", "2", "-subj", "/CN=127.0.0.1",
             "-addext", "subjectAltName=IP:127.0.0.1,DNS:localhost", cwd=d)
    for key in ("ca.key", "server.key", "other.key"):
        (d / key).chmod(0o600)
    return TLSFiles(d / "ca.crt", d / "server.crt", d / "server.key", d / "other.crt", d / "other.key")
