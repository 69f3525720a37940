"""The simulated SeDAX network: static nodes, topics placed at coordinates, Alg. 1 and Alg. 2 with global view.

It answers coordinate queries exactly as the queried broker would (each node's best-candidate answer comes
from the same CandidateSet and LoadLedger code the brokers use); only the gathering is a function call here.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from scipy.spatial import cKDTree

from overlay.balance import BalanceParams, Offer, Selection, decide, smallest_topics
from overlay.candidates import CANDIDATES_PER_NODE, CandidateSet, pick_best, triples_for
from overlay.geometry import FloatArray, Space, delaunay_neighbours, hop_distances
from overlay.load import CoordMetric, Level, LoadLedger, eq11_holds

Triple = tuple[int, int, int]


@dataclass(frozen=True, slots=True)
class Move:
    """One delegation decided by Alg. 1 or Alg. 2."""

    topic: int
    load: float
    source: FloatArray
    target: FloatArray


class SimNetwork:
    """Nodes at fixed coordinates, topics with loads and coordinates C(t), and the loads they induce."""

    def __init__(
        self,
        points: FloatArray,
        space: Space,
        rng: np.random.Generator,
        per_node: int = CANDIDATES_PER_NODE,
        with_candidates: bool = True,
    ) -> None:
        self.points = points
        self.space = space
        self.n = len(points)
        self.tree = cKDTree(points)
        self.neighbours = delaunay_neighbours(points)
        self.ledger = LoadLedger(self.n)
        self.cands = CandidateSet(points, space, rng, per_node, self.neighbours, self.tree) if with_candidates else None
        self.coords: list[FloatArray] = []  # C(t)
        self.homes: list[FloatArray] = []  # h(t)
        self.loads: list[float] = []  # L_T(t)
        self.triples: list[Triple] = []  # (N1, N2, N3) of C(t)
        self.members: list[set[int]] = [set() for _ in range(self.n + 1)]  # topics in T1(v) ∪ T2(v) ∪ T3(v)
        self.rank: list[dict[int, int]] = [{} for _ in range(self.n + 1)]  # rank[v][t] = j with t ∈ T_j(v)
        self._regions: dict[tuple[int, int], list[int]] = {}
        self.eq11_violations = 0

    # ---- placement -------------------------------------------------------------------------------------
    def triple(self, coord: FloatArray) -> Triple:
        """(N1, N2, N3) of a coordinate."""
        t = triples_for(self.points, np.asarray(coord, dtype=np.float64).reshape(1, 2), self.tree)[0]
        return (int(t[0]), int(t[1]), int(t[2]))

    def _place(self, tid: int, triple: Triple, load: float) -> None:
        self.ledger.add(triple, load)
        for j, v in enumerate(triple, start=1):
            self.members[v].add(tid)
            self.rank[v][tid] = j
        if self.cands is not None:
            self.cands.invalidate(triple)

    def _unplace(self, tid: int, triple: Triple, load: float) -> None:
        self.ledger.remove(triple, load)
        for v in triple:
            self.members[v].discard(tid)
            self.rank[v].pop(tid, None)
        if self.cands is not None:
            self.cands.invalidate(triple)

    def add_topic(
        self, home: FloatArray, load: float, coord: FloatArray | None = None, triple: Triple | None = None
    ) -> int:
        """Add topic t with h(t) = home at C(t) = coord (default home); returns its id.

        triple, when given, must be the (N1, N2, N3) of C(t); callers that already know it save a lookup.
        """
        c = np.asarray(home if coord is None else coord, dtype=np.float64)
        tid = len(self.coords)
        tr = self.triple(c) if triple is None else triple
        self.coords.append(c)
        self.homes.append(np.asarray(home, dtype=np.float64))
        self.loads.append(float(load))
        self.triples.append(tr)
        self._place(tid, tr, float(load))
        return tid

    def set_load(self, tid: int, load: float) -> None:
        """Grow or shrink a topic in place: only its three nodes change (loads are additive)."""
        delta = float(load) - self.loads[tid]
        if delta == 0.0:
            return
        self.loads[tid] = float(load)
        tr = self.triples[tid]
        self.ledger.add(tr, delta)
        if self.cands is not None:
            self.cands.invalidate(tr)

    def move(self, tid: int, coord: FloatArray) -> None:
        """Delegate topic t to a new coordinate C(t)."""
        self._unplace(tid, self.triples[tid], self.loads[tid])
        c = np.asarray(coord, dtype=np.float64)
        tr = self.triple(c)
        self.coords[tid] = c
        self.triples[tid] = tr
        self._place(tid, tr, self.loads[tid])

    # ---- coordinate selection (Sec. V) -------------------------------------------------------------------
    def region(self, v: int, hops: int) -> list[int]:
        """Nodes within `hops` Delaunay hops of v (v first)."""
        key = (v, hops)
        r = self._regions.get(key)
        if r is None:
            r = sorted(hop_distances(self.neighbours, v, hops), key=lambda u: (u != v, u))
            self._regions[key] = r
        return r

    def offers(self, node: int, params: BalanceParams, rng: np.random.Generator) -> list[Offer[FloatArray]]:
        """The answers delegating node `node` collects with the configured selection algorithm (C*)."""
        level = params.goal.level
        cands = self.cands
        ties = params.tie_rng(rng)
        if params.selection is Selection.INDCOORD:
            qs = self.space.uniform(rng, params.n_queries)
            trs = triples_for(self.points, qs, self.tree)
            lmax, lmin, spare = self.ledger.metrics(level, trs)
            return [Offer(qs[i], CoordMetric(float(lmax[i]), float(lmin[i]), float(spare[i]))) for i in range(len(qs))]
        if cands is None:
            raise ValueError(f"{params.selection} needs candidate coordinates")
        if params.selection is Selection.BESTGLOBAL:
            i, m = cands.best_among(range(self.n), level, self.ledger, ties)
            return [Offer(cands.coords[i], m)]
        qs = self.space.uniform(rng, params.n_queries)
        owners = [node] + [int(o) for o in self.tree.query(qs, k=1)[1]]
        answers = []
        for o in owners:
            if params.selection is Selection.BESTLOCAL:
                answers.append(cands.best(o, level, self.ledger, ties))
            else:
                answers.append(cands.best_among(self.region(o, params.n_hops), level, self.ledger, ties))
        return [Offer(cands.coords[i], m) for i, m in answers]

    def global_min_lmax(self, level: Level) -> float:
        """min over all candidate coordinates of L^i_max (the left side of eq. 11)."""
        if self.cands is None:
            raise ValueError("needs candidate coordinates")
        return pick_best([self.cands.best(v, level, self.ledger) for v in range(self.n)])[1].lmax

    # ---- Alg. 1 and Alg. 2 -----------------------------------------------------------------------------
    def add_balanced(
        self,
        home: FloatArray,
        load: float,
        params: BalanceParams,
        rng: np.random.Generator,
        check_eq11: bool = False,
    ) -> tuple[int, bool]:
        """Load-balanced topic addition, Alg. 1.  Returns (topic id, whether it was delegated)."""
        level = params.goal.level
        home = np.asarray(home, dtype=np.float64)
        home_tr = self.triple(home)
        current = self.ledger.metric(level, home_tr)
        offers = self.offers(home_tr[0], params, rng)
        choice = decide(current, offers, params.min_gain, params.tie_rng(rng))
        old_min = 0.0
        if check_eq11:
            # BestGlobalCoord for L3 has just computed exactly global_min_lmax(3): reuse it
            reuse = params.selection is Selection.BESTGLOBAL and level == 3
            old_min = offers[0].metric.lmax if reuse else self.global_min_lmax(3)
        tid = self.add_topic(home, load, None if choice is None else choice.coord, home_tr if choice is None else None)
        if check_eq11:
            l3 = self.ledger.node_loads(3)
            n3 = self.triples[tid][2]
            l3_n3 = float(l3[n3]) if n3 < self.n else 0.0
            if not eq11_holds(old_min, float(l3.max()), load, l3_n3):
                self.eq11_violations += 1
        return tid, choice is not None

    def responsible(self, v: int, level: Level) -> dict[int, float]:
        """Loads of the topics in T1(v) ∪ .. ∪ T_level(v)."""
        return {t: self.loads[t] for t in self.members[v] if self.rank[v][t] <= level}

    def balance_step(self, v: int, params: BalanceParams, rng: np.random.Generator) -> Move | None:
        """Continuous load balancing for node v, Alg. 2: delegate its smallest topic if it has a better place.

        With params.scan > 1 the round goes on to the next-smallest topics until one moves.
        """
        level = params.goal.level
        for t in smallest_topics(self.responsible(v, level), params.scan):
            mv = self._try_move(v, t, params, rng)
            if mv is not None:
                return mv
        return None

    def _try_move(self, v: int, t: int, params: BalanceParams, rng: np.random.Generator) -> Move | None:
        """Alg. 2 lines 2-6 for topic t of node v."""
        tr, load = self.triples[t], self.loads[t]
        # Sec. V: metrics are computed excluding the topic to be delegated.
        self._unplace(t, tr, load)
        current = self.ledger.metric(params.goal.level, tr)
        choice = decide(current, self.offers(v, params, rng), params.min_gain, params.tie_rng(rng))
        if choice is None:
            self._place(t, tr, load)
            return None
        source = self.coords[t]
        new_c = np.asarray(choice.coord, dtype=np.float64)
        new_tr = self.triple(new_c)
        self.coords[t] = new_c
        self.triples[t] = new_tr
        self._place(t, new_tr, load)
        return Move(t, load, source, new_c)
