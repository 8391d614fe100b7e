"""Invariant 7's view of the router's pair marks during one partial partition: which pairs other
than the cut one it marked. Faults run back to back when a restart is slow, so a mark an earlier
fault left may still stand, waiting for its canary, when the cut begins: that one is not the
cut's doing, unless it clears and comes back while the cut lasts."""

from __future__ import annotations

Pair = tuple[str, str]  # (prefill, decode) gRPC addresses


class OtherMarks:
    def __init__(self, cut: Pair, marked_at_start: set[Pair]):
        self.cut = cut
        self.standing_at_start = frozenset(marked_at_start - {cut})
        self._standing = set(self.standing_at_start)  # earlier faults' marks not yet cleared
        self.marked: set[Pair] = set()  # other pairs this cut marked

    def see(self, marks: set[Pair]) -> None:
        """One scrape of the marks during the cut."""
        self._standing &= marks
        self.marked |= marks - {self.cut} - self._standing
