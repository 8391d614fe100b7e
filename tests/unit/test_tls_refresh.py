"""services/router/tls_refresh.py on certificate files made by the real openssl: nothing is read
while the files stay as they are; a whole new pair replaces the context (a new object, the old
one untouched), a half-written one (new certificate, old key) or a missing file leaves the
context in use and is tried again at the next change; the timer looks on an idle loop."""

from __future__ import annotations

import asyncio
import os
import shutil

import pytest

from services.router.tls_refresh import CertificateRefresher
from tests.integration.test_router_tls import certs
from tests.integration.test_router_tls_refresh import mint

pytestmark = pytest.mark.skipif(shutil.which("openssl") is None, reason="openssl is not installed")

__all__ = ["certs"]


@pytest.fixture
def live(tmp_path, certs):
    d = tmp_path / "live"
    d.mkdir()
    for name in ("server.key", "server.pem"):
        shutil.copyfile(certs / name, d / name)
    return d


def refresher(live) -> tuple[CertificateRefresher, list]:
    seen = []
    r = CertificateRefresher(str(live / "server.key"), str(live / "server.pem"), "", 0)
    r.report = lambda outcome, sentence: seen.append((outcome, sentence))
    return r, seen


def test_unchanged_files_are_not_read_again_and_a_whole_pair_replaces_the_context(live, certs, tmp_path):
    r, seen = refresher(live)
    first = r.context
    assert r.check() is None and r.context is first and seen == []
    key, pem = mint(certs, tmp_path / "new", "renewed")
    shutil.copyfile(key, live / "server.key")
    shutil.copyfile(pem, live / "server.pem")
    assert r.check() == "reloaded" and r.context is not first
    assert seen == [("reloaded", "the TLS certificate files changed: new connections get the new certificate")]
    assert r.check() is None


def test_a_half_written_pair_or_a_missing_file_keeps_the_context_in_use(live, certs, tmp_path):
    r, seen = refresher(live)
    first = r.context
    key, pem = mint(certs, tmp_path / "new", "renewed")
    shutil.copyfile(pem, live / "server.pem")  # the certificate first, its key not yet
    assert r.check() == "failed" and r.context is first
    assert "still serving the previous certificate" in seen[-1][1] and "KEY_VALUES_MISMATCH" in seen[-1][1]
    assert r.check() is None  # the same files are not tried again
    os.remove(live / "server.key")
    assert r.check() == "failed" and r.context is first
    shutil.copyfile(key, live / "server.key")
    assert r.check() == "reloaded" and r.context is not first


def test_the_timer_looks_on_an_idle_loop(live, certs, tmp_path):
    key, pem = mint(certs, tmp_path / "new", "renewed")

    async def scenario():
        r, seen = refresher(live)
        r.poll = 0.05
        r.start()
        try:
            shutil.copyfile(key, live / "server.key")
            shutil.copyfile(pem, live / "server.pem")
            for _ in range(100):  # nothing else runs on the loop
                if seen and seen[-1][0] == "reloaded":
                    return True
                await asyncio.sleep(0.02)
            return False
        finally:
            r.stop()

    assert asyncio.run(scenario())
