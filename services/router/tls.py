"""HTTPS on the router itself (vLLM's --ssl-keyfile, --ssl-certfile, --ssl-ca-certs,
--ssl-cert-reqs), for deployments with no proxy in front to terminate TLS.

The context is built once at start, so a missing file, a key that does not match its
certificate or a bad combination of flags ends the router with one line naming it instead of a
traceback when the first client connects. TLS 1.2 is the least it speaks (what browsers, the
openai SDK's httpx and curl all offer), ALPN says HTTP/1.1 (the router speaks nothing else).

The handshake happens before the router's connection guard sees the connection (asyncio calls
the protocol's `connection_made` once it is done), so it is bounded on its own: a handshake not
finished within --header-timeout is dropped (asyncio's default would wait 60 s). Until then the
connection is not counted in --max-connections, so a router open to the internet is still
better served behind a proxy that terminates TLS (docs/deploy.md).
"""

from __future__ import annotations

import ssl

CERT_REQS = {0: ssl.CERT_NONE, 1: ssl.CERT_OPTIONAL, 2: ssl.CERT_REQUIRED}


def server_context(keyfile: str, certfile: str, ca_certs: str = "", cert_reqs: int = 0) -> ssl.SSLContext | None:
    """The router's TLS context, or None for plain HTTP (neither file named). ValueError, with a
    sentence naming the flag, for what cannot serve."""
    if not keyfile and not certfile:
        if ca_certs or cert_reqs:
            raise ValueError("--ssl-ca-certs and --ssl-cert-reqs need --ssl-keyfile and --ssl-certfile")
        return None
    if not (keyfile and certfile):
        raise ValueError("--ssl-keyfile and --ssl-certfile go together: name both to serve HTTPS")
    if cert_reqs not in CERT_REQS:
        raise ValueError(f"--ssl-cert-reqs must be 0, 1 or 2, not {cert_reqs}")
    if cert_reqs and not ca_certs:
        raise ValueError("--ssl-cert-reqs 1 or 2 needs --ssl-ca-certs to verify client certificates against")
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    try:
        ctx.load_cert_chain(certfile, keyfile)
    except (OSError, ssl.SSLError) as e:
        raise ValueError(f"cannot load --ssl-certfile {certfile} with --ssl-keyfile {keyfile}: {e}") from e
    if ca_certs:
        try:
            ctx.load_verify_locations(ca_certs)
        except (OSError, ssl.SSLError) as e:
            raise ValueError(f"cannot load --ssl-ca-certs {ca_certs}: {e}") from e
    ctx.verify_mode = CERT_REQS[cert_reqs]
    ctx.set_alpn_protocols(["http/1.1"])
    return ctx
