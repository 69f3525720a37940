"""Messages of topic delegation (Sec. III) and distributed load balancing (Sec. V, VI).

Moving a topic from coordinate C_old to C_new (its primaries P_old and P_new) is a two-phase hand-over, so
that subscribers see every message exactly once and publishers are acknowledged exactly once:

1. P_old asks the home node N1(h(t)) for a LEASE; the home grants one move of a topic at a time (decisions
   about one topic are serialised there) and refuses a topic that moved less than a cool-down ago.
2. P_old freezes the topic (requests wait), and sends the whole topic to C_new as REPLICATE frames with
   `handover` set: history, subscribers, publishers' sequence numbers, the messages it stored but has not
   acknowledged (`waiters`) or delivered (records newer than `delivered_upto`).
3. P_new stores it *staged* (it answers nobody yet), copies it to its own secondary, and only once that
   replica has caught up confirms with REPLICATED: a topic is handed only to a pair that holds all of it.
4. P_old sends ACTIVATE to C_new and DELEGATE_UPDATE to the home, redirects the registered clients, sends its
   waiting requests after the ACTIVATE (same path, so they arrive behind it) and releases its replicas.
   P_new, on ACTIVATE, acknowledges the waiters and delivers the undelivered messages: one node delivers.

If no confirmation comes in time, P_old aborts (RELEASE to C_new) and serves the topic where it was.

Load knowledge: every broker sends LOAD_REPORT to its neighbours, with its own loads and the reports of its
neighbours, so each broker knows the loads of its 2-hop region (what the metrics of coordinates in and next
to its Voronoi cell need).  COORD_QUERY / COORD_OFFER carry the coordinate selection of Sec. V.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, ClassVar, Final, Literal, TypeAlias

from overlay.protocol import (
    MAX_ID_LEN,
    MAX_LIST_LEN,
    LocalProtocolError,
    Message,
    NodeInfo,
    check_corr,
    dec_coord,
    dec_float,
    dec_list,
    dec_node,
    dec_str,
    enc_node,
    register_field_type,
    register_message,
)
from overlay.pubsub import Delegation, Sessions

Coord: TypeAlias = tuple[float, float]
QueryKind: TypeAlias = Literal["indcoord", "bestlocal", "flood"]

# A flooded query (BestRegionalCoord's region, BestGlobalCoord's whole overlay) travels at most this many hops.
MAX_FLOOD_TTL: Final = 64


def _check_load(v: float, what: str) -> None:
    if not math.isfinite(v) or v < 0:
        raise LocalProtocolError(f"{what} must be a finite non-negative number, got {v}")


@dataclass(frozen=True, slots=True)
class NodeLoad:
    """One broker's load record (Sec. IV): the parts from which any L^i_N and coordinate metric follow.

    t1, t2: sums of L_T over T1(v) and T2(v) (eqs. 1, 2); fails: the inner sums of eq. (3) by node id (what v
    takes over when that node fails, level 3).  `ts` is the reporter's clock, so the freshest record wins.
    """

    node: NodeInfo
    t1: float
    t2: float
    fails: dict[str, float]
    ts: float

    def __post_init__(self) -> None:
        _check_load(self.t1, "t1")
        _check_load(self.t2, "t2")
        if len(self.fails) > MAX_LIST_LEN:
            raise LocalProtocolError(f"a load record names at most {MAX_LIST_LEN} nodes")
        for k, v in self.fails.items():
            if not 0 < len(k) <= MAX_ID_LEN:
                raise LocalProtocolError("failure-sum keys are node ids")
            _check_load(v, "failure sum")
        if not math.isfinite(self.ts):
            raise LocalProtocolError("load record timestamp must be finite")


@dataclass(frozen=True, slots=True)
class Offer:
    """An answer to a coordinate query: a coordinate and its Sec. IV-D criteria, and who answered."""

    coord: Coord
    lmax: float
    lmin: float
    spare: float
    node: str


def _dec_fails(v: Any) -> dict[str, float]:
    if type(v) is not dict or len(v) > MAX_LIST_LEN:
        raise TypeError("failure sums are a map of node id to number")
    return {dec_str(k): dec_float(x) for k, x in v.items()}


def _dec_load(v: Any) -> NodeLoad:
    node, t1, t2, fails, ts = dec_list(v)
    return NodeLoad(dec_node(node), dec_float(t1), dec_float(t2), _dec_fails(fails), dec_float(ts))


def _dec_offer(v: Any) -> Offer:
    c, lmax, lmin, spare, node = dec_list(v)
    return Offer(dec_coord(c), dec_float(lmax), dec_float(lmin), dec_float(spare), dec_str(node))


register_field_type(
    "tuple[NodeLoad, ...]",
    lambda ls: [[enc_node(x.node), x.t1, x.t2, x.fails, x.ts] for x in ls],
    lambda v: tuple(_dec_load(x) for x in dec_list(v)),
)
register_field_type(
    "tuple[Offer, ...]",
    lambda os: [[[o.coord[0], o.coord[1]], o.lmax, o.lmin, o.spare, o.node] for o in os],
    lambda v: tuple(_dec_offer(x) for x in dec_list(v)),
)
register_field_type(
    "tuple[str, str, str]",
    list,
    lambda v: tuple(dec_str(x) for x in dec_list(v)),
)
register_field_type(
    "tuple[tuple[str, str, str], ...]",
    lambda ps: [list(p) for p in ps],
    lambda v: tuple(tuple(dec_str(y) for y in dec_list(x)) for x in dec_list(v)),
)
_KINDS: Final = frozenset(("indcoord", "bestlocal", "flood"))


def _kind(v: Any) -> str:
    if v not in _KINDS:
        raise ValueError(f"unknown query kind {v!r}")
    return str(v)


register_field_type("QueryKind", lambda v: v, _kind)


# ---------------------------------------------------------------------------------- moving a topic


@register_message
@dataclass(frozen=True, slots=True)
class Lease(Message):
    """P_old -> home N1(h(t)): may topic move from `frm` to `to`?  Answered by LEASED."""

    op: ClassVar[Literal["lease"]] = "lease"
    corr: int
    topic: str
    frm: Coord
    to: Coord
    origin: NodeInfo
    force: bool = False  # an operator's move (`sedax move`): no cool-down

    def __post_init__(self) -> None:
        check_corr(self.corr)


@register_message
@dataclass(frozen=True, slots=True)
class Leased(Message):
    """Home -> P_old: the answer to LEASE; `reason` says why not when refused."""

    op: ClassVar[Literal["leased"]] = "leased"
    corr: int
    topic: str
    granted: bool
    reason: str


@register_message
@dataclass(frozen=True, slots=True)
class Activate(Message):
    """P_old -> C_new: the hand-over is complete, serve the topic (acknowledge, deliver, accept requests)."""

    op: ClassVar[Literal["activate"]] = "activate"
    topic: str
    coord: Coord
    origin: NodeInfo


@register_message
@dataclass(frozen=True, slots=True)
class Release(Message):
    """Drop the copy of a topic held for coordinate `coord` (an aborted move, or replicas left behind)."""

    op: ClassVar[Literal["release"]] = "release"
    topic: str
    coord: Coord
    origin: NodeInfo


@register_message
@dataclass(frozen=True, slots=True)
class DelegateUpdate(Message):
    """The new delegate list of a topic, to its home (answered by DELEGATE_UPDATED) and from the home to the
    home's secondary (`sync`, not answered), so the list survives the home's failure (Sec. III-A)."""

    op: ClassVar[Literal["delegate_update"]] = "delegate_update"
    corr: int
    topic: str
    delegates: tuple[Delegation, ...]
    origin: NodeInfo
    sync: bool = False


@register_message
@dataclass(frozen=True, slots=True)
class DelegateUpdated(Message):
    """Home -> sender of DELEGATE_UPDATE: stored."""

    op: ClassVar[Literal["delegate_updated"]] = "delegate_updated"
    corr: int
    topic: str


# ---------------------------------------------------------------------------------- load knowledge


@register_message
@dataclass(frozen=True, slots=True)
class LoadReport(Message):
    """Broker -> neighbours (CONTROL): its own load record first, then its neighbours' latest ones."""

    op: ClassVar[Literal["load_report"]] = "load_report"
    loads: tuple[NodeLoad, ...]


