"""The Sec. IV formulas on small hand-checked cases, and the incremental ledger against a full recomputation."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from overlay.load import (
    CoordMetric,
    LoadLedger,
    best_index,
    coordinate_loads,
    eq11_holds,
    failure_sums,
    l1_node,
    l2_node,
    l3_additional,
    l3_failure_additional,
    l3_node,
)

# Four nodes 0..3 and five topics given by their (N1, N2, N3) and load L_T.  Worked by hand:
#   T1: 0 <- t1 (4), t2 (1); 1 <- t3 (2); 3 <- t4 (0.25), t5 (3)
#   T2: 0 <- t3; 1 <- t1, t5; 2 <- t2, t4
#   T3: 0 <- t4; 1 <- t2; 2 <- t1, t5; 3 <- t3
TOPICS = [((0, 1, 2), 4.0), ((0, 2, 1), 1.0), ((1, 0, 3), 2.0), ((3, 2, 0), 0.25), ((3, 1, 2), 3.0)]
L1 = [5.0, 2.0, 0.0, 3.25]  # eq. (1)
L2 = [7.0, 9.0, 1.25, 3.25]  # eq. (2)
# eq. (3): node 2 is third for t1 (N1=0, N2=1, 4) and t5 (N1=3, N2=1, 3): sums {0: 4, 1: 7, 3: 3} -> 7
# node 1: t2 {0: 1, 2: 1} -> 1; node 3: t3 {1: 2, 0: 2} -> 2; node 0: t4 {3: .25, 2: .25} -> .25
L3A = [0.25, 1.0, 7.0, 2.0]
L3 = [7.25, 10.0, 8.25, 5.25]  # eq. (4)


def ledger() -> LoadLedger:
    led = LoadLedger(4)
    for tr, load in TOPICS:
        led.add(tr, load)
    return led


def test_node_load_formulas_by_hand() -> None:
    assert l1_node([4.0, 1.0]) == 5.0
    assert l2_node([2.0], [4.0, 3.0]) == 9.0
    sums = failure_sums([(0, 1, 4.0), (3, 1, 3.0)])
    assert sums == {0: 4.0, 1: 7.0, 3: 3.0}
    assert l3_additional(sums) == 7.0
    assert l3_additional({}) == 0.0
    assert l3_node(1.25, 7.0) == 8.25


def test_ledger_node_loads_by_hand() -> None:
    led = ledger()
    assert led.node_loads(1).tolist() == L1
    assert led.node_loads(2).tolist() == L2
    assert led.l3a[:4].tolist() == L3A
    assert led.node_loads(3).tolist() == L3


def test_coordinate_loads_by_hand() -> None:
    led = ledger()
    # c with (N1, N2, N3) = (3, 0, 2).  eq. (8): L3_faN(2, c) = max(sums_2[3], sums_2[0]) = max(3, 4) = 4
    assert l3_failure_additional({0: 4.0, 1: 7.0, 3: 3.0}, 3, 0) == 4.0
    m3 = led.metric(3, (3, 0, 2))
    # eqs. (9), (10): L3_N(3) = 5.25, L3_N(0) = 7.25, L2_N(2) + 4 = 5.25; spare = L3_N(2) - 5.25 = 3
    assert (m3.lmax, m3.lmin, m3.spare) == (7.25, 5.25, 3.0)
    m2 = led.metric(2, (3, 0, 2))  # eqs. (6), (7)
    assert (m2.lmax, m2.lmin) == (7.0, 3.25)
    m1 = led.metric(1, (3, 0, 2))  # eq. (5)
    assert (m1.lmax, m1.lmin) == (3.25, 3.25)
    # c with (2, 3, 0): L3_N(2) = 8.25, L3_N(3) = 5.25, L2_N(0) + max(sums_0[2], sums_0[3]) = 7 + .25
    m = led.metric(3, (2, 3, 0))
    assert (m.lmax, m.lmin, m.spare) == (8.25, 5.25, 0.0)
    assert m3.better_than(m)
    assert not m.better_than(m3)


def test_vectorised_coordinate_loads_match_scalar() -> None:
    led = ledger()
    triples = np.array([[3, 0, 2], [2, 3, 0], [0, 1, 2], [1, 3, 0]], dtype=np.int64)
    for level in (1, 2, 3):
        lmax, lmin, spare = led.metrics(level, triples)  # type: ignore[arg-type]
        for i, tr in enumerate(triples):
            m = led.metric(level, (int(tr[0]), int(tr[1]), int(tr[2])))  # type: ignore[arg-type]
            assert (lmax[i], lmin[i], spare[i]) == (m.lmax, m.lmin, m.spare)
    lmax, lmin, spare = coordinate_loads(3, np.array(5.0), np.array(3.0), np.array(2.0), np.array(6.0), np.array(1.5))
    assert (float(lmax), float(lmin), float(spare)) == (5.0, 3.0, 2.5)


def test_better_coordinate_order() -> None:
    # Criterion 1: smaller L_max; 2: smaller L_min on equal L_max; 3: larger spare on equal both.
    assert CoordMetric(5, 9, 0).better_than(CoordMetric(6, 1, 9))
    assert CoordMetric(6, 1, 0).better_than(CoordMetric(6, 2, 9))
    assert CoordMetric(6, 2, 3).better_than(CoordMetric(6, 2, 1))
    assert not CoordMetric(6, 2, 1).better_than(CoordMetric(6, 2, 1))
    # floating-point noise is "equal" and passes the decision on to the next criterion
    assert CoordMetric(0.1 + 0.2, 1, 5).better_than(CoordMetric(0.3, 1, 4))
    # a minimum gain is hysteresis: a small improvement is not enough to move
    assert not CoordMetric(9.5, 0, 0).better_than(CoordMetric(10, 0, 0), min_gain=1.0)
    assert CoordMetric(8.9, 0, 0).better_than(CoordMetric(10, 0, 0), min_gain=1.0)


def test_best_index_lexicographic() -> None:
    lmax = np.array([3.0, 2.0, 2.0, 2.0, 4.0])
    lmin = np.array([0.0, 1.0, 0.5, 0.5, 0.0])
    spare = np.array([9.0, 9.0, 1.0, 2.0, 9.0])
    assert best_index(lmax, lmin, spare) == 3
    with pytest.raises(ValueError):
        best_index(np.array([]), np.array([]), np.array([]))


def test_best_index_draws_among_ties_only() -> None:
    # rows 1, 2 and 4 tie on all three criteria; row 0 is worse on L_max, row 3 on the spare capacity
    lmax = np.array([3.0, 2.0, 2.0, 2.0, 2.0])
    lmin = np.array([0.0, 1.0, 1.0, 1.0, 1.0])
    spare = np.array([9.0, 5.0, 5.0, 4.0, 5.0])
    assert best_index(lmax, lmin, spare) == 1  # no generator: the first
    rng = np.random.default_rng(1)
    picks = [best_index(lmax, lmin, spare, rng) for _ in range(300)]
    assert set(picks) == {1, 2, 4}
    # weighted by how many candidates a row stands for: a row of weight 0 is never drawn, 3:1 shows
    weights = np.array([1.0, 3.0, 0.0, 1.0, 1.0])
    picks = [best_index(lmax, lmin, spare, rng, weights) for _ in range(2000)]
    assert 2 not in picks and set(picks) == {1, 4}
    assert 2.4 < picks.count(1) / picks.count(4) < 3.8


def test_incremental_remove_and_resize_by_hand() -> None:
    led = ledger()
    led.remove((3, 1, 2), 3.0)  # t5 leaves: node 2's sums become {0: 4, 1: 4} -> L3_aN(2) = 4
    assert led.l3a[2] == 4.0
    assert led.node_loads(3)[2] == 1.25 + 4.0
    led.add((0, 1, 2), 1.5)  # growing t1 from 4 to 5.5 is adding the difference
    assert led.node_loads(1)[0] == 6.5
    assert led.l3a[2] == 5.5


def test_fewer_than_three_nodes_use_the_pad() -> None:
    led = LoadLedger(2)
    led.add((0, 1, led.pad), 2.0)
    assert led.node_loads(2).tolist() == [2.0, 2.0]
    assert led.node_loads(3).tolist() == [2.0, 2.0]
    m = led.metric(3, (1, 0, led.pad))
    assert m.lmax == 2.0


def test_eq11() -> None:
    assert eq11_holds(5.0, 6.0, 1.0, 4.0)
    assert eq11_holds(5.0, 5.0, 1.0, 5.0)
    assert not eq11_holds(5.0, 5.5, 1.0, 4.0)


triple_strategy = st.integers(3, 6).flatmap(
    lambda n: st.tuples(
        st.just(n),
        st.lists(
            st.tuples(
                st.permutations(list(range(n))).map(lambda p: (p[0], p[1], p[2])),
                st.sampled_from([0.25, 1.0, 4.0, 2.5]),
                st.sampled_from(["add", "remove", "grow"]),
            ),
            min_size=1,
            max_size=40,
        ),
    )
)


@settings(max_examples=150, deadline=None)
@given(triple_strategy)
def test_incremental_equals_full_recomputation(
    case: tuple[int, list[tuple[tuple[int, int, int], float, str]]],
) -> None:
    n, ops = case
    led = LoadLedger(n)
    live: list[tuple[tuple[int, int, int], float]] = []
    for tr, load, op in ops:
        if op == "remove" and live:
            old_tr, old_load = live.pop(0)
            led.remove(old_tr, old_load)
        elif op == "grow" and live:
            old_tr, old_load = live[-1]
            led.add(old_tr, load)
            live[-1] = (old_tr, old_load + load)
        else:
            led.add(tr, load)
            live.append((tr, load))
    full = LoadLedger.recompute(n, live)
    for level in (1, 2, 3):
        assert np.allclose(led.node_loads(level), full.node_loads(level), atol=1e-9)  # type: ignore[arg-type]
    all_triples = np.array([[a, b, c] for a in range(n) for b in range(n) for c in range(n) if len({a, b, c}) == 3])
    for level in (1, 2, 3):
        got = led.metrics(level, all_triples)  # type: ignore[arg-type]
        want = full.metrics(level, all_triples)  # type: ignore[arg-type]
        for g, w in zip(got, want, strict=True):
            assert np.allclose(g, w, atol=1e-9)
    assert not math.isnan(float(led.node_loads(3).sum()))
