"""Coordinate selection and the decisions of Alg. 1 / Alg. 2; growth model and moved load."""

from __future__ import annotations

import copy
import math

import numpy as np
import pytest

from overlay.balance import BalanceParams, Goal, Offer, Selection, decide, smallest_topics, tiebreaker
from overlay.dynamics import (
    exponential_sizes,
    growth_rates,
    max_growth_rate,
    moved_load,
    moved_load_rate,
    topic_sizes,
)
from overlay.geometry import UNIT_SQUARE
from overlay.load import CoordMetric, LoadLedger
from sim.world import SimNetwork


def test_tiebreaker_and_decide() -> None:
    a = Offer("a", CoordMetric(5, 2, 0))
    b = Offer("b", CoordMetric(4, 3, 0))
    c = Offer("c", CoordMetric(4, 3, 1))
    assert tiebreaker([a, b, c]).coord == "c"
    assert tiebreaker([b, Offer("b2", CoordMetric(4, 3, 0))]).coord == "b"  # first wins a full tie
    assert decide(CoordMetric(6, 0, 0), [a, b]) == b
    assert decide(CoordMetric(4, 3, 0), [b]) is None  # not better than staying
    assert decide(CoordMetric(4.5, 0, 0), [b], min_gain=1.0) is None
    assert decide(CoordMetric(6, 0, 0), []) is None


def test_random_tiebreaker_draws_among_the_best_and_never_moves_on_a_tie() -> None:
    best1, best2, worse = (
        Offer("p", CoordMetric(4, 3, 1)),
        Offer("q", CoordMetric(4, 3, 1)),
        Offer("r", CoordMetric(5, 0, 9)),
    )
    rng = np.random.default_rng(3)
    picks = {tiebreaker([worse, best1, best2], rng).coord for _ in range(100)}
    assert picks == {"p", "q"}
    assert all(decide(CoordMetric(4, 3, 1), [best1, best2], rng=rng) is None for _ in range(20))
    assert {decide(CoordMetric(6, 0, 0), [worse, best1, best2], rng=rng).coord for _ in range(100)} == {"p", "q"}  # type: ignore[union-attr]


def test_smallest_topic() -> None:
    assert smallest_topics({"x": 4.0, "y": 0.25, "z": 0.25}, 1) == ["y"]
    assert smallest_topics({}, 1) == []
    assert smallest_topics({"x": 4.0, "y": 0.25, "z": 0.25, "w": 1.0}, 3) == ["y", "z", "w"]
    assert smallest_topics({"x": 4.0}, 5) == ["x"]
    assert smallest_topics({}, 2) == []


def test_params_validation() -> None:
    with pytest.raises(ValueError, match="n_queries"):
        BalanceParams(n_queries=0)
    with pytest.raises(ValueError, match="min_gain"):
        BalanceParams(min_gain=-1)
    with pytest.raises(ValueError, match="scan must be at least 1"):
        BalanceParams(scan=0)
    assert Goal("L2").level == 2


def test_growth_model_eq12_and_exponential_sizes() -> None:
    assert max_growth_rate(10.0, 1.0) == pytest.approx(math.log(10.0))
    rates = growth_rates(100, 10.0)
    sizes = topic_sizes(rates, 1.0)
    assert sizes.min() == pytest.approx(1.0) and sizes.max() == pytest.approx(10.0)
    # Sec. VII-A: mean 3.9247 and coefficient of variation 0.6472 for n = 100, λ = 2.3026
    ex = exponential_sizes(100)
    assert ex.mean() == pytest.approx(3.9247, abs=1e-4)
    assert ex.std(ddof=1) / ex.mean() == pytest.approx(0.6472, abs=1e-4)  # the sample CV
    assert np.allclose(ex, sizes)
    with pytest.raises(ValueError):
        max_growth_rate(0.5, 1.0)


def test_moved_load_eq13_eq14() -> None:
    assert moved_load([1.0, 2.5]) == 3.5
    # W = 2: R(1) = 4/1, R(2) = (4+0)/2, R(3) = (0+6)/2, R(4) = (6+2)/2
    assert moved_load_rate([4.0, 0.0, 6.0, 2.0], 2).tolist() == [4.0, 2.0, 3.0, 4.0]


