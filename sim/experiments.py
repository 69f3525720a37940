"""The experiments of Sec. VII (static topic sizes) and Sec. VIII (growing topics), as pure functions.

One *run* builds a random overlay from its own seed, adds topics (with or without load-balanced addition,
Alg. 1), lets them grow and rebalance (Alg. 2) where asked, and returns plain arrays.  `summarise_*` turns a
list of runs into the numbers of the paper's tables: quantiles of the CCDF averaged over runs (Sec. VII-A),
100% = the mean topic load per node.  Nothing here prints, writes files or looks at the clock; the CLI does.

Setup choices the paper leaves open, and why they are what they are:

* Nodes and topic coordinates h(t) are uniform on the bounded unit square (Sec. VII-A: "a square plane", "a
  random coordinate h(t)").  A torus was tried and rejected: it removes the boundary cells that raise the
  mean L3 load, and Table I's L3 means (257.4%..271.3%) match the bounded square to within 0.5 points but
  are 5 points above a torus (docs/reproduction.md).
* Heterogeneous loads use exactly 20% topics of load 4 and 80% of load 1/4 in random order, so the mean is
  exactly 1 in every run (the paper gives the proportions, not a sampling rule).
* Tiebreaker(C*) (Alg. 1/2 line 3) draws uniformly among several best coordinates ("several best coordinates
  may exist", Sec. IV-D); taking always the first sends every topic of a tie to one coordinate and left the
  balanced q95 of Tables III-V 5-15 points above the paper (`--ties first` keeps that rule for comparison).
* Every random draw of a run comes from one generator seeded with the run's seed, in a fixed order (nodes,
  topic coordinates, topic order, then candidates and queries), so the same seed gives the same overlay and
  topics with and without balancing, as the paper does ("the same seeds for all corresponding experiments").
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Final

import numpy as np
from scipy.spatial import cKDTree

from overlay.balance import BalanceMode, BalanceParams, Goal, Selection
from overlay.candidates import triples_for
from overlay.dynamics import exponential_sizes, growth_rates, moved_load_rate, topic_sizes
from overlay.geometry import UNIT_SQUARE, FloatArray, IntArray, delaunay_neighbours, polygon_area, voronoi_cells
from overlay.load import LEVELS
from sim.world import SimNetwork

# Share of large topics in the heterogeneous load model (Sec. VII-A): 20% of load 4, 80% of load 1/4.
HETEROGENEOUS_LARGE_SHARE: Final = 0.2
HETEROGENEOUS_LARGE: Final = 4.0
HETEROGENEOUS_SMALL: Final = 0.25
# W = D / 10 for the moved-load rate R_ML, eq. (14).
RATE_WINDOW_SHARE: Final = 0.1
QUANTILES: Final = (0.05, 0.95)


class LoadModel(StrEnum):
    """Static topic loads of Sec. VII-A."""

    HOMOGENEOUS = "homogeneous"  # L_T = 1
    HETEROGENEOUS = "heterogeneous"  # 80% L_T = 1/4, 20% L_T = 4: mean 1, CV 1.5
    EXPONENTIAL = "exponential"  # L_T(i) = exp(λ i / (n - 1)), λ = ln 10 (Sec. VII-D)


class Order(StrEnum):
    """Topic addition order (Table IV)."""

    RANDOM = "random"
    ASCENDING = "ascending"
    DESCENDING = "descending"


class QuantileRule(StrEnum):
    """How a quantile is read off the averaged CCDF.

    INTERPOLATED: the averaged CCDF is a polyline through its values at the observed loads, and the quantile
    is where that line crosses the level.  STEP: the smallest observed load at which the CCDF is at or below
    the level (an order statistic of the pooled loads).  Both give the same numbers for continuous loads;
    they differ when loads sit on a grid (10 homogeneous topics per node: multiples of 10%), where the
    paper's q5 of 12.0% and 60.8% show that it interpolates.
    """

    INTERPOLATED = "interpolated"
    STEP = "step"


@dataclass(frozen=True, slots=True)
class StaticConfig:
    """One static experiment (Sec. VII): an overlay, topics added one by one, node loads at the end."""

    nodes: int = 100
    topics_per_node: int = 100
    loads: LoadModel = LoadModel.HOMOGENEOUS
    balance: BalanceMode = BalanceMode.NONE
    params: BalanceParams = field(default_factory=lambda: BalanceParams(selection=Selection.BESTGLOBAL))
    order: Order = Order.RANDOM
    keep_moves: bool = False  # return the delegations (for --log-dir)
    # The nodes' coordinates (as many as nodes), the same in every run; None: uniform, drawn per run.  A live
    # cluster's coordinates, to set the simulator beside it (benchmarks/bench_scale.py).
    coords: tuple[tuple[float, float], ...] | None = None

    def __post_init__(self) -> None:
        _check_size(self.nodes, self.topics_per_node)
        _check_coords(self.coords, self.nodes)
        if self.balance not in (BalanceMode.NONE, BalanceMode.ADDITION):
            raise ValueError(f"static topics balance only at addition, got {self.balance}")

    @property
    def checks_eq11(self) -> bool:
        """Eq. (11) is the paper's check for BestGlobalCoord with goal L3 (Sec. VII-C1)."""
        return (
            self.balance is BalanceMode.ADDITION
            and self.params.selection is Selection.BESTGLOBAL
            and self.params.goal is Goal.L3
        )


