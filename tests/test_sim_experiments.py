"""The experiment functions behind `sedax sim`: load models, vectorised loads, averaged-CCDF quantiles."""

from __future__ import annotations

import math

import numpy as np
import pytest

from overlay.balance import BalanceMode, BalanceParams, Goal, Selection
from overlay.candidates import triples_for
from overlay.load import LoadLedger
from sim.experiments import (
    GrowthConfig,
    LoadModel,
    Order,
    QuantileRule,
    StaticConfig,
    apply_order,
    averaged_ccdf,
    ccdf_quantile,
    loads_from_triples,
    run_growth,
    run_static,
    static_topic_loads,
)


def test_load_models() -> None:
    rng = np.random.default_rng(0)
    het = static_topic_loads(LoadModel.HETEROGENEOUS, 1000, rng)
    assert np.count_nonzero(het == 4.0) == 200 and np.count_nonzero(het == 0.25) == 800
    assert het.mean() == pytest.approx(1.0) and het.std() / het.mean() == pytest.approx(1.5)
    exp = static_topic_loads(LoadModel.EXPONENTIAL, 100, rng)
    assert exp.mean() == pytest.approx(3.9247, abs=1e-4)  # Sec. VII-A
    assert exp.std(ddof=1) / exp.mean() == pytest.approx(0.6472, abs=1e-4)  # the paper uses the sample SD
    assert list(apply_order(np.array([2.0, 1.0, 3.0]), Order.DESCENDING)) == [3.0, 2.0, 1.0]
    assert list(apply_order(np.array([2.0, 1.0, 3.0]), Order.ASCENDING)) == [1.0, 2.0, 3.0]


@pytest.mark.parametrize("n", [1, 2, 3, 9])
def test_vectorised_loads_match_the_ledger(n: int) -> None:
    rng = np.random.default_rng(n)
    points = rng.random((n, 2))
    coords = rng.random((60, 2))
    weights = rng.exponential(size=60)
    triples = triples_for(points, coords)
    placements = [((int(a), int(b), int(d)), float(w)) for (a, b, d), w in zip(triples, weights, strict=True)]
    led = LoadLedger.recompute(n, placements)
    fast = loads_from_triples(n, triples, weights)
    for i, level in enumerate((1, 2, 3)):
        assert np.allclose(fast[i], led.node_loads(level))  # type: ignore[arg-type]


def test_ccdf_quantile_rules() -> None:
    # Two runs of loads on a grid of 10: CCDF at 10 = 75%, at 20 = 25%, at 30 = 0%.
    runs = [np.array([10.0, 20.0]), np.array([20.0, 30.0])]
    xs, ys = averaged_ccdf(runs)
    assert list(xs) == [10.0, 20.0, 30.0] and list(ys) == [75.0, 25.0, 0.0]
    assert ccdf_quantile(runs, 0.5, QuantileRule.STEP) == 20.0
    assert ccdf_quantile(runs, 0.5, QuantileRule.INTERPOLATED) == pytest.approx(10.0 + 25.0 / 50.0 * 10.0)
    assert ccdf_quantile(runs, 0.05, QuantileRule.INTERPOLATED) == 10.0  # below the first point: its value
    # runs count equally even when they differ in size
    xs, ys = averaged_ccdf([np.array([1.0]), np.array([1.0, 2.0, 2.0, 2.0])])
    assert list(ys) == [pytest.approx(37.5), 0.0]


def test_static_run_is_deterministic_and_shares_the_overlay() -> None:
    plain = StaticConfig(nodes=20, topics_per_node=5, loads=LoadModel.HETEROGENEOUS)
    bal = StaticConfig(
        nodes=20,
        topics_per_node=5,
        loads=LoadModel.HETEROGENEOUS,
        balance=BalanceMode.ADDITION,
        params=BalanceParams(goal=Goal.L2, selection=Selection.INDCOORD, n_queries=3),
    )
    a, b, c = run_static(plain, 7), run_static(plain, 7), run_static(bal, 7)
    assert np.array_equal(a.loads, b.loads)
    assert np.array_equal(a.overlay.points, c.overlay.points)
    assert a.norm == c.norm == pytest.approx(5.0)
    assert c.loads[0].sum() == pytest.approx(a.loads[0].sum())  # balancing moves load, never loses it


def test_growth_sizes_and_moved_load() -> None:
    cfg = GrowthConfig(nodes=5, topics_per_node=4, delta_tau=0.05, balance=BalanceMode.COMBINED, keep_steps=True)
    run = run_growth(cfg, 2)
    assert run.before_norm == pytest.approx(4.0)
    sizes = np.exp(np.linspace(0.0, math.log(10.0), 20))  # eq. (12): from 1 to L_T^max = 10
    assert run.after_norm == pytest.approx(sizes.sum() / 5)
    assert run.after[0].sum() == pytest.approx(sizes.sum())
    assert run.v_ml.sum() == pytest.approx(sum(m.load for m in run.moves if m.kind == "move"))
    assert run.step_loads is not None and run.step_loads.shape == (21, 3, 5)
    assert np.array_equal(run.step_loads[-1], run.after)
