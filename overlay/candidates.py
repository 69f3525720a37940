"""Best-coordinate candidates per node (Sec. V-E) with an incrementally refreshed best-of-cell cache.

Each node draws `per_node` random coordinates inside its own Voronoi cell (the paper uses 200) and, when
asked, answers with the best of them in the Sec. IV-D order.  A topic change alters the loads of only its
N1, N2 and N3, so only the nodes whose candidates have one of those three among their own N1..N3 need a fresh
answer; `invalidate` marks exactly those and `best` recomputes lazily (the "appropriate data structures" of
Sec. V-E).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Final

import numpy as np

from overlay.geometry import (
    FloatArray,
    IntArray,
    Space,
    delaunay_neighbours,
    nearest_k,
    sample_in_polygon,
    voronoi_cell,
)
from overlay.load import CoordMetric, Level, LoadLedger, best_index

if TYPE_CHECKING:  # (imported where used: a broker uses triples_for only, and does not load scipy)
    from scipy.spatial import cKDTree

CANDIDATES_PER_NODE: Final = 200  # Sec. V-E


def triples_for(points: FloatArray, coords: FloatArray, tree: cKDTree | None = None) -> IntArray:
    """(N1, N2, N3) node indices for each coordinate; missing ranks (fewer than 3 nodes) get the pad index."""
    n = len(points)
    out = np.full((len(coords), 3), n, dtype=np.int64)
    if n == 0 or len(coords) == 0:
        return out
    idx = nearest_k(points, coords, 3, tree)
    out[:, : idx.shape[1]] = idx
    return out


class CandidateSet:
    """Per-node candidate coordinates, their (N1, N2, N3) triples and a cached best candidate per node."""

    def __init__(
        self,
        points: FloatArray,
        space: Space,
        rng: np.random.Generator,
        per_node: int = CANDIDATES_PER_NODE,
        neighbours: list[set[int]] | None = None,
        tree: cKDTree | None = None,
    ) -> None:
        self.points = points
        self.n = len(points)
        self.per_node = per_node
        self.neighbours = neighbours if neighbours is not None else delaunay_neighbours(points)
        if tree is None:
            from scipy.spatial import cKDTree

            tree = cKDTree(points)
        coords = np.empty((self.n * per_node, 2))
        for v in range(self.n):
            cell = voronoi_cell(points[v], (points[j] for j in sorted(self.neighbours[v])), space)
            pts = sample_in_polygon(cell, per_node, rng)
            if len(pts) < per_node:  # a cell of no area inside the space: its site is its only point
                pts = np.repeat(points[v : v + 1], per_node, axis=0)
            coords[v * per_node : (v + 1) * per_node] = pts
        self.coords = coords
        self.triples = triples_for(points, coords, tree)
        # Numerically a sampled point on a cell edge can have the neighbour as N1; the owner must be N1 of its
        # own candidates or the answer would describe another node's cell.
        owner = np.repeat(np.arange(self.n, dtype=np.int64), per_node)
        wrong = self.triples[:, 0] != owner
        if wrong.any():
            self.coords[wrong] = points[owner[wrong]]
            self.triples[wrong] = triples_for(points, self.coords[wrong], tree)
        # deps[x]: nodes whose candidates involve node x as N1, N2 or N3
        deps: list[set[int]] = [set() for _ in range(self.n + 1)]
        for v in range(self.n):
            for x in np.unique(self.triples[v * per_node : (v + 1) * per_node]):
                deps[int(x)].add(v)
        self.deps = [np.array(sorted(d), dtype=np.int64) for d in deps]
        # The metrics of a candidate depend only on its triple, and the 200 candidates of a cell share a few
        # distinct triples.  An answer evaluates each distinct triple once, kept contiguous per node, in
        # order of first occurrence: the first best distinct triple then maps to the first best candidate,
        # so the answer is the one a scan of all 200 gives; a random tie-break weights each distinct triple
        # by how many candidates share it, as a draw among the 200 would.
        self._uniq_triples: list[IntArray] = []
        self._uniq_first: list[IntArray] = []
        self._uniq_count: list[FloatArray] = []
        for v in range(self.n):
            lo = v * per_node
            block = self.triples[lo : lo + per_node]
            _, first, inverse = np.unique(block, axis=0, return_index=True, return_inverse=True)
            counts = np.bincount(inverse.reshape(-1), minlength=len(first)).astype(np.float64)
            order = np.argsort(first)
            self._uniq_triples.append(np.ascontiguousarray(block[first[order]]))
            self._uniq_first.append(lo + first[order])
            self._uniq_count.append(counts[order])
        self._best: dict[tuple[int, int], tuple[int, CoordMetric]] = {}
        self._valid = np.zeros((self.n, 4), dtype=bool)  # [v, level]: cached answer still true
        self.recomputed = 0  # how many cell answers were recomputed (for benchmarks of the cache)

    def invalidate(self, nodes: Iterable[int]) -> None:
        """Forget the cached answers that depend on the loads of these nodes."""
        for x in nodes:
            self._valid[self.deps[x]] = False

    def best(
        self, v: int, level: Level, ledger: LoadLedger, rng: np.random.Generator | None = None
    ) -> tuple[int, CoordMetric]:
        """Node v's locally best candidate (global candidate index, its metric) for the given level.

        rng draws among several best candidates (`best_index`); the answer is kept until v's loads change.
        """
        if self._valid[v, level]:
            return self._best[(v, level)]
        lmax, lmin, spare = ledger.metrics(level, self._uniq_triples[v])
        i = best_index(lmax, lmin, spare, rng, self._uniq_count[v])
        ans = (int(self._uniq_first[v][i]), CoordMetric(float(lmax[i]), float(lmin[i]), float(spare[i])))
        self._best[(v, level)] = ans
        self._valid[v, level] = True
        self.recomputed += 1
        return ans

    def best_among(
        self, nodes: Iterable[int], level: Level, ledger: LoadLedger, rng: np.random.Generator | None = None
    ) -> tuple[int, CoordMetric]:
        """The best of the given nodes' locally best candidates (BestRegionalCoord, BestGlobalCoord)."""
        answers = [self.best(v, level, ledger, rng) for v in nodes]
        return pick_best(answers, rng)


def pick_best(
    answers: list[tuple[int, CoordMetric]], rng: np.random.Generator | None = None
) -> tuple[int, CoordMetric]:
    """Tiebreaker(C*) of Alg. 1/2: the best answer in the Sec. IV-D order (the first on ties, or with rng a
    random one of the tied)."""
    if not answers:
        raise ValueError("pick_best needs at least one answer")
    lmax = np.array([m.lmax for _, m in answers])
    lmin = np.array([m.lmin for _, m in answers])
    spare = np.array([m.spare for _, m in answers])
    return answers[best_index(lmax, lmin, spare, rng)]
