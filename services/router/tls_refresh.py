"""A renewed certificate served without a restart (vLLM's --enable-ssl-refresh).

Certificates are short-lived where they are managed (cert-manager, an ACME client, a mounted
Kubernetes secret), and the files change under a running router. With the flag, a loop timer
looks at the key, certificate and CA files every POLL seconds, on an idle router too; when any
of them changed (inode, size or modification time: a secret mount swaps a symlink, an editor
rewrites in place), the TLS context is built again from the files as they are now and new
handshakes use it; connections already open keep the session they have.

A pair caught half-written (the new certificate with the old key, a file still being copied)
does not load: the router keeps serving with the context it has, logs a warning and counts the
failure, and tries again when the files change next, so the moment the second file lands the
new pair is served. The context is built whole before it replaces the old one, never changed in
place, so no handshake ever sees a certificate with the wrong key.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Callable

from services.router.tls import server_context

POLL = 1.0  # seconds between looks at the files: a stat each, nothing read until one changed

Signature = tuple[tuple[int, int, int, int] | None, ...]


def files_signature(paths: tuple[str, ...]) -> Signature:
    """What identifies each file's current content without reading it (None: missing)."""
    out = []
    for path in paths:
        try:
            st = os.stat(path)
        except OSError:
            out.append(None)
            continue
        out.append((st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns))
    return tuple(out)


class CertificateRefresher:
    """The context new TLS handshakes use (`context`), built again whenever its files change;
    each reload's outcome goes to `report` ("reloaded" or "failed", a sentence for the log).
    ValueError, as server_context's, when the files do not serve at start."""

    def __init__(self, keyfile: str, certfile: str, ca_certs: str, cert_reqs: int, poll: float = POLL):
        self.settings = (keyfile, certfile, ca_certs, cert_reqs)
        self.paths = tuple(p for p in (keyfile, certfile, ca_certs) if p)
        self.poll = poll
        self.report: Callable[[str, str], None] = lambda outcome, sentence: None
        # looked at before the files are read: a change between the two is caught by the first look
        self._seen = files_signature(self.paths)  # what the context in use (or the last failed try) came from
        self.context = server_context(*self.settings)
        self._timer: asyncio.TimerHandle | None = None

    def check(self) -> str | None:
        """Reload if the files changed since the last look: "reloaded", "failed", or None (unchanged)."""
        now = files_signature(self.paths)
        if now == self._seen:
            return None
        self._seen = now  # a failed pair is tried again only once a file changes again
        try:
            self.context = server_context(*self.settings)
        except ValueError as e:
            self.report("failed", f"the changed TLS files did not load; still serving the previous certificate: {e}")
            return "failed"
        self.report("reloaded", "the TLS certificate files changed: new connections get the new certificate")
        return "reloaded"

    def start(self) -> None:
        self._timer = asyncio.get_running_loop().call_later(self.poll, self._tick)

    def _tick(self) -> None:
        try:
            self.check()
        finally:
            self.start()

    def stop(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
