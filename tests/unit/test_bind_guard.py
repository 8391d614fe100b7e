"""A worker listening beyond loopback needs an internal token (services/common/bind_guard.py),
and compose's token file is made once, private to the pdmesh user (services/common/token_file.py)."""

from __future__ import annotations

import stat

import pytest

from services.common.bind_guard import insecure_bind_refusal, is_loopback
from services.common.token_file import ensure_token_file


@pytest.mark.parametrize("host,loopback", [
    ("127.0.0.1", True), ("127.8.9.1", True), ("::1", True), ("[::1]", True), ("localhost", True),
    ("0.0.0.0", False), ("::", False), ("", False), ("10.1.2.3", False), ("no-such-host.invalid", False),
])
def test_loopback_addresses(host, loopback):
    assert is_loopback(host) is loopback


def test_refusal_unless_a_token_loopback_or_the_explicit_flag():
    assert "--allow-insecure-bind" in insecure_bind_refusal("0.0.0.0", has_token=False, allow_insecure_bind=False)
    assert insecure_bind_refusal("0.0.0.0", has_token=True, allow_insecure_bind=False) is None
    assert insecure_bind_refusal("0.0.0.0", has_token=False, allow_insecure_bind=True) is None
    assert insecure_bind_refusal("127.0.0.1", has_token=False, allow_insecure_bind=False) is None


def test_token_file_is_made_once_and_private(tmp_path):
    path = tmp_path / "run" / "internal-token"
    assert ensure_token_file(path)
    token = path.read_text().strip()
    assert len(token) == 64 and int(token, 16) >= 0
    assert stat.S_IMODE(path.stat().st_mode) == 0o400
    assert not ensure_token_file(path) and path.read_text().strip() == token  # a restart keeps it
