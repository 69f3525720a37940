"""Distributed load balancing on a live broker (Sec. V, VI): load reports, coordinate queries, Alg. 1 and 2.

Every broker sends its load record to its neighbours, together with the records its neighbours sent it, so it
knows its 2-hop region (`overlay.region`).  It looks every `load_report_interval` and reports when a load it
would report changed by more than `load_report_threshold` (relative), when its neighbours changed, or when
`load_report_refresh` has passed: an idle overlay sends one report per link per refresh, not one a second.
It answers coordinate queries from that knowledge: IndCoord (the metrics of the coordinate asked about),
BestLocalCoord (the best of 200 candidates in its own Voronoi cell, Sec. V-E) and flooded queries
(BestRegionalCoord within n_hops of the node reached, BestGlobalCoord everywhere), each node answering the
query's origin directly.

The decisions are the simulator's: `overlay.balance.decide` picks Tiebreaker(C*) and moves only when it is
better than the topic's current coordinate, by at least `min_gain` of its L_max (hysteresis).  Alg. 2 runs
every Δτ and considers the broker's smallest topic; Alg. 1 places a new topic when its home creates it.
Moves themselves are the pub/sub layer's (`PubSub.request_move`), serialised at the topic's home.
"""

from __future__ import annotations

import asyncio
import hashlib
import itertools
import json
import logging
import secrets
from collections import OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Final, Protocol

import numpy as np

from broker.tasks import TaskSet
from overlay.balance import BalanceMode, BalanceParams, Goal, Selection, decide, smallest_topics
from overlay.balance import Offer as Choice
from overlay.delegation import (
    MAX_FLOOD_TTL,
    CoordOffer,
    CoordQuery,
    LoadReport,
    NodeLoad,
    Offer,
    QueryKind,
    TertiaryNote,
)
from overlay.geometry import FloatArray
from overlay.load import CoordMetric, Level
from overlay.protocol import CORR_SPAN, Coord, Message, NodeInfo, encode_message
from overlay.region import RegionLoads, cell_candidates

if TYPE_CHECKING:
    from broker.config import BrokerConfig
    from broker.pubsub import PubSub

CANDIDATES: Final = 200  # per node, Sec. V-E
# Flood ids remembered to answer each flooded query once; far more than a round can produce.
SEEN_FLOODS: Final = 4096


class BrokerPort(Protocol):
    """What the balancer needs from the broker around it (implemented in broker.node)."""

    @property
    def me(self) -> NodeInfo:
        """This broker."""
        ...

    def neighbour_infos(self) -> list[NodeInfo]:
        """The established neighbour links' brokers."""
        ...

    def send_to_neighbour(self, node_id: str, msg: Message) -> int:
        """Send a CONTROL message on a neighbour link; the bytes written (0 if there is no such link)."""
        ...

    def route(self, dest: Coord, msg: Message) -> None:
        """Send a routed message toward dest."""
        ...

    def view(self) -> Mapping[str, NodeInfo]:
        """Every broker this one knows to be alive, by id."""
        ...


@dataclass(slots=True)
class _Collect:
    offers: list[Offer] = field(default_factory=list)
    expected: int | None = None
    done: asyncio.Event = field(default_factory=asyncio.Event)


@dataclass(slots=True)
class _Record:
    load: NodeLoad
    heard: float


