"""Probes behind docs/reproduction.md, "Where we differ": what each guess at the paper's unstated conventions gives.

Not a test and not a speed benchmark.  For the cells `sedax sim` does not match, each probe prints what a
hypothesis would give next to the paper's value, so the report's claims can be re-run:

    .venv/bin/python benchmarks/repro_probe.py levels    [--runs 100]   # where the paper's quantiles sit in ours
    .venv/bin/python benchmarks/repro_probe.py readings  [--runs 100]   # quantile readings; Table II estimators
    .venv/bin/python benchmarks/repro_probe.py geometry  [--runs 100]   # node placement, metric, replica rule
    .venv/bin/python benchmarks/repro_probe.py order     [--runs 100] [--blocks 3]   # Table IV's addition order

Unbalanced loads come from the simulator's own vectorised path (`loads_from_triples`), the Table IV rules from
`SimNetwork`'s candidates and ledger; only the hypotheses themselves are written here.
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Final

import numpy as np
from scipy.spatial import cKDTree
from scipy.stats import spearmanr

from overlay.balance import BalanceMode
from overlay.geometry import UNIT_SQUARE, FloatArray, IntArray
from overlay.load import CoordMetric, LoadLedger, best_index
from sim.experiments import (
    LoadModel,
    Order,
    QuantileRule,
    StaticConfig,
    apply_order,
    averaged_ccdf,
    ccdf_quantile,
    loads_from_triples,
    run_static,
    static_topic_loads,
    summarise_static,
)
from sim.world import SimNetwork

H, E = LoadModel.HOMOGENEOUS, LoadModel.HETEROGENEOUS
# Table I (q5, q95 per level L1, L2, L3) and Fig. 6 top row, before growth (L3 only): the paper's values in %.
PAPER: Final[dict[tuple[int, int, LoadModel], tuple[tuple[float, float] | None, ...]]] = {
    (100, 1000, H): ((29.5, 194.7), (85.0, 332.9), (122.6, 411.6)),
    (100, 100, H): ((24.8, 192.5), (80.2, 335.3), (117.3, 410.6)),
    (100, 100, E): ((24.7, 197.3), (78.6, 345.7), (113.5, 419.2)),
    (100, 10, H): ((12.0, 204.0), (60.8, 349.6), (102.0, 433.5)),
    (100, 10, E): ((7.1, 239.7), (37.3, 391.7), (78.2, 488.8)),
    (10, 10, H): (None, None, (90.0, 397.5)),
}
PAPER_CELL_AREA: Final = (29.0, 191.4)  # Sec. VII-B, 100 nodes
PAPER_CORR_1000: Final = (0.9984, 0.683, 0.6028)  # Table II, 1000 homogeneous topics per node
PAPER_TABLE_IV: Final = {Order.ASCENDING: 264.6, Order.DESCENDING: 257.1, Order.RANDOM: 261.3}  # L3 q95
AREA_SAMPLES: Final = 1000  # uniform points per node for the Monte Carlo cell areas of the geometry probe

Runs = FloatArray  # (runs, 3, nodes): relative L1..L3 loads in %


def unbalanced(nodes: int, per_node: int, model: LoadModel, runs: int, seed: int = 1) -> Runs:
    """Relative node loads of `runs` unbalanced static runs, exactly as `sedax sim static` computes them."""
    out = []
    for r in range(runs):
        run = run_static(StaticConfig(nodes=nodes, topics_per_node=per_node, loads=model), seed + r)
        out.append(run.loads / run.norm * 100.0)
    return np.array(out)


def q(samples: FloatArray, p: float) -> float:
    """The p-quantile of the averaged CCDF of these runs, read as `sedax sim` reads it."""
    return ccdf_quantile(list(samples), p)


def label(key: tuple[int, int, LoadModel]) -> str:
    return f"{key[0]:3d} nodes x {key[1]:4d} {key[2].value[:6]}"


# ---- levels ----------------------------------------------------------------------------------------------
def probe_levels(runs: int) -> None:
    print("At which level p (%) does our averaged CCDF reach the paper's q5 and q95?  (5 and 95 if they agreed)")
    for key, cells in PAPER.items():
        data = unbalanced(*key, runs=runs)
        for lv, cell in enumerate(cells):
            if cell is None:
                continue
            xs, ccdf = averaged_ccdf(list(data[:, lv, :]))
            p5, p95 = (100.0 - float(np.interp(x, xs, ccdf)) for x in cell)
            print(f"  {label(key)} L{lv + 1}: paper q5 {cell[0]:6.1f} is our p = {p5:5.2f}; "
                  f"paper q95 {cell[1]:6.1f} is our p = {p95:5.2f}")  # fmt: skip


# ---- readings --------------------------------------------------------------------------------------------
def _polyline_vertical(samples: Runs, p: float, denominator_extra: int) -> float:
    """Each run's CCDF a polyline through (x_(i), (n - i) / (n + extra)), averaged vertically on a fine grid."""
    grid = np.linspace(0.0, float(samples.max()) * 1.01, 100_001)
    acc = np.zeros_like(grid)
    for s in samples:
        x = np.sort(s)
        n = len(x)
        y = (n - np.arange(1, n + 1)) / (n + denominator_extra)
        acc += np.interp(grid, x, y, left=1.0, right=0.0)
    return float(grid[int(np.argmax(acc / len(samples) <= 1.0 - p))])