@register_message
@dataclass(frozen=True, slots=True)
class TertiaryNote(Message):
    """Primary -> its topics' third-closest node at level 3: the topics it would take over, with their
    sizes and N1/N2 (eq. 3 needs them), so the tertiary's L3_N counts them before any failure."""

    op: ClassVar[Literal["tertiary_note"]] = "tertiary_note"
    origin: NodeInfo
    pairs: tuple[tuple[str, str, str], ...]  # (topic, N1 id, N2 id) per entry
    sizes: tuple[float, ...]  # L_T of each entry, bytes

    def __post_init__(self) -> None:
        if len(self.pairs) != len(self.sizes) or any(len(p) != 3 for p in self.pairs):
            raise LocalProtocolError("a tertiary note has one (topic, N1, N2) triple per size")
        for v in self.sizes:
            _check_load(v, "topic size")


@register_message
@dataclass(frozen=True, slots=True)
class CoordQuery(Message):
    """A coordinate query of Sec. V, routed to `target`; the node reached answers COORD_OFFER to `origin`.

    indcoord: the metrics of `target` itself (IndCoord).  bestlocal: the best of the node's candidates in its
    own Voronoi cell (BestLocalCoord).  flood: bestlocal, and pass the query on to every neighbour while `ttl`
    lasts, each node answering once (BestRegionalCoord with ttl = n_hops; BestGlobalCoord floods everything).
    The topic being delegated is left out of every metric: `triple` (its N1..N3 ids) and `load` say what to
    subtract (Sec. V).
    """

    op: ClassVar[Literal["coord_query"]] = "coord_query"
    corr: int
    kind: QueryKind
    level: int
    target: Coord
    origin: NodeInfo
    triple: tuple[str, str, str]
    load: float
    ttl: int = 0
    qid: str = ""

    def __post_init__(self) -> None:
        check_corr(self.corr)
        if self.level not in (1, 2, 3):
            raise LocalProtocolError(f"query level must be 1, 2 or 3, got {self.level}")
        _check_load(self.load, "topic load")
        if not 0 <= self.ttl <= MAX_FLOOD_TTL:
            raise LocalProtocolError(f"query ttl must be in 0..{MAX_FLOOD_TTL}, got {self.ttl}")
        if len(self.triple) != 3:
            raise LocalProtocolError("a query's triple names N1, N2, N3 ('' where there is none)")
        if len(self.qid) > MAX_ID_LEN:
            raise LocalProtocolError(f"query id is at most {MAX_ID_LEN} characters")