class Balancer:
    """Load knowledge, coordinate queries and the balancing loops of one broker."""

    def __init__(
        self,
        port: BrokerPort,
        pubsub: PubSub,
        config: BrokerConfig,
        tasks: TaskSet,
        log: logging.Logger,
    ) -> None:
        self.port = port
        self.pubsub = pubsub
        self.config = config
        self.tasks = tasks
        self.log = log
        self.mode = BalanceMode(config.balance)
        self.params = BalanceParams(
            goal=Goal(config.goal),
            selection=Selection(config.selection),
            n_queries=config.queries,
            n_hops=config.hops,
            scan=config.balance_scan,
            random_ties=config.ties == "random",
        )
        self.records: dict[str, _Record] = {}
        self._pending: dict[int, _Collect] = {}
        self._corr = itertools.count(1 + secrets.randbelow(CORR_SPAN))  # (CORR_SPAN says why)
        self._seen: OrderedDict[str, None] = OrderedDict()
        self._cand_key: tuple[tuple[float, float], ...] | None = None
        self._cand: FloatArray | None = None
        # What the last report said (load values by node id), to whom and when: a report goes out again only
        # when it changed enough, the neighbours changed or the refresh is due.
        self._reported: dict[str, tuple[tuple[str, ...], tuple[float, ...]]] = {}
        self._reported_to: frozenset[str] = frozenset()
        self._reported_at = float("-inf")
        self._next_look = float("-inf")
        self.refresh = max(config.load_report_refresh, config.load_report_interval)
        seed = int.from_bytes(hashlib.sha256(port.me.id.encode()).digest()[:8], "big")
        self.rng = np.random.default_rng(seed)
        self.counters: dict[str, int] = {
            "load_reports_sent": 0,
            "load_report_bytes": 0,
            "balance_queries": 0,
            "balance_query_bytes": 0,
            "balance_offers": 0,
            "balance_offer_bytes": 0,
            "balance_rounds": 0,
            "balance_decisions_move": 0,
            "placements": 0,
        }

    @property
    def level(self) -> Level:
        """The resilience level whose loads the goal balances."""
        return self.params.goal.level

    # ----------------------------------------------------------------------------------------- lifecycle

    def start(self, loop_time: Callable[[], float]) -> None:
        """Start the Alg. 2 loop when balancing is continuous; the owner calls `tick` for the load reports."""
        self._now = loop_time
        if self.mode.continuous:
            self.tasks.spawn(self._balance_loop(), "balancer")
        if self.mode.at_addition:
            self.pubsub.placer = self.place

    def tick(self, now: float) -> None:
        """On the broker's ticker: look at the loads every load_report_interval and report if due."""
        if now >= self._next_look:
            self._next_look = now + self.config.load_report_interval
            self.send_reports(now)

    async def _balance_loop(self) -> None:
        # Brokers start at different moments; a random phase spreads their rounds over Δτ.
        await asyncio.sleep(float(self.rng.uniform(0, self.config.balance_interval)))
        while True:
            try:
                await self.round()
            except Exception:  # a failed round must not end balancing for good
                self.log.exception("balancing round failed")
            await asyncio.sleep(self.config.balance_interval)

    # ------------------------------------------------------------------------------------ load knowledge

    def send_reports(self, now: float, force: bool = False) -> None:
        """LOAD_REPORT to every neighbour (this broker's record, then its neighbours' own records) if it changed
        enough since it was last sent, the neighbours changed, the refresh is due, or force; TERTIARY_NOTEs.

        The notes still go out at every look: a tertiary forgets a note after `note_ttl` (a few looks), which is
        what removes a topic that moved away from its former tertiary's L3_N; with notes only on change that
        would take several refreshes.  They exist at resilience 3 only, for the topics a broker is primary of.
        """
        own = self.pubsub.load_record()
        nbrs = self.port.neighbour_infos()
        known = [self.records[n.id].load for n in nbrs if n.id in self.records]
        refresh = force or now - self._reported_at >= self.refresh
        values = {rec.node.id: _values(rec) for rec in (own, *known)}
        to = frozenset(n.id for n in nbrs)
        if refresh or to != self._reported_to or self._changed(values):
            self._reported, self._reported_to, self._reported_at = values, to, now
            msg = LoadReport((own, *known))
            for n in nbrs:
                sent = self.port.send_to_neighbour(n.id, msg)
                if sent:
                    self.counters["load_reports_sent"] += 1
                    self.counters["load_report_bytes"] += sent
        for node, pairs, sizes in self.pubsub.tertiary_notes().values():
            self.port.route(node.coord, TertiaryNote(self.port.me, tuple(pairs), tuple(sizes)))

    def _changed(self, values: dict[str, tuple[tuple[str, ...], tuple[float, ...]]]) -> bool:
        if values.keys() != self._reported.keys():
            return True
        for nid, (keys, loads) in values.items():
            old_keys, old_loads = self._reported[nid]
            if keys != old_keys or self._differ(old_loads, loads):
                return True
        return False

    def _differ(self, old: tuple[float, ...], new: tuple[float, ...]) -> bool:
        if len(old) != len(new):
            return True
        limit = self.config.load_report_threshold
        return any(abs(a - b) > limit * max(abs(a), abs(b)) for a, b in zip(old, new, strict=True))

    def on_report(self, msg: LoadReport) -> None:
        """A neighbour's LOAD_REPORT: keep the freshest record of every node it names."""
        now = self._now()
        me = self.port.me.id
        for rec in msg.loads:
            if rec.node.id == me:
                continue
            cur = self.records.get(rec.node.id)
            if cur is None or rec.ts >= cur.load.ts:
                self.records[rec.node.id] = _Record(rec, now)

    def region(self) -> RegionLoads:
        """Loads of this broker and every live broker it has a recent record of."""
        now = self._now()
        live = self.port.view()
        stale = 3 * self.refresh + 2.0  # a neighbour reports unchanged loads only every refresh
        for nid in [k for k, r in self.records.items() if k not in live or now - r.heard > stale]:
            del self.records[nid]
        return RegionLoads.build([self.pubsub.load_record(), *(r.load for r in self.records.values())])

    def candidates(self) -> FloatArray:
        """Sec. V-E: CANDIDATES uniform coordinates in this broker's Voronoi cell, redrawn when it changes."""
        nbrs = tuple(sorted(n.coord for n in self.port.neighbour_infos()))
        if self._cand is None or nbrs != self._cand_key:
            self._cand_key = nbrs
            self._cand = cell_candidates(self.port.me.coord, nbrs, self.config.space, self.rng, CANDIDATES)
        return self._cand

    # ----------------------------------------------------------------------------------- coordinate queries

    def on_query(self, q: CoordQuery) -> None:
        """Answer a COORD_QUERY that reached this broker (and pass a flood on)."""
        if q.kind == "flood":
            if q.qid in self._seen:
                return
            self._seen[q.qid] = None
            while len(self._seen) > SEEN_FLOODS:
                self._seen.popitem(last=False)
            if q.ttl > 0:
                nxt = replace(q, ttl=q.ttl - 1)
                for n in self.port.neighbour_infos():
                    if n.id != q.origin.id:
                        self.port.route(n.coord, nxt)
        region = self.region().without(q.triple, q.load)
        level: Level = q.level  # type: ignore[assignment]
        me = self.port.me
        if q.kind == "indcoord":
            offer = region.offer(level, q.target, me.id)
        else:
            cands = self.candidates()
            i, m = region.best(level, cands, self.params.tie_rng(self.rng))
            offer = Offer((float(cands[i, 0]), float(cands[i, 1])), m.lmax, m.lmin, m.spare, me.id)
        answer = CoordOffer(q.corr, (offer,))
        self.counters["balance_offers"] += 1
        self.counters["balance_offer_bytes"] += len(encode_message(answer))
        if q.origin.id == me.id:
            self.on_offer(answer)
        else:
            self.port.route(q.origin.coord, answer)

    def on_offer(self, msg: CoordOffer) -> None:
        """A COORD_OFFER for one of this broker's selections."""
        c = self._pending.get(msg.corr)
        if c is None:
            return
        c.offers.extend(msg.offers)
        if c.expected is not None and len(c.offers) >= c.expected:
            c.done.set()

    def _query(self, q: CoordQuery) -> None:
        self.counters["balance_queries"] += 1
        self.counters["balance_query_bytes"] += len(encode_message(q))
        self.port.route(q.target, q)

    def _random_coord(self) -> Coord:
        s = self.config.space
        x, y = self.rng.uniform((s.xmin, s.ymin), (s.xmax, s.ymax))
        return (float(x), float(y))

    async def select(self, load: float, triple: tuple[str, str, str]) -> list[Offer]:
        """The offers of the configured coordinate selection (Sec. V), for a topic of this load and triple."""
        corr = next(self._corr)
        me = self.port.me
        level = self.level
        n = self.params.n_queries
        sel = self.params.selection
        c = _Collect()
        self._pending[corr] = c
        try:
            if sel is Selection.INDCOORD or sel is Selection.BESTLOCAL:
                kind: QueryKind = "indcoord" if sel is Selection.INDCOORD else "bestlocal"
                c.expected = n
                for _ in range(n):
                    self._query(CoordQuery(corr, kind, level, self._random_coord(), me, triple, load))
            elif sel is Selection.BESTREGIONAL:
                for i in range(n):
                    qid = f"{me.id}/{corr}/{i}"
                    ttl = min(self.params.n_hops, MAX_FLOOD_TTL)
                    self._query(CoordQuery(corr, "flood", level, self._random_coord(), me, triple, load, ttl, qid))
            else:  # BESTGLOBAL: flood the whole overlay from here
                qid = f"{me.id}/{corr}"
                q = CoordQuery(corr, "flood", level, me.coord, me, triple, load, MAX_FLOOD_TTL, qid)
                self.counters["balance_queries"] += 1
                self.on_query(q)
            try:
                async with asyncio.timeout(self.config.query_timeout):
                    await c.done.wait()
            except TimeoutError:
                pass  # decide with the answers that came (floods always end here)
            return list(c.offers)
        finally:
            del self._pending[corr]

    # -------------------------------------------------------------------------------------- Alg. 1 and 2

    def place(self, topic: str, done: Callable[[Coord | None], None]) -> None:
        """Alg. 1 for a topic its home is creating: done(coordinate) when a better one than h(t) is found."""

        async def run() -> None:
            coord: Coord | None = None
            try:
                plan = await self.plan_topic(topic, 0.0)
                if plan.verdict == "move" and plan.to is not None:
                    coord = plan.to
                    self.counters["placements"] += 1
            finally:
                done(coord)

        self.tasks.spawn(run(), f"place-{topic}")

    async def plan_topic(self, topic: str, load: float) -> Plan:
        """One decision for one topic: the current coordinate's metric, the offers, and the verdict."""
        coord = self.pubsub.topic_coord(topic)
        assert coord is not None
        triple = self.pubsub.topic_triple(topic)
        current = self.region().without(triple, load).metric(self.level, coord)
        offers = await self.select(load, triple)
        choices = [Choice(o.coord, CoordMetric(o.lmax, o.lmin, o.spare)) for o in offers]
        best = decide(current, choices, self.config.min_gain * current.lmax, self.params.tie_rng(self.rng))
        if best is None:
            return Plan(topic, int(load), "stay", coord, current, len(offers))
        return Plan(topic, int(load), "move", coord, current, len(offers), best.coord, best.metric)

    async def round(self, dry_run: bool = False, all_topics: bool = False) -> list[Plan]:
        """Alg. 2 once: the smallest topic this broker is responsible for, moved if a better coordinate exists.

        With `balance_scan` > 1 the round goes on to the next-smallest topics until one moves (or, in a dry
        run, would move); never more than one topic moves per round.
        dry_run: decide and report, move nothing; all_topics: consider every topic (a dry run's overview).
        """
        self.counters["balance_rounds"] += 1
        sizes = {t: s for t, s in self.pubsub.primary_topics().items() if s > 0}
        plans: list[Plan] = []
        movable = {t: s for t, s in sizes.items() if s <= self.config.max_move_bytes}
        for t, s in sizes.items():
            if s > self.config.max_move_bytes and all_topics:
                plans.append(Plan(t, s, "too large to move this round"))
        chosen = smallest_topics(movable, len(movable) if all_topics else self.params.scan)
        if dry_run and all_topics:  # an overview: every topic's decision at once, nothing moves
            live = [t for t in chosen if self.pubsub.topic_coord(t) is not None]
            plans.extend(await asyncio.gather(*(self.plan_topic(t, float(movable[t])) for t in live)))
            return plans
        for topic in chosen:
            if self.pubsub.topic_coord(topic) is None:
                continue
            plan = await self.plan_topic(topic, float(movable[topic]))
            if plan.verdict == "move" and plan.to is not None and not dry_run:
                self.counters["balance_decisions_move"] += 1
                why = self.pubsub.request_move(topic, plan.to)
                plan = replace(plan, verdict="moving" if why is None else f"not moved: {why}")
                self.log.info("balancing: %s", plan.to_json())
            plans.append(plan)
            if plan.verdict in ("move", "moving"):
                break
        return plans