def _horizontal(samples: Runs, p: float) -> float:
    """The mean of each order statistic over runs, read as a polyline through (mean x_(i), (n - i) / n)."""
    x = np.sort(samples, axis=1).mean(axis=0)
    n = len(x)
    y = (n - np.arange(1, n + 1)) / n
    # y falls with x: interpolate on the reversed line; a level above its first point gives x_(1)
    return float(np.interp(1.0 - p, y[::-1], x[::-1]))


READINGS: Final[dict[str, Callable[[Runs, float], float]]] = {
    "pooled, interpolated (ours)": q,
    "pooled, order statistic": lambda s, p: ccdf_quantile(list(s), p, QuantileRule.STEP),
    "per-run polyline (n-i)/n": lambda s, p: _polyline_vertical(s, p, 0),
    "per-run polyline (n-i)/(n+1)": lambda s, p: _polyline_vertical(s, p, 1),
    "mean order statistics": _horizontal,
}


def probe_readings(runs: int) -> None:
    data = {key: unbalanced(*key, runs=runs) for key in PAPER}
    print("q95 relative to the paper over all 16 cells, and the grid cell 100 x 10 homogeneous L1 (paper q5 12.0):")
    for name, read in READINGS.items():
        diffs = []
        for key, cells in PAPER.items():
            for lv, cell in enumerate(cells):
                if cell is not None:
                    diffs.append(read(data[key][:, lv, :], 0.95) / cell[1] - 1.0)
        grid_q5 = read(data[(100, 10, H)][:, 0, :], 0.05)
        fig6 = data[(10, 10, H)][:, 2, :]
        print(f"  {name:30s} rms {100 * math.sqrt(float(np.mean(np.square(diffs)))):4.1f}%  "
              f"max {100 * float(np.max(np.abs(diffs))):4.1f}%  grid q5 {grid_q5:5.1f}  "
              f"10-node L3 {read(fig6, 0.05):5.1f}/{read(fig6, 0.95):5.1f} (paper 90.0/397.5)")  # fmt: skip


