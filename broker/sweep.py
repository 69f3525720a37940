"""A sweep: every key of a mapping that changes, visited once per period, a slice per call.

A broker's timers run often (pub/sub's every 0.05 s while it has work), and a timer that looked at every topic
held at each run cost what the broker holds, not what it does: at 100,000 topics each run took ~0.1 s, back to
back, and a publish waited ~0.2 s for its acknowledgement (benchmarks/bench_listing.py, docs/benchmarks-scale.md).
What needs a precise time-out (an unconfirmed batch, an offer, a pull) is kept apart and looked at when it is up
(`TopicTable.due`); the coarse checks (retention, a move's 5 s time-out, anti-entropy every 5 s) see each
topic within a period through a sweep, whose slices are proportional to the time since the last one.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Generic, TypeVar

K = TypeVar("K")

# Every key is visited at least this often, busy or idle: what the slices see is coarse (anti-entropy every 5 s,
# retention's age, a copy ranked out), and each look costs ~1-2 us a topic, so at 100,000 topics a round a second
# took ~15 % of a core while the broker had work (docs/benchmarks-scale.md).  Precise time-outs are not swept.
SWEEP_PERIOD = 4.0
# A slice is at most this share of the keys: an idle broker's timers run once a second, and a whole round in one
# run at 100,000 topics held up whatever came in meanwhile for ~0.1 s.  Idle, a round so takes four runs: the
# same SWEEP_PERIOD as while the timers run every 0.05 s.
MAX_SHARE = 0.25


class Sweep(Generic[K]):
    """Visits the keys of a mapping in slices: a call at `now` takes the share of them the time since the last
    call is of `period` (MAX_SHARE at most; all of them at the first call), from where the last slice ended.  A
    key added meanwhile is visited in the next round; one gone since is still returned (the caller looks it
    up)."""

    def __init__(self, period: float = SWEEP_PERIOD) -> None:
        self.period = period
        self._keys: list[K] = []
        self._at = 0
        self._last: float | None = None

    def take(self, mapping: Mapping[K, object], now: float) -> list[K]:
        if self._last is None:  # the first call: a whole round
            self._last = now
            return list(mapping)
        share = min(MAX_SHARE, max(0.0, now - self._last) / self.period)
        self._last = now
        want = math.ceil(len(mapping) * share - 1e-9)  # (not one more for a clock's rounding)
        if self._at >= len(self._keys):
            self._keys, self._at = list(mapping), 0
        out = self._keys[self._at : self._at + want]
        self._at += len(out)
        return out