@dataclass(frozen=True, slots=True)
class GrowthConfig:
    """One growth experiment (Sec. VIII): topics start at size 1 and grow by eq. (12) over D = 1."""

    nodes: int = 10
    topics_per_node: int = 10
    l_max: float = 10.0
    delta_tau: float = 0.01
    balance: BalanceMode = BalanceMode.NONE
    params: BalanceParams = field(default_factory=lambda: BalanceParams(selection=Selection.BESTGLOBAL))
    keep_steps: bool = False  # return node loads of every step and the moves (for --log-dir)
    coords: tuple[tuple[float, float], ...] | None = None  # as StaticConfig.coords

    def __post_init__(self) -> None:
        _check_size(self.nodes, self.topics_per_node)
        _check_coords(self.coords, self.nodes)
        if not 0.0 < self.delta_tau <= 1.0:
            raise ValueError(f"delta-tau must be in (0, 1], got {self.delta_tau}")
        if self.l_max < 1.0:
            raise ValueError(f"L_T^max must be at least 1, got {self.l_max}")

    @property
    def steps(self) -> int:
        """Number of Δτ steps in D = 1 (rounded: Δτ = 0.001 must give 1000 steps, not 999)."""
        return max(1, round(1.0 / self.delta_tau))

    @property
    def checks_eq11(self) -> bool:
        """Eq. (11) is checked during the initial BestGlobalCoord addition for goal L3."""
        return (
            self.balance.at_addition and self.params.selection is Selection.BESTGLOBAL and self.params.goal is Goal.L3
        )


@dataclass(frozen=True, slots=True)
class MoveRecord:
    """A delegation: at addition (Alg. 1, `step` = -1 in growth, 0 in static) or by Alg. 2."""

    step: int
    node: int  # the delegating node: N1(h(t)) at addition, the balancing node for Alg. 2
    topic: int
    load: float
    source: tuple[float, float]
    target: tuple[float, float]
    kind: str  # "delegation" (Alg. 1) or "move" (Alg. 2)


@dataclass(frozen=True, slots=True)
class Overlay:
    """The node side of one run: positions, Delaunay neighbours, Voronoi cell areas (share of the space)."""

    points: FloatArray
    neighbours: list[list[int]]
    cell_area: FloatArray


@dataclass(frozen=True, slots=True)
class StaticRun:
    """Result of one static run; loads[i - 1] is L^i_N of every node in topic units."""

    loads: FloatArray  # shape (3, nodes)
    norm: float  # mean topic load per node: 100% (Sec. VII-B)
    overlay: Overlay
    eq11_violations: int
    delegated: int
    moves: list[MoveRecord]


