"""Heap trimming after connection churn (broker/memory.py): when it trims, and that glibc's trim is found."""

from __future__ import annotations

import sys

import pytest

from broker.memory import HeapTrimmer


def test_trims_after_enough_closes_and_not_more_often_than_the_interval() -> None:
    calls: list[int] = []
    t = HeapTrimmer(lambda: calls.append(1), after=3, min_interval=5.0)
    t.closed()
    t.closed()
    assert not t.maybe_trim(100.0) and calls == []  # too few closes, and more are coming
    t.closed()
    assert t.maybe_trim(100.0) and calls == [1] and t.closed_since == 0
    for _ in range(10):
        t.closed()
    assert not t.maybe_trim(103.0)  # within the interval
    assert t.maybe_trim(105.5) and len(calls) == 2 and t.trims == 2


def test_trims_when_a_small_burst_is_over() -> None:
    calls: list[int] = []
    t = HeapTrimmer(lambda: calls.append(1), after=100, min_interval=1.0)
    for _ in range(30):
        t.closed()
    assert not t.maybe_trim(10.0)  # closes are still coming in
    assert t.maybe_trim(10.05) and calls == [1]  # none since the last tick: the burst is over
    t.closed()
    assert not t.maybe_trim(20.0) and not t.maybe_trim(20.1)  # one close is no burst: no collection


def test_a_quiet_broker_never_trims() -> None:
    calls: list[int] = []
    t = HeapTrimmer(lambda: calls.append(1), after=1)
    assert not any(t.maybe_trim(float(s)) for s in range(0, 100, 10)) and calls == []


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="malloc_trim is glibc's")
def test_glibc_trim_is_found_and_runs() -> None:
    t = HeapTrimmer(after=1, min_interval=0.0)
    assert t.available
    t.closed()
    assert t.maybe_trim(1.0)
