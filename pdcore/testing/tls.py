"""TLS material for tests: a certificate authority and a certificate it signed for 127.0.0.1,
made with the openssl CLI (no Python dependency)."""

from __future__ import annotations

import subprocess
from pathlib import Path


def make_pki(folder: Path) -> tuple[Path, Path, Path]:
    """A CA and a certificate it signed for 127.0.0.1 (openssl CLI): (ca, cert, key)."""
    def run(*cmd: str) -> None:
        subprocess.run(["openssl", *cmd], check=True, capture_output=True, timeout=60)

    ca, ca_key = folder / "ca.pem", folder / "ca-key.pem"
    key, csr, cert = folder / "key.pem", folder / "req.csr", folder / "cert.pem"
    ext = folder / "san.ext"
    ext.write_text("subjectAltName=IP:127.0.0.1\n")
    run("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=test CA",
        "-keyout", str(ca_key), "-out", str(ca))
    run("req", "-newkey", "rsa:2048", "-nodes", "-subj", "/CN=127.0.0.1", "-keyout", str(key),
        "-out", str(csr))
    run("x509", "-req", "-in", str(csr), "-CA", str(ca), "-CAkey", str(ca_key),
        "-CAcreateserial", "-days", "1", "-extfile", str(ext), "-out", str(cert))
    return ca, cert, key