@pytest.mark.parametrize("selection", list(Selection))
def test_balanced_addition_lowers_l3_imbalance(selection: Selection) -> None:
    rng = np.random.default_rng(11)
    pts = UNIT_SQUARE.uniform(rng, 30)
    homes = UNIT_SQUARE.uniform(rng, 600)
    loads = np.where(rng.random(600) < 0.2, 4.0, 0.25)
    plain = SimNetwork(pts, UNIT_SQUARE, np.random.default_rng(1), with_candidates=False)
    bal = SimNetwork(pts, UNIT_SQUARE, np.random.default_rng(1), per_node=50)
    params = BalanceParams(goal=Goal.L3, selection=selection, n_queries=10, n_hops=1)
    for h, load in zip(homes, loads, strict=True):
        plain.add_topic(h, load)
        bal.add_balanced(h, load, params, rng)
    assert bal.ledger.node_loads(3).max() < 0.8 * plain.ledger.node_loads(3).max()
    # loads are conserved whatever the placement: L1 sums to the total topic load, L2 to twice it
    assert bal.ledger.node_loads(1).sum() == pytest.approx(loads.sum())
    assert bal.ledger.node_loads(2).sum() == pytest.approx(2 * loads.sum())


def test_eq11_holds_after_every_bestglobal_addition() -> None:
    for seed in range(4):
        rng = np.random.default_rng(seed)
        net = SimNetwork(UNIT_SQUARE.uniform(rng, 6), UNIT_SQUARE, rng, per_node=40)
        params = BalanceParams(goal=Goal.L3, selection=Selection.BESTGLOBAL)
        for h, load in zip(UNIT_SQUARE.uniform(rng, 60), rng.choice([0.25, 1.0, 4.0], 60), strict=True):
            net.add_balanced(h, float(load), params, rng, check_eq11=True)
        assert net.eq11_violations == 0


def test_world_incremental_loads_match_recomputation_after_moves() -> None:
    rng = np.random.default_rng(5)
    net = SimNetwork(UNIT_SQUARE.uniform(rng, 12), UNIT_SQUARE, rng, per_node=30)
    params = BalanceParams(goal=Goal.L3, selection=Selection.BESTLOCAL, n_queries=3)
    for h in UNIT_SQUARE.uniform(rng, 80):
        net.add_topic(h, float(rng.choice([0.25, 4.0])))
    moves = 0
    for step in range(200):
        net.set_load(step % 80, net.loads[step % 80] * 1.01)
        if net.balance_step(int(rng.integers(12)), params, rng) is not None:
            moves += 1
    assert moves > 0
    full = LoadLedger.recompute(12, zip(net.triples, net.loads, strict=True))
    for level in (1, 2, 3):
        assert np.allclose(net.ledger.node_loads(level), full.node_loads(level))  # type: ignore[arg-type]


def test_alg2_scan_moves_the_next_smallest_topic_when_the_smallest_cannot_move() -> None:
    # A balanced overlay whose topics then grow at different rates (Sec. VIII-A).  Find a node whose smallest
    # topic has no better coordinate (the paper's Alg. 2 stalls there) and check that scanning moves the
    # smallest topic that does have one, leaving the loads consistent.
    rng = np.random.default_rng(1)
    net = SimNetwork(UNIT_SQUARE.uniform(rng, 10), UNIT_SQUARE, rng, per_node=40)
    one = BalanceParams(goal=Goal.L3, selection=Selection.BESTGLOBAL)
    scan = BalanceParams(goal=Goal.L3, selection=Selection.BESTGLOBAL, scan=100)
    for h in UNIT_SQUARE.uniform(rng, 100):
        net.add_balanced(h, 1.0, one, rng)
    for t, size in enumerate(topic_sizes(growth_rates(100, 10.0), 1.0)):
        net.set_load(t, float(size))
    found = 0
    for v in range(10):
        if copy.deepcopy(net).balance_step(v, one, rng) is not None:
            continue
        trial = copy.deepcopy(net)
        mv = trial.balance_step(v, scan, rng)
        if mv is None:
            continue
        found += 1
        order = smallest_topics(net.responsible(v, 3), 100)
        assert mv.topic != order[0]
        for t in order[: order.index(mv.topic)]:  # every smaller topic really had nowhere better to go
            assert copy.deepcopy(net)._try_move(v, t, one, rng) is None
        full = LoadLedger.recompute(10, zip(trial.triples, trial.loads, strict=True))
        assert np.allclose(trial.ledger.node_loads(3), full.node_loads(3))
    assert found > 0