@dataclass(frozen=True, slots=True)
class GrowthRun:
    """Result of one growth run: loads before and after growth, moved load and q95 per Δτ step."""

    before: FloatArray  # (3, nodes), topic units
    before_norm: float
    after: FloatArray  # (3, nodes)
    after_norm: float
    v_ml: FloatArray  # V_ML per step k = 1..K, eq. (13)
    q95: FloatArray  # (3, K + 1): q95 of L1..L3 at τ = 0, Δτ, .., D, normalised per step
    eq11_violations: int
    overlay: Overlay
    step_loads: FloatArray | None  # (K + 1, 3, nodes) when keep_steps
    step_norms: FloatArray | None  # (K + 1,)
    moves: list[MoveRecord]


# ---- building blocks ------------------------------------------------------------------------------------
def static_topic_loads(model: LoadModel, n: int, rng: np.random.Generator) -> FloatArray:
    """Topic loads of Sec. VII-A in random order (exponential: sizes exp(λ i/(n-1)) shuffled)."""
    if model is LoadModel.HOMOGENEOUS:
        return np.ones(n)
    if model is LoadModel.HETEROGENEOUS:
        out = np.full(n, HETEROGENEOUS_SMALL)
        out[: round(HETEROGENEOUS_LARGE_SHARE * n)] = HETEROGENEOUS_LARGE
        rng.shuffle(out)
        return out
    sizes = exponential_sizes(n, math.log(10.0))
    rng.shuffle(sizes)
    return sizes


def apply_order(loads: FloatArray, order: Order) -> FloatArray:
    """Reorder the topics' loads for the addition order of Table IV (stable, so ties keep random order)."""
    if order is Order.RANDOM:
        return loads
    idx = np.argsort(loads, kind="stable")
    return loads[idx if order is Order.ASCENDING else idx[::-1]]


def build_overlay(points: FloatArray) -> Overlay:
    """Delaunay neighbours and clipped Voronoi cell areas of the nodes on the unit square."""
    nbrs = delaunay_neighbours(points)
    areas = np.array([polygon_area(c) for c in voronoi_cells(points, UNIT_SQUARE)]) / UNIT_SQUARE.area
    return Overlay(points, [sorted(s) for s in nbrs], areas)


def loads_from_triples(n: int, triples: IntArray, weights: FloatArray) -> FloatArray:
    """L1_N, L2_N, L3_N (eqs. 1-4) of all nodes for topics at coordinates with these (N1, N2, N3), at once.

    The vectorised twin of LoadLedger for placements that never change (unbalanced static runs): one pass
    instead of one ledger update per topic.  Rows of the pad index (fewer than three nodes) are dropped.
    """
    size = n + 1
    a, b, d = triples[:, 0], triples[:, 1], triples[:, 2]
    l1 = np.bincount(a, weights, size)
    l2 = l1 + np.bincount(b, weights, size)
    fail = np.zeros(size * size)
    real = d != n
    np.add.at(fail, d[real] * size + a[real], weights[real])
    distinct = real & (b != a)
    np.add.at(fail, d[distinct] * size + b[distinct], weights[distinct])
    l3a = np.maximum(fail.reshape(size, size).max(axis=1), 0.0)  # eq. (3)
    return np.stack([l1[:n], l2[:n], (l2 + l3a)[:n]])


def _coord(c: FloatArray) -> tuple[float, float]:
    return (float(c[0]), float(c[1]))


def _ledger_loads(net: SimNetwork) -> FloatArray:
    return np.stack([net.ledger.node_loads(level) for level in LEVELS])


# ---- static runs (Sec. VII) -----------------------------------------------------------------------------
# The simulator holds every topic's coordinate and load in arrays: 10^7 topics (10^5 times the paper's 100 x 100)
# take a few hundred MB a run; 10^11 asked for 1.5 TiB and ended in a MemoryError.
MAX_TOPICS: Final = 10_000_000


def _check_size(nodes: int, topics_per_node: int) -> None:
    if nodes < 1:
        raise ValueError(f"nodes must be at least 1, got {nodes}")
    if topics_per_node < 1:
        raise ValueError(f"topics per node must be at least 1, got {topics_per_node}")
    if nodes * topics_per_node > MAX_TOPICS:
        raise ValueError(
            f"{nodes} nodes x {topics_per_node} topics per node is {nodes * topics_per_node:,} topics, more than the "
            f"simulator holds ({MAX_TOPICS:,}): lower --nodes or --topics-per-node"
        )