def probe_estimators(runs: int) -> None:
    """Table II with other correlation estimators: is the L2/L3 gap a matter of how correlation is computed?"""
    cfg = StaticConfig(nodes=100, topics_per_node=1000, loads=H)
    sims = [run_static(cfg, 1 + r) for r in range(runs)]
    areas = [r.overlay.cell_area for r in sims]
    print(f"Table II, 100 nodes x 1000 homogeneous topics ({runs} runs): corr(A(v), L^i_N(v)) by estimator")
    for lv, paper in enumerate(PAPER_CORR_1000):
        loads = [r.loads[lv] for r in sims]
        pooled = float(np.corrcoef(np.concatenate(areas), np.concatenate(loads))[0, 1])
        per_run = float(np.mean([np.corrcoef(a, ld)[0, 1] for a, ld in zip(areas, loads, strict=True)]))
        rank = float(np.mean([spearmanr(a, ld)[0] for a, ld in zip(areas, loads, strict=True)]))
        print(f"  L{lv + 1}: paper {paper:.4f} | pooled Pearson (ours) {pooled:.4f}  per-run Pearson {per_run:.4f}  "
              f"per-run Spearman {rank:.4f}")  # fmt: skip


# ---- geometry --------------------------------------------------------------------------------------------
Sampler = Callable[[np.random.Generator, int], FloatArray]


def _square(rng: np.random.Generator, n: int) -> FloatArray:
    return UNIT_SQUARE.uniform(rng, n)


def _disk(rng: np.random.Generator, n: int) -> FloatArray:
    r = 0.5 * np.sqrt(rng.random(n))
    a = 2.0 * np.pi * rng.random(n)
    out: FloatArray = np.c_[0.5 + r * np.cos(a), 0.5 + r * np.sin(a)]
    return out


def _gauss(rng: np.random.Generator, n: int) -> FloatArray:
    out: FloatArray = rng.normal(0.5, 0.2, (n, 2))
    return out


def _lattice(m: int) -> Sampler:
    def draw(rng: np.random.Generator, n: int) -> FloatArray:
        out: FloatArray = (rng.integers(0, m, (n, 2)) + 0.5) / m
        return out

    return draw


@dataclass(frozen=True, slots=True)
class Geometry:
    """One hypothesis about node placement, distance and replica choice."""

    name: str
    nodes: Sampler = _square
    topics: Sampler = _square
    p: float = 2.0  # Minkowski p of the distance (2 Euclidean, 1 Manhattan, inf Chebyshev)
    box: float | None = None  # side of a periodic square (a torus), or a bounded square
    replicas_of_primary: bool = False

    def run(self, n: int, m: int, rng: np.random.Generator) -> tuple[FloatArray, FloatArray]:
        """Relative loads (3, n) and Monte Carlo cell areas (n,) in % for one overlay."""
        pts = self.nodes(rng, n)
        tree = cKDTree(pts, boxsize=self.box)
        coords = self.topics(rng, m)
        idx: IntArray
        if self.replicas_of_primary:  # N2, N3 = the nodes closest to the primary, not to the coordinate
            primary = tree.query(coords, k=1, p=self.p)[1]
            near = tree.query(pts, k=3, p=self.p)[1]
            idx = np.c_[primary, near[primary, 1], near[primary, 2]].astype(np.int64)
        else:
            idx = tree.query(coords, k=3, p=self.p)[1].astype(np.int64)
        loads = loads_from_triples(n, idx, np.ones(m)) / (m / n) * 100.0
        owner = tree.query(self.topics(rng, AREA_SAMPLES * n), k=1, p=self.p)[1]
        return loads, np.bincount(owner, minlength=n) / AREA_SAMPLES * 100.0


GEOMETRIES: Final = (
    Geometry("bounded square (ours)"),
    Geometry("torus", box=1.0),
    Geometry("Manhattan distance", p=1.0),
    Geometry("Chebyshev distance", p=math.inf),
    Geometry("unit disk", nodes=_disk, topics=_disk),
    Geometry("Gaussian nodes", nodes=_gauss),
    Geometry("nodes on a 20x20 lattice", nodes=_lattice(20)),
    Geometry("N2, N3 nearest to N1", replicas_of_primary=True),
)