def _values(rec: NodeLoad) -> tuple[tuple[str, ...], tuple[float, ...]]:
    """What a record says, for comparing with the last report: the failure sums' node ids, and t1, t2 and
    those sums in the ids' order."""
    keys = tuple(sorted(rec.fails))
    return keys, (rec.t1, rec.t2, *(rec.fails[k] for k in keys))


@dataclass(frozen=True, slots=True)
class Plan:
    """One balancing decision for one topic (Alg. 1 or 2): where it is, what was offered, and the verdict.

    verdict: "stay", "move" (a dry run, or Alg. 1), "moving" (Alg. 2 started the move), "not moved: WHY", or
    "too large to move this round" (then only topic, size and verdict are known).
    """

    topic: str
    size: int
    verdict: str
    frm: Coord | None = None  # C(t) now
    current: CoordMetric | None = None  # the metric of staying
    offers: int = 0  # coordinate offers received
    to: Coord | None = None  # the chosen coordinate, if better
    best: CoordMetric | None = None  # its metric

    def to_json(self) -> str:
        """The plan as `sedax balance --json` prints it (one JSON object per plan, in BALANCE_PLANNED)."""
        out: dict[str, object] = {"topic": self.topic, "size": self.size}
        if self.frm is not None and self.current is not None:
            out.update(
                {"from": [self.frm[0], self.frm[1]], "current": _metric_json(self.current), "offers": self.offers}
            )
        out["verdict"] = self.verdict
        if self.to is not None and self.best is not None:
            out.update(to=[self.to[0], self.to[1]], best=_metric_json(self.best))
        return json.dumps(out)


def _metric_json(m: CoordMetric) -> dict[str, float]:
    return {"lmax": m.lmax, "lmin": m.lmin, "spare": m.spare}
