"""What one broker knows of its region's loads, and the coordinate answers it gives from that (Sec. V).

A broker hears LOAD_REPORTs from its neighbours, which carry their own records and their neighbours', so it
knows the loads of every node within two hops.  That is enough for the metrics of any coordinate in its own
Voronoi cell (N1 is the broker itself, N2 a neighbour, N3 at most two hops away) and for the coordinate it
is asked about by IndCoord.  Nodes beyond the region are summarised: the part of a node's eq. (3) failure
sums that concerns nodes outside the region goes to one virtual "elsewhere" node, so L3_aN stays exact.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np

from overlay.candidates import triples_for
from overlay.delegation import NodeLoad, Offer
from overlay.geometry import FloatArray, IntArray, Space, sample_in_polygon, voronoi_cell
from overlay.load import CoordMetric, Level, LoadLedger, best_index


@dataclass(slots=True)
class RegionLoads:
    """A LoadLedger over the nodes of a region, indexed 0..n-1; n is "elsewhere", n + 1 the pad."""

    ids: list[str]
    index: dict[str, int]
    points: FloatArray
    ledger: LoadLedger

    @classmethod
    def build(cls, records: Iterable[NodeLoad]) -> RegionLoads:
        """The ledger of the nodes whose records are given (eqs. 1-4 from their reported sums)."""
        recs = sorted(records, key=lambda r: r.node.id)
        ids = [r.node.id for r in recs]
        index = {nid: i for i, nid in enumerate(ids)}
        n = len(recs)
        t1 = np.zeros(n + 1)
        t2 = np.zeros(n + 1)
        fail = np.zeros((n + 1, n + 1))
        for i, r in enumerate(recs):
            t1[i] = r.t1
            t2[i] = r.t2
            for w, v in r.fails.items():
                j = index.get(w, n)
                fail[i, j] = max(fail[i, j], v) if j == n else v
        points = np.array([r.node.coord for r in recs], dtype=float).reshape(n, 2)
        return cls(ids, index, points, LoadLedger.from_parts(t1, t2, fail))

    @property
    def n(self) -> int:
        """Number of real nodes in the region."""
        return len(self.ids)

    def without(self, triple: Sequence[str], load: float) -> RegionLoads:
        """A copy with one topic taken out (Sec. V: candidate metrics exclude the topic being delegated).

        triple holds the topic's N1, N2, N3 node ids ("" where there is no such node); a node outside the
        region stands for "elsewhere", whose loads are not tracked.
        """
        led = LoadLedger.from_parts(
            self.ledger.t1[: self.n + 1], self.ledger.t2[: self.n + 1], self.ledger.fail[: self.n + 1, : self.n + 1]
        )
        if load > 0 and triple and triple[0] in self.index:
            pad = self.n + 1
            idx = tuple(self.index.get(x, pad) if x else pad for x in triple[:3])
            led.remove((idx[0], idx[1], idx[2]), load)
            np.maximum(led.t1, 0.0, out=led.t1)
            np.maximum(led.t2, 0.0, out=led.t2)
        return RegionLoads(self.ids, self.index, self.points, led)

    def triples(self, coords: FloatArray) -> IntArray:
        """(N1, N2, N3) region indices of each coordinate; missing ranks get the pad index."""
        tr = triples_for(self.points, coords)
        tr[tr == self.n] = self.n + 1  # triples_for pads with n, which is "elsewhere" here
        return tr

    def metric(self, level: Level, coord: tuple[float, float]) -> CoordMetric:
        """The Sec. IV-D criteria of one coordinate (IndCoord's answer)."""
        tr = self.triples(np.asarray([coord], dtype=float))
        return self.ledger.metric(level, (int(tr[0, 0]), int(tr[0, 1]), int(tr[0, 2])))

    def best(
        self, level: Level, candidates: FloatArray, rng: np.random.Generator | None = None
    ) -> tuple[int, CoordMetric]:
        """Index and criteria of a best candidate in the Sec. IV-D order (BestLocalCoord's answer).

        rng draws among several best candidates (`overlay.load.best_index`); without it the first wins.
        """
        lmax, lmin, spare = self.ledger.metrics(level, self.triples(candidates))
        i = best_index(lmax, lmin, spare, rng)
        return i, CoordMetric(float(lmax[i]), float(lmin[i]), float(spare[i]))

    def offer(self, level: Level, coord: tuple[float, float], node: str) -> Offer:
        """An Offer for one coordinate."""
        m = self.metric(level, coord)
        return Offer(coord, m.lmax, m.lmin, m.spare, node)


def cell_candidates(
    site: tuple[float, float],
    neighbours: Iterable[tuple[float, float]],
    space: Space,
    rng: np.random.Generator,
    count: int,
) -> FloatArray:
    """`count` uniform coordinates in the Voronoi cell of site given its Delaunay neighbours (Sec. V-E)."""
    cell = voronoi_cell(site, neighbours, space)
    pts = sample_in_polygon(cell, count, rng)
    if len(pts) == 0:
        return np.asarray([site], dtype=float)
    return pts