def probe_geometry(runs: int) -> None:
    print(f"100 nodes x 1000 homogeneous topics ({runs} runs) and 10 nodes x 10 ({5 * runs} runs); q5/mean/q95 in %")
    paper = PAPER[(100, 1000, H)]
    print(f"  {'paper':26s} area {PAPER_CELL_AREA[0]:5.1f}/{PAPER_CELL_AREA[1]:5.1f} | "
          + " ".join(f"L{i + 1} {c[0]:5.1f}/{c[1]:5.1f}" for i, c in enumerate(paper) if c)
          + " | L3 mean 257.4 | corr " + " ".join(f"{c:.3f}" for c in PAPER_CORR_1000)
          + " | 10-node L3 90.0/272.1/397.5")  # fmt: skip
    for g in GEOMETRIES:
        rng = np.random.default_rng(7)
        loads, areas = zip(*(g.run(100, 100_000, rng) for _ in range(runs)), strict=True)
        ld, ar = np.array(loads), np.array(areas)
        small = np.array([g.run(10, 100, rng)[0][2] for _ in range(5 * runs)])
        corr = [float(np.corrcoef(ar.ravel(), ld[:, i, :].ravel())[0, 1]) for i in range(3)]
        print(f"  {g.name:26s} area {q(ar, 0.05):5.1f}/{q(ar, 0.95):5.1f} | "
              + " ".join(f"L{i + 1} {q(ld[:, i], 0.05):5.1f}/{q(ld[:, i], 0.95):5.1f}" for i in range(3))
              + f" | L3 mean {ld[:, 2].mean():5.1f} | corr " + " ".join(f"{c:.3f}" for c in corr)
              + f" | 10-node L3 {q(small, 0.05):5.1f}/{small.mean():5.1f}/{q(small, 0.95):5.1f}")  # fmt: skip


# ---- order (Table IV) ------------------------------------------------------------------------------------
Rule = Callable[[LoadLedger, IntArray, float], tuple[FloatArray, FloatArray, FloatArray]]


def _paper_rule(led: LoadLedger, triples: IntArray, load: float) -> tuple[FloatArray, FloatArray, FloatArray]:
    return led.metrics(3, triples)  # eqs. (8)-(10) without the new topic, as Sec. V says


def _max_min(a: FloatArray, b: FloatArray, c: FloatArray) -> tuple[FloatArray, FloatArray]:
    return np.maximum(np.maximum(a, b), c), np.minimum(np.minimum(a, b), c)


def _size_aware(led: LoadLedger, triples: IntArray, load: float) -> tuple[FloatArray, FloatArray, FloatArray]:
    """The three loads of eq. (10) *after* adding the topic: a rule that knows the new topic's size."""
    n1, n2, n3 = triples[:, 0], triples[:, 1], triples[:, 2]
    l2, l3 = led.l2(), led.l3()
    fa = np.maximum(led.fail[n3, n1], led.fail[n3, n2])
    a = l3[n1] + load
    b = np.where(n2 != n1, l3[n2] + load, l3[n2])
    c = np.where(n3 == led.pad, 0.0, l2[n3] + np.maximum(led.l3a[n3], fa + load))
    return (*_max_min(a, b, c), l3[n3] - (l2[n3] + fa))


def _n3_full_load(led: LoadLedger, triples: IntArray, load: float) -> tuple[FloatArray, FloatArray, FloatArray]:
    """Eq. (10) with L3_N(N3) as the third term instead of L2_N(N3) + L3_faN(N3, c)."""
    _, _, spare = led.metrics(3, triples)
    l3 = led.l3()
    a, b, c = l3[triples[:, 0]], l3[triples[:, 1]], l3[triples[:, 2]]
    return (*_max_min(a, b, c), spare)


RULES: Final[dict[str, Rule]] = {
    "paper's eqs. (8)-(10)": _paper_rule,
    "size-aware (after adding)": _size_aware,
    "N3 term = L3_N(N3)": _n3_full_load,
}


