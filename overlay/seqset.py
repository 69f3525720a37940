"""Which sequence numbers of each publisher a replica holds: sets of disjoint, inclusive ranges.

Records are identified by (publisher, seq), so two replicas' histories merge as a set union
(shared/notes/storage-anchors.md).  A replica that missed a stretch (a batch lost with a dying link, a
partition) must still accept it later, so "already stored?" is a membership test, not a comparison with the
highest sequence number seen.  Ranges keep that exact at the cost of one pair per gap: a publisher's history is
almost always one range.

The same ranges are the digest two replicas exchange to find what one lacks (`Digest`, `missing`), the analogue
of KIP-101's divergence point: per publisher, the stretches each holds.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable, Iterator, Mapping
from typing import TypeAlias

# publisher -> its held ranges (lo, hi), inclusive, sorted, disjoint and not adjacent
Digest: TypeAlias = dict[str, tuple[tuple[int, int], ...]]


class SeqRanges:
    """A set of non-negative integers kept as sorted, disjoint, non-adjacent inclusive ranges."""

    __slots__ = ("_his", "_los")

    def __init__(self, ranges: Iterable[tuple[int, int]] = ()) -> None:
        self._los: list[int] = []
        self._his: list[int] = []
        for lo, hi in ranges:
            self.add_range(lo, hi)

    def __contains__(self, seq: object) -> bool:
        if not isinstance(seq, int):
            return False
        i = bisect.bisect_right(self._los, seq) - 1
        return i >= 0 and seq <= self._his[i]

    def __len__(self) -> int:
        """How many numbers are held."""
        return sum(h - lo + 1 for lo, h in zip(self._los, self._his, strict=True))

    def __iter__(self) -> Iterator[tuple[int, int]]:
        return iter(zip(self._los, self._his, strict=True))

    def __eq__(self, other: object) -> bool:
        return isinstance(other, SeqRanges) and self._los == other._los and self._his == other._his

    def __repr__(self) -> str:
        return f"SeqRanges({list(self)})"

    @property
    def max(self) -> int:
        """The highest number held, -1 when empty."""
        return self._his[-1] if self._his else -1

    def ranges(self) -> tuple[tuple[int, int], ...]:
        return tuple(self)

    def add(self, seq: int) -> None:
        """Add one number (the common case, the next of the last range, costs no search)."""
        if self._his and seq == self._his[-1] + 1:
            self._his[-1] = seq
            return
        self.add_range(seq, seq)

    def add_range(self, lo: int, hi: int) -> None:
        """Add lo..hi (inclusive), merging with every range it touches or adjoins."""
        if hi < lo:
            return
        i = bisect.bisect_left(self._his, lo - 1)  # the first range that ends at or after lo - 1
        j = bisect.bisect_right(self._los, hi + 1)  # one past the last range that starts at or before hi + 1
        if i < j:
            lo = min(lo, self._los[i])
            hi = max(hi, self._his[j - 1])
        self._los[i:j] = [lo]
        self._his[i:j] = [hi]

    def discard(self, seq: int) -> None:
        """Remove one number (a record rolled back because the disk was full)."""
        i = bisect.bisect_right(self._los, seq) - 1
        if i < 0 or seq > self._his[i]:
            return
        lo, hi = self._los[i], self._his[i]
        pieces = [(a, b) for a, b in ((lo, seq - 1), (seq + 1, hi)) if a <= b]
        self._los[i : i + 1] = [a for a, _ in pieces]
        self._his[i : i + 1] = [b for _, b in pieces]


def digest_of(held: Mapping[str, SeqRanges]) -> Digest:
    """The wire form of what a replica holds."""
    return {pub: r.ranges() for pub, r in held.items()}


def ranges_of(digest: Mapping[str, Iterable[Iterable[int]]]) -> dict[str, SeqRanges]:
    """The held sets a peer's digest describes (malformed pairs are ignored: a digest only narrows a transfer)."""
    out: dict[str, SeqRanges] = {}
    for pub, pairs in digest.items():
        r = out[str(pub)] = SeqRanges()
        for pair in pairs:
            bounds = tuple(pair)
            if len(bounds) == 2 and all(isinstance(b, int) for b in bounds) and 0 <= bounds[0] <= bounds[1]:
                r.add_range(bounds[0], bounds[1])
    return out


def lacks(theirs: Mapping[str, SeqRanges], publisher: str, seq: int) -> bool:
    """True if a peer whose digest is `theirs` does not hold (publisher, seq)."""
    r = theirs.get(publisher)
    return r is None or seq not in r


def ranges_minus(ours: Iterable[tuple[int, int]], theirs: SeqRanges) -> tuple[tuple[int, int], ...]:
    """The ranges of the numbers of ours (sorted, disjoint ranges) that theirs lacks."""
    out: list[tuple[int, int]] = []
    los, his = theirs._los, theirs._his
    for lo, hi in ours:
        i = bisect.bisect_left(his, lo)  # the first of their ranges that ends at or after lo
        while i < len(los) and los[i] <= hi:
            if los[i] > lo:
                out.append((lo, los[i] - 1))
            lo = his[i] + 1
            i += 1
        if lo <= hi:
            out.append((lo, hi))
    return tuple(out)


def count_outside(ours: Iterable[tuple[int, int]], theirs: SeqRanges | None) -> int:
    """How many numbers of ours (sorted, disjoint ranges) theirs lacks, from the ranges alone."""
    return sum(hi - lo + 1 for lo, hi in (ours if theirs is None else ranges_minus(ours, theirs)))


def covers(theirs: Mapping[str, SeqRanges], ours: Mapping[str, SeqRanges]) -> bool:
    """True if `theirs` holds every number `ours` holds."""
    for pub, mine in ours.items():
        other = theirs.get(pub)
        for lo, hi in mine:
            if other is None:
                return False
            i = bisect.bisect_right(other._los, lo) - 1
            if i < 0 or other._his[i] < hi:
                return False
    return True