@register_message
@dataclass(frozen=True, slots=True)
class CoordOffer(Message):
    """Answer to COORD_QUERY (one or no offer: a node that knows too little of its region says nothing)."""

    op: ClassVar[Literal["coord_offer"]] = "coord_offer"
    corr: int
    offers: tuple[Offer, ...]


# ---------------------------------------------------------------------------------- operator requests


@register_message
@dataclass(frozen=True, slots=True)
class MoveTopic(Message):
    """Client -> topic primary: move the topic to coordinate `to` now (`sedax move`); DONE or FAILED."""

    op: ClassVar[Literal["move_topic"]] = "move_topic"
    corr: int
    topic: str
    to: Coord

    def __post_init__(self) -> None:
        check_corr(self.corr)


@register_message
@dataclass(frozen=True, slots=True)
class BalancePlan(Message):
    """Client -> access broker: run one balancing round of this broker without moving anything (dry run);
    answered by BALANCE_PLANNED with one JSON object per topic considered."""

    op: ClassVar[Literal["balance_plan"]] = "balance_plan"
    corr: int
    all_topics: bool = False

    def __post_init__(self) -> None:
        check_corr(self.corr)


@register_message
@dataclass(frozen=True, slots=True)
class BalancePlanned(Message):
    """The dry run's decisions, as JSON texts (topic, size, from, to, current and best metric, verdict)."""

    op: ClassVar[Literal["balance_planned"]] = "balance_planned"
    corr: int
    plans: tuple[str, ...]


@register_message
@dataclass(frozen=True, slots=True)
class TopicMoved(Message):
    """A topic's holder -> an access broker: these sessions' topic now lives at `coord`; the access broker
    addresses later requests there and tells each session (REDIRECT, Sec. III-B)."""

    op: ClassVar[Literal["topic_moved"]] = "topic_moved"
    access: str
    sessions: Sessions  # (a topic's subscribers and waiting publishers there: more than MAX_LIST_LEN may be)
    topic: str
    coord: Coord
