"""The retraction policy: who gives up KV pages when decode's pool runs dry."""

from __future__ import annotations

from services.decode.retraction import choose_victim


def test_the_latest_arrival_after_the_needing_request_goes_first():
    d = choose_victim("a", ["b", "c"], batch_empty=True, others_hold_pages=False)
    assert d.victim == "c" and not d.fail


def test_the_needing_request_steps_aside_when_earlier_ones_run():
    d = choose_victim("c", [], batch_empty=False, others_hold_pages=False)
    assert d.victim == "c" and not d.fail


def test_the_needing_request_steps_aside_when_waiting_requests_hold_pages():
    # pages held by requests still waiting for their KV (or quarantined) come back later
    d = choose_victim("a", [], batch_empty=True, others_hold_pages=True)
    assert d.victim == "a" and not d.fail


def test_alone_with_every_page_it_fails_instead_of_waiting_forever():
    d = choose_victim("a", [], batch_empty=True, others_hold_pages=False)
    assert d.victim is None and d.fail
