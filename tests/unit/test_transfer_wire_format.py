"""Wire codecs of the KV transfer (no torch, no nixl)."""

import math
import sys

import pytest

from services.transfer import wire_format as p


def test_notification_roundtrip_and_foreign_messages():
    n = p.KVNotification(room=(1 << 63) - 1, sender_epoch=123, receiver_epoch=456)
    assert p.KVNotification.decode(n.encode()) == n
    for junk in (b"", b"hello", b"pdmesh-kv:1:2", b"pdmesh-kv:a:2:3", b"other:1:2:3"):
        assert p.KVNotification.decode(junk) is None


@pytest.mark.parametrize("x", [0.0, -0.0, -1.5, -123.456e-7, float("-inf"), 3.4e38])
def test_logprob_bits_roundtrip(x):
    assert p.bits_to_float(p.float_to_bits(x)) == x
    assert math.copysign(1, p.bits_to_float(p.float_to_bits(x))) == math.copysign(1, x)


def test_aux_row_words_and_verification():
    row = p.AuxRow(room=42, token=7, logprob=-0.25, epoch=99, cached_tokens=48)
    assert p.AuxRow.from_words(row.words()) == row
    assert p.verify_aux(row, 42, 99) is None
    assert "room 42, expected 43" in p.verify_aux(row, 43, 99)
    assert "epoch 99" in p.verify_aux(row, 42, 98)
    assert p.verify_aux(p.AuxRow.from_words([0] * p.AUX_WORDS), 42, 99) is not None  # a cleared slot never passes


def test_aux_layout_matches_kv_pool():
    from services.engine import kv_pool

    names = ("AUX_ROOM", "AUX_TOKEN", "AUX_LOGPROB_BITS", "AUX_EPOCH", "AUX_CACHED", "AUX_SENT_PAGES", "AUX_CHECKSUM",
             "AUX_WORDS")
    assert [getattr(p, n) for n in names] == [getattr(kv_pool, n) for n in names]


def test_version_mismatch_names_both_versions():
    p.check_protocol_version(p.PROTOCOL_VERSION)
    with pytest.raises(p.ProtocolMismatch) as e:
        p.check_protocol_version(p.PROTOCOL_VERSION + 1, who="decode")
    assert f"version {p.PROTOCOL_VERSION + 1}" in str(e.value) and f"version {p.PROTOCOL_VERSION}" in str(
        e.value
    )


def test_agent_names_unique_per_start():
    e1 = p.new_epoch()
    e2 = p.new_epoch()
    assert e2 >= e1 > 0 and e1 < (1 << 63)
    a, b = p.agent_name("decode", e1, "h", 10), p.agent_name("decode", e2 + 1, "h", 10)
    assert a != b and a.startswith("pdmesh-decode-h-10-")


def test_layout_addresses_and_compat():
    lay = p.MemoryLayout(1000, 64, 4, p.MemoryKind.DRAM, 0, 9000, 32, 2)
    assert lay.page_addr(3) == 1192 and lay.aux_addr(1) == 9032
    with pytest.raises(ValueError):
        lay.page_addr(4)
    with pytest.raises(ValueError):
        lay.aux_addr(2)
    other = p.MemoryLayout(5, 64, 100, p.MemoryKind.VRAM, 1, 7, 32, 9)
    assert lay.compatible_with(other) is None
    assert "page size" in lay.compatible_with(p.MemoryLayout(5, 128, 100, p.MemoryKind.DRAM, 0, 7, 32, 9))


def test_pure_modules_import_neither_torch_nor_nixl():
    import subprocess

    code = (
        "import sys; import services.transfer.state, services.transfer.descriptors, "
        "services.transfer.wire_format, services.transfer.sender, services.transfer.receiver; "
        "bad = [m for m in ('torch', 'nixl_cu12') if m in sys.modules]; print(bad); sys.exit(1 if bad else 0)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr
