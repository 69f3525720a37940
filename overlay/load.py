"""The SeDAX load model of Hoefling, Mills & Menth, Sec. IV: node loads, coordinate loads, best coordinates.

Every formula of Sec. IV lives here once, next to its equation number; the simulator and the brokers both call
these functions.  Loads are additive (Sec. IV-C1): bytes on a live broker, topic units in the simulator.

Notation (Sec. IV-A): N_j(c) is the j-closest node to coordinate c, T_j(v) the topics for which v is j-closest,
L_T(t) the load of topic t.  A *triple* is (N_1(c), N_2(c), N_3(c)) for a topic coordinate c, as node indices;
the index `ledger.pad` stands for "no such node" in overlays with fewer than three nodes.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Final, Literal, TypeVar

import numpy as np
import numpy.typing as npt

FloatArray = npt.NDArray[np.float64]
IntArray = npt.NDArray[np.int64]
Level = Literal[1, 2, 3]
LEVELS: Final[tuple[Level, ...]] = (1, 2, 3)
K = TypeVar("K")

# Two loads closer than this (relative to the larger) count as equal in the "better coordinate" order of
# Sec. IV-D.  Loads are sums of floats; without a tolerance, rounding noise would decide ties that the
# paper's order sends on to the next criterion.
REL_EQ: Final = 1e-9


def l1_node(loads_t1: Iterable[float]) -> float:
    """L1_N(v), eq. (1): the sum of the loads of the topics for which v is closest."""
    return float(sum(loads_t1))


def l2_node(loads_t1: Iterable[float], loads_t2: Iterable[float]) -> float:
    """L2_N(v), eq. (2): the loads of the topics for which v is closest or second-closest."""
    return float(sum(loads_t1)) + float(sum(loads_t2))


def failure_sums(t3_topics: Iterable[tuple[K, K, float]]) -> dict[K, float]:
    """Inner sums of eq. (3): for each node w, the load of topics s in T3(v) with N1(C(s)) = w or N2(C(s)) = w.

    t3_topics yields (N1(C(s)), N2(C(s)), L_T(s)) for the topics s of which v is third-closest.  The value for
    w is what v takes over at resilience level 3 when w fails.
    """
    sums: dict[K, float] = {}
    for n1, n2, load in t3_topics:
        sums[n1] = sums.get(n1, 0.0) + load
        if n2 != n1:
            sums[n2] = sums.get(n2, 0.0) + load
    return sums


def l3_additional(sums: Mapping[K, float]) -> float:
    """L3_aN(v), eq. (3): the largest extra load v carries after any single relevant node failure."""
    return max(sums.values(), default=0.0)


def l3_node(l2: float, l3a: float) -> float:
    """L3_N(v), eq. (4): L2_N(v) + L3_aN(v)."""
    return l2 + l3a


def l3_failure_additional(sums_n3: Mapping[K, float], n1: K, n2: K) -> float:
    """L3_faN(N3(c), c), eq. (8): extra load on N3(c) if N1(c) or N2(c) fails, the larger of the two."""
    return max(sums_n3.get(n1, 0.0), sums_n3.get(n2, 0.0))


@dataclass(frozen=True, slots=True)
class CoordMetric:
    """The three criteria of Sec. IV-D for one coordinate at one resilience level."""

    lmax: float  # L^i_max(c), eqs. (5), (7), (10)
    lmin: float  # L^i_min(c), eqs. (5), (6), (9)
    spare: float = 0.0  # coordinate-specific spare capacity on N3(c), level 3 only (Sec. IV-D, criterion 3)

    def better_than(self, other: CoordMetric, min_gain: float = 0.0) -> bool:
        """The "better coordinate" order of Sec. IV-D, with an optional margin.

        Smaller L_max wins; on equal L_max smaller L_min; on equal both, larger spare capacity.  With
        min_gain > 0 a coordinate must lower L_max by at least that much (in load units) to count as better:
        the hysteresis that keeps a balancer from moving a topic back and forth for a rounding-size gain.
        """
        if min_gain > 0.0:
            return self.lmax <= other.lmax - min_gain
        c = _cmp(self.lmax, other.lmax)
        if c:
            return c < 0
        c = _cmp(self.lmin, other.lmin)
        if c:
            return c < 0
        return _cmp(self.spare, other.spare) > 0

    def key(self) -> tuple[float, float, float]:
        """A sort key in the Sec. IV-D order (exact, without the tolerance of better_than)."""
        return (self.lmax, self.lmin, -self.spare)


def _cmp(a: float, b: float) -> int:
    if abs(a - b) <= REL_EQ * max(abs(a), abs(b), 1e-300):
        return 0
    return -1 if a < b else 1


def coordinate_loads(
    level: Level,
    ln1: FloatArray,
    ln2: FloatArray,
    ln3_l2: FloatArray,
    ln3_l3: FloatArray,
    fa_n3: FloatArray,
) -> tuple[FloatArray, FloatArray, FloatArray]:
    """L^i_max(c), L^i_min(c) and the spare capacity for many coordinates at once (eqs. 5-10, Sec. IV-D).

    ln1, ln2: L^i_N of N1(c) and N2(c) at the requested level i; ln3_l2 and ln3_l3: L2_N and L3_N of N3(c);
    fa_n3: L3_faN(N3(c), c) from eq. (8).  Arrays of equal shape (or scalars); returns (lmax, lmin, spare).
    """
    if level == 1:
        # eq. (5): L1_min(c) = L1_max(c) = L1_N(N1(c))
        return ln1, ln1, np.zeros_like(ln1)
    if level == 2:
        # eqs. (6), (7)
        return np.maximum(ln1, ln2), np.minimum(ln1, ln2), np.zeros_like(ln1)
    n3_load = ln3_l2 + fa_n3  # L2_N(N3(c)) + L3_faN(N3(c), c)
    lmax = np.maximum(np.maximum(ln1, ln2), n3_load)  # eq. (10)
    lmin = np.minimum(np.minimum(ln1, ln2), n3_load)  # eq. (9)
    spare = ln3_l3 - n3_load  # L3_N(N3(c)) - (L2_N(N3(c)) + L3_faN(N3(c), c)), Sec. IV-D criterion 3
    return lmax, lmin, spare


def best_index(
    lmax: FloatArray,
    lmin: FloatArray,
    spare: FloatArray,
    rng: np.random.Generator | None = None,
    weights: FloatArray | None = None,
) -> int:
    """Index of a best coordinate among candidates in the Sec. IV-D order.

    Several coordinates can be best (Sec. IV-D: "several best coordinates may exist").  Without rng the first
    wins; with rng one of them is drawn, in proportion to `weights` when given (how many sampled candidates
    a row stands for).  Drawing matters: always taking the first sends every topic of a tie to the same
    coordinate until its load rises, and with unit-size topics ties are the rule (docs/reproduction.md).
    """
    if len(lmax) == 0:
        raise ValueError("best_index needs at least one candidate")
    idx = np.flatnonzero(_within(lmax, float(lmax.min())))
    if len(idx) > 1:
        sub = lmin[idx]
        idx = idx[_within(sub, float(sub.min()))]
        if len(idx) > 1:
            sub = spare[idx]
            idx = idx[_within(sub, float(sub.max()))]
    if rng is None or len(idx) == 1:
        return int(idx[0])
    if weights is None:
        return int(idx[rng.integers(len(idx))])
    w = weights[idx]
    return int(rng.choice(idx, p=w / w.sum()))


def _within(values: FloatArray, ref: float) -> npt.NDArray[np.bool_]:
    tol = REL_EQ * max(abs(ref), 1e-300)
    out: npt.NDArray[np.bool_] = np.abs(values - ref) <= tol
    return out


class LoadLedger:
    """Node loads of one topic placement, kept up to date topic by topic.

    Adding, removing or resizing a topic touches only its three nodes N1, N2, N3 (O(n) for the max of eq. 3
    on N3, as a vectorised row maximum); nothing is ever recomputed from scratch.  `recompute` exists for
    tests, which check that the incremental loads equal a full recomputation.
    """

    def __init__(self, n_nodes: int) -> None:
        self.n = n_nodes
        self.pad = n_nodes  # a virtual node with zero load stands for "no such node" (fewer than 3 nodes)
        size = n_nodes + 1
        self.t1 = np.zeros(size)  # sum of L_T over T1(v)
        self.t2 = np.zeros(size)  # sum of L_T over T2(v)
        self.fail = np.zeros((size, size))  # fail[v, w]: eq. (3) inner sum, topics of T3(v) with N1 or N2 = w
        self.l3a = np.zeros(size)  # L3_aN(v), eq. (3)
        # L2_N and L3_N kept alongside, since every coordinate query reads them
        self._l2 = np.zeros(size)
        self._l3 = np.zeros(size)

    def add(self, triple: tuple[int, int, int], load: float) -> None:
        """Account a topic of the given load at a coordinate whose closest nodes are triple."""
        self._apply(triple, load)

    def remove(self, triple: tuple[int, int, int], load: float) -> None:
        """Undo add(triple, load)."""
        self._apply(triple, -load)

    def _apply(self, triple: tuple[int, int, int], delta: float) -> None:
        a, b, d = triple
        self.t1[a] += delta
        self.t2[b] += delta
        if d != self.pad:
            self.fail[d, a] += delta
            if b != a:
                self.fail[d, b] += delta
            self.l3a[d] = max(float(self.fail[d].max()), 0.0)
        self.t1[self.pad] = self.t2[self.pad] = 0.0
        for v in {a, b, d}:
            self._l2[v] = self.t1[v] + self.t2[v]
            self._l3[v] = self._l2[v] + self.l3a[v]

    def l1(self) -> FloatArray:
        """L1_N(v) for every node, eq. (1) (the pad entry last)."""
        return self.t1

    def l2(self) -> FloatArray:
        """L2_N(v) for every node, eq. (2)."""
        return self._l2

    def l3(self) -> FloatArray:
        """L3_N(v) for every node, eq. (4)."""
        return self._l3

    def node_loads(self, level: Level) -> FloatArray:
        """L^level_N for the real nodes (without the pad)."""
        arr = self.l1() if level == 1 else self.l2() if level == 2 else self.l3()
        return arr[: self.n].copy()

    def metrics(self, level: Level, triples: IntArray) -> tuple[FloatArray, FloatArray, FloatArray]:
        """(lmax, lmin, spare) for coordinates with the given triples (shape (m, 3)), eqs. (5)-(10)."""
        n1, n2, n3 = triples[:, 0], triples[:, 1], triples[:, 2]
        if level == 1:
            l1 = self.t1
            return coordinate_loads(1, l1[n1], l1[n1], l1[n1], l1[n1], l1[n1])
        l2 = self.l2()
        if level == 2:
            return coordinate_loads(2, l2[n1], l2[n2], l2[n3], l2[n3], l2[n3])
        l3 = self._l3
        fa = np.maximum(self.fail[n3, n1], self.fail[n3, n2])  # L3_faN(N3(c), c), eq. (8)
        fa[n3 == self.pad] = 0.0
        return coordinate_loads(3, l3[n1], l3[n2], l2[n3], l3[n3], fa)

    def metric(self, level: Level, triple: tuple[int, int, int]) -> CoordMetric:
        """The Sec. IV-D criteria of one coordinate."""
        lmax, lmin, spare = self.metrics(level, np.asarray([triple], dtype=np.int64))
        return CoordMetric(float(lmax[0]), float(lmin[0]), float(spare[0]))

    @classmethod
    def from_parts(cls, t1: FloatArray, t2: FloatArray, fail: FloatArray) -> LoadLedger:
        """A ledger from the per-node sums the nodes report themselves (how a broker learns its region).

        t1, t2: sums of L_T over T1(v) and T2(v); fail[v, w]: the inner sums of eq. (3).  Row and column order
        are the caller's node indices; the pad index is len(t1).
        """
        n = len(t1)
        led = cls(n)
        led.t1[:n] = t1
        led.t2[:n] = t2
        led.fail[:n, :n] = fail
        led.l3a[:n] = np.maximum(fail.max(axis=1, initial=0.0), 0.0)  # L3_aN(v), eq. (3)
        led._l2[:n] = led.t1[:n] + led.t2[:n]  # L2_N(v), eq. (2)
        led._l3[:n] = led._l2[:n] + led.l3a[:n]  # L3_N(v), eq. (4)
        return led

    @classmethod
    def recompute(cls, n_nodes: int, placements: Iterable[tuple[tuple[int, int, int], float]]) -> LoadLedger:
        """Build a ledger from scratch with the formula functions (eqs. 1-4), for checking the incremental one."""
        items = list(placements)
        led = cls(n_nodes)
        for v in range(n_nodes):
            t1 = [load for (a, _, _), load in items if a == v]
            t2 = [load for (a, b, _), load in items if b == v and b != a]
            sums = failure_sums((a, b, load) for (a, b, d), load in items if d == v)
            led.t1[v] = l1_node(t1)
            led.t2[v] = l2_node(t2, [])
            for w, s in sums.items():
                led.fail[v, w] = s
            led.l3a[v] = l3_additional(sums)
            led._l2[v] = l2_node(t1, t2)
            led._l3[v] = l3_node(float(led._l2[v]), float(led.l3a[v]))
        return led


def eq11_holds(
    min_old_l3max: float,
    max_new_l3: float,
    assigned_load: float,
    l3_new_at_assigned_n3: float,
    tol: float = 1e-9,
) -> bool:
    """The validity check of eq. (11) after a BestGlobalCoord addition for goal L3.

    min_c L3_max,old(c) <= max(max_v L3_N,new(v) - L_T^assigned, L3_N,new(N3(c_assigned))).
    """
    rhs = max(max_new_l3 - assigned_load, l3_new_at_assigned_n3)
    return min_old_l3max <= rhs + tol * max(1.0, abs(rhs))
