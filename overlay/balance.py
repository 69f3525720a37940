"""Balancing decisions of Sec. V and VI, independent of how the answers were gathered.

The coordinate selection algorithms (IndCoord, BestLocalCoord, BestRegionalCoord, BestGlobalCoord) differ only
in *which* nodes answer and *what* each answers; the decision that follows is the same: take the best answer
(Tiebreaker(C*)) and delegate when it is better than the topic's current coordinate (Alg. 1 lines 3-6,
Alg. 2 lines 3-6).  The simulator gathers answers from its global view, a broker over the network.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import Final, Generic, TypeVar

import numpy as np

from overlay.load import CoordMetric, Level

T = TypeVar("T")
C = TypeVar("C")


class Selection(StrEnum):
    """Coordinate selection algorithms of Sec. V."""

    INDCOORD = "indcoord"  # V-A: metrics of n_queries random coordinates
    BESTLOCAL = "bestlocal"  # V-B: each queried node answers its locally best coordinate
    BESTREGIONAL = "bestregional"  # V-C: best within n_hops of the queried node
    BESTGLOBAL = "bestglobal"  # V-D: flooding, every node answers


class Goal(StrEnum):
    """Load-balancing goal: which node load L^i_N to equalise."""

    L1 = "L1"
    L2 = "L2"
    L3 = "L3"

    @property
    def level(self) -> Level:
        """The resilience level i whose loads L^i this goal balances."""
        return {"L1": 1, "L2": 2, "L3": 3}[self.value]  # type: ignore[return-value]


class BalanceMode(StrEnum):
    """When to balance (Sec. VI): never, at topic addition, every Δτ, or both."""

    NONE = "none"
    ADDITION = "addition"
    CONTINUOUS = "continuous"
    COMBINED = "combined"

    @property
    def at_addition(self) -> bool:
        """Balance when a topic is first created (Alg. 1)."""
        return self in (BalanceMode.ADDITION, BalanceMode.COMBINED)

    @property
    def continuous(self) -> bool:
        """Balance every Δτ (Alg. 2)."""
        return self in (BalanceMode.CONTINUOUS, BalanceMode.COMBINED)


DEFAULT_QUERIES: Final = 10  # n_queries: Table III shows 10 is where IndCoord/BestLocalCoord become good
DEFAULT_HOPS: Final = 1  # n_hops for BestRegionalCoord


@dataclass(frozen=True, slots=True)
class BalanceParams:
    """How a node selects coordinates and when it moves a topic."""

    goal: Goal = Goal.L3
    selection: Selection = Selection.BESTLOCAL
    n_queries: int = DEFAULT_QUERIES
    n_hops: int = DEFAULT_HOPS
    # Extra margin (in load units) a candidate must beat the current coordinate's L_max by before a topic
    # moves.  0 is the paper's rule; a live cluster uses a positive value so that measurement noise and a
    # topic's own growth do not move it back and forth (the oscillation Pulsar and Cruise Control users see).
    min_gain: float = 0.0
    # How many of a node's smallest topics one Alg. 2 round may try, smallest first; the first that has a
    # better coordinate moves.  1 is the paper's line 1 (t_vmin only).  With 1 a node whose smallest topic
    # already sits well proposes that same topic every Δτ and never sheds a larger one (docs/reproduction.md,
    # Table V).
    scan: int = 1
    # Tiebreaker(C*) among several best coordinates: a random one (True) or the first answer (False, which
    # prefers the delegating node's own answer and the lowest-numbered candidate).
    random_ties: bool = True

    def __post_init__(self) -> None:
        if self.n_queries < 1:
            raise ValueError(f"n_queries must be at least 1, got {self.n_queries}")
        if self.n_hops < 0:
            raise ValueError(f"n_hops must be non-negative, got {self.n_hops}")
        if self.min_gain < 0:
            raise ValueError(f"min_gain must be non-negative, got {self.min_gain}")
        if self.scan < 1:
            raise ValueError(f"scan must be at least 1 (1 = the paper's smallest topic only), got {self.scan}")

    def tie_rng(self, rng: np.random.Generator) -> np.random.Generator | None:
        """The generator Tiebreaker(C*) draws from, or None when the first best coordinate wins."""
        return rng if self.random_ties else None


@dataclass(frozen=True, slots=True)
class Offer(Generic[C]):
    """One answer to a coordinate query: a coordinate and its Sec. IV-D criteria."""

    coord: C
    metric: CoordMetric


def tiebreaker(offers: Sequence[Offer[C]], rng: np.random.Generator | None = None) -> Offer[C]:
    """Tiebreaker(C*) of Alg. 1 line 3 / Alg. 2 line 3: a best offer in the Sec. IV-D order.

    On a full tie the earliest offer wins, or with rng a random one of the tied offers.  Either way a topic
    moves only if the winner is strictly better than where it is (`decide`), so a tie never moves it for
    nothing.
    """
    if not offers:
        raise ValueError("tiebreaker needs at least one offer")
    best = offers[0]
    for o in offers[1:]:
        if o.metric.better_than(best.metric):
            best = o
    if rng is None:
        return best
    tied = [o for o in offers if not best.metric.better_than(o.metric)]
    return tied[int(rng.integers(len(tied)))] if len(tied) > 1 else best


def decide(
    current: CoordMetric,
    offers: Sequence[Offer[C]],
    min_gain: float = 0.0,
    rng: np.random.Generator | None = None,
) -> Offer[C] | None:
    """Alg. 1 lines 3-6 and Alg. 2 lines 3-6: the offer to delegate to, or None to stay at C(t).

    current is the metric of the topic's present coordinate computed *without* the topic (Sec. V), the
    offers likewise; rng draws among several best offers (`tiebreaker`).
    """
    if not offers:
        return None
    best = tiebreaker(offers, rng)
    return best if best.metric.better_than(current, min_gain) else None


def smallest_topics(loads: Mapping[T, float], k: int) -> list[T]:
    """The k smallest topics, smallest first (ties by name): the topics one Alg. 2 round tries in turn.

    k = 1 is Alg. 2 line 1 (t_vmin, the smallest topic among those v is responsible for); a larger k
    (`BalanceParams.scan`) lets the round go on to the next-smallest topic when the smallest has no better
    coordinate.
    """
    return [t for t, _ in sorted(loads.items(), key=lambda kv: (kv[1], str(kv[0])))[:k]]
