"""Invariant 7 counts the other pairs a partial partition marks, not a mark an earlier fault left
standing when the cut began (chaos/soak_marks.py)."""

from __future__ import annotations

from chaos.soak_marks import OtherMarks

CUT, LEFT, OTHER = ("p1", "d0"), ("p1", "d1"), ("p0", "d1")


def test_a_mark_standing_from_an_earlier_fault_is_not_the_cuts():
    marks = OtherMarks(CUT, {LEFT})
    marks.see({LEFT})
    marks.see({LEFT, CUT})
    marks.see({CUT})  # its canary passed: cleared
    assert marks.marked == set() and marks.standing_at_start == {LEFT}


def test_a_standing_mark_that_clears_and_comes_back_is_the_cuts():
    marks = OtherMarks(CUT, {LEFT})
    marks.see({LEFT, CUT})
    marks.see({CUT})
    marks.see({CUT, LEFT})
    assert marks.marked == {LEFT}


def test_a_pair_newly_marked_during_the_cut_counts_and_the_cut_pair_never_does():
    marks = OtherMarks(CUT, {CUT})
    marks.see({CUT})
    marks.see({CUT, OTHER})
    marks.see({CUT})
    assert marks.marked == {OTHER} and marks.standing_at_start == set()