def table_iv_run(order: Order, seed: int, rule: Rule) -> FloatArray:
    """One Table IV run (10 x 10 exponential, BestGlobalCoord, goal L3) with Alg. 1 deciding by `rule`.

    The draws follow `run_static` (nodes, homes, sizes, candidates, then ties), so with the paper's rule
    this harness and the simulator answer the same question.
    """
    nodes, m = 10, 100
    rng = np.random.default_rng(seed)
    points = UNIT_SQUARE.uniform(rng, nodes)
    homes = UNIT_SQUARE.uniform(rng, m)
    sizes = apply_order(static_topic_loads(LoadModel.EXPONENTIAL, m, rng), order)
    net = SimNetwork(points, UNIT_SQUARE, rng)
    cands = net.cands
    assert cands is not None
    for home, size in zip(homes, sizes, strict=True):
        home_tr = net.triple(home)
        cur = rule(net.ledger, np.asarray([home_tr], dtype=np.int64), float(size))
        lmax, lmin, spare = rule(net.ledger, cands.triples, float(size))
        i = best_index(lmax, lmin, spare, rng)  # every raw candidate once = weighted by multiplicity
        here = CoordMetric(float(cur[0][0]), float(cur[1][0]), float(cur[2][0]))
        if CoordMetric(float(lmax[i]), float(lmin[i]), float(spare[i])).better_than(here):
            net.add_topic(home, float(size), cands.coords[i])
        else:
            net.add_topic(home, float(size), None, home_tr)
    out: FloatArray = net.ledger.node_loads(3) / (float(sizes.sum()) / nodes) * 100.0
    return out


def probe_order(runs: int, blocks: int) -> None:
    print(f"Table IV L3 q5/mean/q95 in %, {runs} runs per block, blocks starting at seeds 1, 1001, 2001, ...")
    for order in Order:
        cfg = StaticConfig(nodes=10, topics_per_node=10, loads=LoadModel.EXPONENTIAL, balance=BalanceMode.ADDITION,
                           order=order)  # fmt: skip
        cells: list[str] = []
        first: list[FloatArray] = []
        for b in range(blocks):
            base = 1 + 1000 * b
            sim_runs = [run_static(cfg, base + r) for r in range(runs)]
            s = summarise_static(sim_runs, cfg)["L3"]
            assert isinstance(s, dict)
            cells.append(f"{s['q5']:5.1f}/{s['mean']:5.1f}/{s['q95']:5.1f}")
            if b == 0:
                first = [r.loads[2] / r.norm * 100.0 for r in sim_runs]
        print(f"  {order.value:10s} paper q95 {PAPER_TABLE_IV[order]:5.1f} | simulator: " + "  ".join(cells))
        # With a sorted order the greedy rule lands on the same sums of topic sizes run after run.
        values, counts = np.unique(np.round(np.concatenate(first), 3), return_counts=True)
        top = np.argsort(counts)[::-1][:3]
        print(f"  {'':10s} most frequent node loads of block 1: "
              + ", ".join(f"{values[i]:.2f}% ({counts[i]} of {sum(map(len, first))})" for i in top))  # fmt: skip
        for name, rule in RULES.items():
            res = [np.array([table_iv_run(order, 1 + 1000 * b + r, rule) for r in range(runs)]) for b in range(blocks)]
            print(f"  {'':10s} {name:26s}: "
                  + "  ".join(f"{q(x, 0.05):5.1f}/{x.mean():5.1f}/{q(x, 0.95):5.1f}" for x in res))  # fmt: skip


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("probe", choices=("levels", "readings", "geometry", "order"))
    ap.add_argument("--runs", type=int, default=100, help="runs per cell (default 100)")
    ap.add_argument("--blocks", type=int, default=3, help="order: independent seed blocks (default 3)")
    args = ap.parse_args(argv)
    if args.runs < 2:
        ap.error(f"--runs must be at least 2, got {args.runs}")
    if args.blocks < 1:
        ap.error(f"--blocks must be at least 1, got {args.blocks}")
    if args.probe == "levels":
        probe_levels(args.runs)
    elif args.probe == "readings":
        probe_readings(args.runs)
        probe_estimators(args.runs)
    elif args.probe == "geometry":
        probe_geometry(args.runs)
    else:
        probe_order(args.runs, args.blocks)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