def _check_coords(coords: tuple[tuple[float, float], ...] | None, nodes: int) -> None:
    if coords is None:
        return
    if len(coords) != nodes:
        raise ValueError(f"{len(coords)} coordinates for {nodes} nodes")
    for x, y in coords:
        if not UNIT_SQUARE.contains((x, y)):
            raise ValueError(f"coordinate ({x}, {y}) is outside the unit square the simulator uses")
    if len({(float(x), float(y)) for x, y in coords}) != len(coords):
        raise ValueError("two nodes share a coordinate")


def _points(coords: tuple[tuple[float, float], ...] | None, nodes: int, rng: np.random.Generator) -> FloatArray:
    """The nodes' coordinates: the given ones, or uniform in the unit square from the run's generator."""
    if coords is not None:
        return np.asarray(coords, dtype=np.float64).reshape(nodes, 2)
    return UNIT_SQUARE.uniform(rng, nodes)


def run_static(cfg: StaticConfig, seed: int) -> StaticRun:
    """One static run: random (or given) nodes, n_nodes * n_topics/node topics added one by one, final loads."""
    rng = np.random.default_rng(seed)
    points = _points(cfg.coords, cfg.nodes, rng)
    m = cfg.nodes * cfg.topics_per_node
    homes = UNIT_SQUARE.uniform(rng, m)
    weights = apply_order(static_topic_loads(cfg.loads, m, rng), cfg.order)
    overlay = build_overlay(points)
    norm = float(weights.sum()) / cfg.nodes
    if cfg.balance is BalanceMode.NONE:
        tree = cKDTree(points)
        loads = loads_from_triples(cfg.nodes, triples_for(points, homes, tree), weights)
        return StaticRun(loads, norm, overlay, 0, 0, [])
    net = SimNetwork(points, UNIT_SQUARE, rng)
    moves: list[MoveRecord] = []
    delegated = 0
    for i in range(m):
        tid, moved = net.add_balanced(homes[i], float(weights[i]), cfg.params, rng, check_eq11=cfg.checks_eq11)
        if moved:
            delegated += 1
            if cfg.keep_moves:
                node = net.triple(homes[i])[0]
                moves.append(
                    MoveRecord(0, node, tid, float(weights[i]), _coord(homes[i]), _coord(net.coords[tid]), "delegation")
                )
    return StaticRun(_ledger_loads(net), norm, overlay, net.eq11_violations, delegated, moves)


# ---- growth runs (Sec. VIII) ----------------------------------------------------------------------------
def _q95(loads: FloatArray, norm: float) -> FloatArray:
    rel: FloatArray = loads / norm * 100.0
    out: FloatArray = np.array([ccdf_quantile([row], 0.95) for row in rel])
    return out


