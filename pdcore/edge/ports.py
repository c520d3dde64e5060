"""The listening ports' start-up checks the servers, the router and `pdserve up` share: a busy
port and a bad HTTPS pair are exit 2 naming the flag, before anything starts. Apart from
`connections` (the ports' deadlines and limits, on uvicorn and FastAPI) so that parsing a command
line imports neither: `pdserve --help` or a refused flag took ~0.7 CPU-seconds of FastAPI and
pydantic imports that the answer never used."""

from __future__ import annotations

import os
import socket

from pdcore.errors import ConfigError


def tls_settings(certfile: str | None, keyfile: str | None, cert_flag: str,
                 key_flag: str) -> dict[str, str]:
    """uvicorn's HTTPS settings for a port (servers: --ssl-certfile/--ssl-keyfile; router:
    --tls-cert-path/--tls-key-path), checked now: the pair loads as a certificate chain and
    its key, else ConfigError naming the flags. {} without them (plain HTTP)."""
    import ssl

    if not certfile and not keyfile:
        return {}
    if not certfile or not keyfile:
        raise ConfigError(f"HTTPS needs both {cert_flag} and {key_flag} (PEM files)")
    for path, flag in ((certfile, cert_flag), (keyfile, key_flag)):
        if not os.path.isfile(os.path.expanduser(path)):
            raise ConfigError(f"{flag} {path}: no such file")
    try:
        ssl.create_default_context(ssl.Purpose.CLIENT_AUTH).load_cert_chain(
            os.path.expanduser(certfile), os.path.expanduser(keyfile))
    except (ssl.SSLError, OSError) as e:
        raise ConfigError(f"{cert_flag} {certfile} with {key_flag} {keyfile}: not a PEM "
                          f"certificate chain and its private key ({e})") from None
    return {"ssl_certfile": os.path.expanduser(certfile),
            "ssl_keyfile": os.path.expanduser(keyfile)}


def check_port_free(host: str, port: int, flag: str = "--port") -> None:
    """A busy port is exit 2 naming its flag before anything starts (uvicorn's own bind error
    came after the start-up, with exit 3). Shared by the servers' preflight and the router."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError as e:
            raise ConfigError(f"{flag} {port}: cannot listen on {host}:{port} ({e.strerror}); "
                              f"pick another {flag}") from None