def run_growth(cfg: GrowthConfig, seed: int) -> GrowthRun:
    """One growth run (Sec. VIII): add topics of size 1, then grow them over D = 1 in steps of Δτ.

    Each step sets every topic to exp(λ_t τ) (eq. 12); with continuous balancing a uniformly chosen node then
    runs Alg. 2 once (Sec. VIII-D).  V_ML of the step is the load of the topic moved then (eq. 13).
    """
    rng = np.random.default_rng(seed)
    points = _points(cfg.coords, cfg.nodes, rng)
    m = cfg.nodes * cfg.topics_per_node
    homes = UNIT_SQUARE.uniform(rng, m)
    rates = growth_rates(m, cfg.l_max, 1.0)
    overlay = build_overlay(points)
    net = SimNetwork(points, UNIT_SQUARE, rng, with_candidates=cfg.balance is not BalanceMode.NONE)
    moves: list[MoveRecord] = []
    for i in range(m):
        if cfg.balance.at_addition:
            tid, moved = net.add_balanced(homes[i], 1.0, cfg.params, rng, check_eq11=cfg.checks_eq11)
            if moved and cfg.keep_steps:
                node = net.triple(homes[i])[0]
                moves.append(MoveRecord(0, node, tid, 1.0, _coord(homes[i]), _coord(net.coords[tid]), "delegation"))
        else:
            net.add_topic(homes[i], 1.0)
    k_steps = cfg.steps
    before = _ledger_loads(net)
    before_norm = float(m) / cfg.nodes
    q95 = np.empty((3, k_steps + 1))
    q95[:, 0] = _q95(before, before_norm)
    step_loads = np.empty((k_steps + 1, 3, cfg.nodes)) if cfg.keep_steps else None
    step_norms = np.empty(k_steps + 1) if cfg.keep_steps else None
    if step_loads is not None and step_norms is not None:
        step_loads[0], step_norms[0] = before, before_norm
    v_ml = np.zeros(k_steps)
    for k in range(1, k_steps + 1):
        tau = min(1.0, k * cfg.delta_tau)
        sizes = topic_sizes(rates, tau)
        for t in range(m):
            net.set_load(t, float(sizes[t]))
        if cfg.balance.continuous:
            v = int(rng.integers(cfg.nodes))
            mv = net.balance_step(v, cfg.params, rng)
            if mv is not None:
                v_ml[k - 1] = mv.load
                if cfg.keep_steps:
                    moves.append(MoveRecord(k, v, mv.topic, mv.load, _coord(mv.source), _coord(mv.target), "move"))
        loads = _ledger_loads(net)
        norm = float(sizes.sum()) / cfg.nodes  # Sec. VIII-A: 100% = all topic loads at τ over n_nodes
        q95[:, k] = _q95(loads, norm)
        if step_loads is not None and step_norms is not None:
            step_loads[k], step_norms[k] = loads, norm
    after = _ledger_loads(net)
    after_norm = float(topic_sizes(rates, 1.0).sum()) / cfg.nodes
    return GrowthRun(
        before,
        before_norm,
        after,
        after_norm,
        v_ml,
        q95,
        net.eq11_violations,
        overlay,
        step_loads,
        step_norms,
        moves,
    )


# ---- the averaged CCDF and its quantiles (Sec. VII-A) ---------------------------------------------------
def averaged_ccdf(samples: Sequence[FloatArray]) -> tuple[FloatArray, FloatArray]:
    """The CCDF averaged over runs, at every observed value: (x, percentage of nodes with load > x).

    Runs are weighted equally (each run's CCDF counts once), which for runs of equal size is the CCDF of all
    node loads pooled.
    """
    if not samples:
        raise ValueError("averaged_ccdf needs at least one run")
    xs = np.unique(np.concatenate([np.asarray(s, dtype=np.float64) for s in samples]))
    y = np.zeros(len(xs))
    for s in samples:
        srt = np.sort(np.asarray(s, dtype=np.float64))
        # fraction of this run's nodes with load strictly greater than x
        y += (len(srt) - np.searchsorted(srt, xs, side="right")) / len(srt)
    out: FloatArray = y / len(samples) * 100.0
    return xs, out


def ccdf_quantile(samples: Sequence[FloatArray], p: float, rule: QuantileRule = QuantileRule.INTERPOLATED) -> float:
    """The p-quantile read off the averaged CCDF: where it falls to (1 - p) * 100% (see QuantileRule)."""
    xs, y = averaged_ccdf(samples)
    level = (1.0 - p) * 100.0
    # tolerance: the CCDF is a mean of fractions k/n, so "equal to the level" must survive rounding
    k = int(np.argmax(y <= level + 1e-9))
    if rule is QuantileRule.STEP or k == 0:
        return float(xs[k])
    x0, x1, y0, y1 = float(xs[k - 1]), float(xs[k]), float(y[k - 1]), float(y[k])
    return x0 + (y0 - level) / (y0 - y1) * (x1 - x0)


def level_summary(samples: Sequence[FloatArray], rule: QuantileRule = QuantileRule.INTERPOLATED) -> dict[str, float]:
    """{"q5", "mean", "q95"} of relative loads (in %) over runs, as in Tables I and III-V."""
    return {
        "q5": ccdf_quantile(samples, QUANTILES[0], rule),
        "mean": float(np.mean(np.concatenate(samples))),
        "q95": ccdf_quantile(samples, QUANTILES[1], rule),
    }


def relative_loads(loads: Sequence[FloatArray], norms: Sequence[float]) -> list[list[FloatArray]]:
    """Per level, per run: node loads in % of the run's normalisation (loads[r] has shape (3, nodes))."""
    return [[ld[i] / nm * 100.0 for ld, nm in zip(loads, norms, strict=True)] for i in range(3)]


def _levels(rel: list[list[FloatArray]], rule: QuantileRule) -> dict[str, dict[str, float]]:
    return {f"L{i + 1}": level_summary(rel[i], rule) for i in range(3)}


def summarise_static(
    runs: Sequence[StaticRun], cfg: StaticConfig, rule: QuantileRule = QuantileRule.INTERPOLATED
) -> dict[str, object]:
    """The JSON result of a static experiment: Table I/III/IV quantiles, cell areas, Table II correlations."""
    rel = relative_loads([r.loads for r in runs], [r.norm for r in runs])
    out: dict[str, object] = dict(_levels(rel, rule))
    areas = [r.overlay.cell_area * cfg.nodes * 100.0 for r in runs]  # 100% = A_square / n_nodes
    out["cell_area"] = level_summary(areas, rule)
    # Table II: Pearson correlation of A(v) with L^i_N(v) over the nodes of all runs
    all_area = np.concatenate(areas)
    out["correlation"] = {f"L{i + 1}": _pearson(all_area, np.concatenate(rel[i])) for i in range(3)}
    if cfg.checks_eq11:
        out["eq11_violations"] = int(sum(r.eq11_violations for r in runs))
    out["delegated_share"] = float(np.mean([r.delegated for r in runs])) / (cfg.nodes * cfg.topics_per_node)
    out["runs"] = len(runs)
    return out


def _pearson(x: FloatArray, y: FloatArray) -> float | None:
    if len(x) < 2 or float(np.std(x)) == 0.0 or float(np.std(y)) == 0.0:
        return None  # undefined for constant data (e.g. one node)
    return float(np.corrcoef(x, y)[0, 1])


def summarise_growth(
    runs: Sequence[GrowthRun], cfg: GrowthConfig, rule: QuantileRule = QuantileRule.INTERPOLATED
) -> dict[str, object]:
    """The JSON result of a growth experiment: Fig. 6/Table V quantiles, moved-load series of run 0 (Fig. 7)."""
    before = _levels(relative_loads([r.before for r in runs], [r.before_norm for r in runs]), rule)
    after = _levels(relative_loads([r.after for r in runs], [r.after_norm for r in runs]), rule)
    first = runs[0]
    window = max(1, round(RATE_WINDOW_SHARE / cfg.delta_tau))  # W = D / 10 in steps, eq. (14)
    tau = [min(1.0, k * cfg.delta_tau) for k in range(cfg.steps + 1)]
    out: dict[str, object] = dict(after)
    out["before"] = before
    out["after"] = after
    out["moved"] = {
        "run": 0,
        "tau": tau,
        "v_ml": first.v_ml.tolist(),
        "v_ml_cum": np.cumsum(first.v_ml).tolist(),
        # eq. (14) averages over W = D/10; dividing the per-step mean by Δτ gives topic units per unit time
        "r_ml": (moved_load_rate(first.v_ml.tolist(), window) / cfg.delta_tau).tolist(),
        "window_steps": window,
        "q95": {f"L{i + 1}": first.q95[i].tolist() for i in range(3)},
        "total_mean": float(np.mean([r.v_ml.sum() for r in runs])),
        "moves_mean": float(np.mean([np.count_nonzero(r.v_ml) for r in runs])),
    }
    if cfg.checks_eq11:
        out["eq11_violations"] = int(sum(r.eq11_violations for r in runs))
    out["runs"] = len(runs)
    return out


__all__ = [
    "GrowthConfig",
    "GrowthRun",
    "LoadModel",
    "MoveRecord",
    "Order",
    "Overlay",
    "QuantileRule",
    "StaticConfig",
    "StaticRun",
    "apply_order",
    "averaged_ccdf",
    "build_overlay",
    "ccdf_quantile",
    "level_summary",
    "loads_from_triples",
    "relative_loads",
    "run_growth",
    "run_static",
    "static_topic_loads",
    "summarise_growth",
    "summarise_static",
]
