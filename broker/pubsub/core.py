"""What every role of the pub/sub engine shares: settings, the port to the broker, and the topic table.

The roles (access.py, holder.py, replication.py, sync.py, ranks.py, moves.py, home.py, loads.py) each own one
part of the protocol; they share one `TopicTable`: the replicas this broker holds, the store, the counters,
correlation ids, and the helpers every role needs (ranking brokers around a coordinate, replying to an access
broker, marking a topic for the end-of-turn flush).  No role reaches into another's fields; they call each
other's methods.
"""

from __future__ import annotations

import heapq
import math
import secrets
import struct
from collections import deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from itertools import count
from typing import Final, Protocol, TypeVar

from broker.pubsub.replica import Replica, Stage, Transition
from broker.pubsub.settings import SAME_COORD, PubSubConfig
from broker.store import TopicStore
from broker.sweep import Sweep
from overlay.geometry import Coord, NearestNodes, distance, geohash
from overlay.protocol import (
    CORR_SPAN,
    MAX_FRAME_SIZE,
    MAX_LINK_FRAME_SIZE,
    MAX_LONG_LIST_LEN,
    FrameKind,
    Message,
    NodeInfo,
    encode_message,
)
from overlay.pubsub import MAX_BATCH, MAX_BATCH_BYTES, Answer, Deliver, Record, SubRef, TopicReply

_CONTROL_PREFIX: Final = struct.Struct(">IB")
# The sessions one answer of a TOPIC_REPLY names, in bytes: beside a body of up to MAX_FRAME_SIZE (a DELIVER of
# the largest payload) the answer must fit a frame between brokers.  A DELIVER for more sessions of one access
# broker travels as several answers (`session_groups`).  Checked only past SESSIONS_CHECKED sessions, which
# always fit (at most MAX_ID_LEN + 2 bytes each).
SESSION_BYTES: Final = MAX_LINK_FRAME_SIZE - MAX_FRAME_SIZE - (64 << 10)
SESSIONS_CHECKED: Final = 1024
# Coordinates whose ranking TopicTable keeps for the current view (a bound, not a second topic table).
RANKED_CACHE: Final = 100_000
# Replicas a tick takes off the heap of time-outs at most; the rest are looked at by the next ticks (`due`).
# Time-outs of many topics fall due together after a view change (thousands of offers made in one walk, unconfirmed
# while their receiver catches up): re-sent in one tick, they held a broker's loop for 0.4-1.0 s at every beat
# (bench_join.py at 30,000 topics), as long as a neighbour waits before taking it for dead.
DUE_SLICE: Final = 512

T = TypeVar("T")


def control_frame(body: bytes) -> bytes:
    """A CONTROL frame around an already-encoded message (no decode/encode on the fan-out path)."""
    return _CONTROL_PREFIX.pack(len(body) + 1, FrameKind.CONTROL) + body


class Overlay(Protocol):
    """What pub/sub needs from the broker around it."""

    @property
    def me(self) -> NodeInfo:
        """This broker."""
        ...

    def view(self) -> Mapping[str, NodeInfo]:
        """Every live broker this one knows (itself, its neighbours and theirs), by node id: a new mapping
        whenever the view changes, never one changed in place (`TopicTable.ranked` caches by it)."""
        ...

    def route(self, dest: Coord, msg: Message) -> None:
        """Send msg in a ROUTED frame toward dest (handled here if this broker is closest)."""
        ...

    def to_session(self, session: str, frame: bytes, sent: Message | None = None) -> bool:
        """Send a frame to a local client session; False if there is no such session.  `sent` is the message
        the frame carries when the caller has it at hand (the broker's metrics then need not decode it)."""
        ...

    def now(self) -> float:
        """Wall-clock seconds (message timestamps, retention)."""
        ...

    def defer(self, fn: Callable[[], None]) -> None:
        """Run fn once the input at hand is processed (the next loop iteration), to batch its output."""
        ...


def same(a: Coord, b: Coord) -> bool:
    """a and b are the same coordinate (SAME_COORD)."""
    return distance(a, b) < SAME_COORD


def no_event(kind: str, **fields: object) -> None:
    """Events go nowhere unless the broker connects its metrics log."""


def frame_chunks(
    items: Iterable[T], size: Callable[[T], int], most: int = MAX_BATCH, budget: int = MAX_BATCH_BYTES
) -> list[list[T]]:
    """Split items into batches that fit a frame: at most `most` items of at most `budget` bytes by size (an
    item larger than that alone); always at least one (possibly empty) batch."""
    out: list[list[T]] = [[]]
    total = 0
    for x in items:
        n = size(x)
        if out[-1] and (len(out[-1]) >= most or total + n > budget):
            out.append([])
            total = 0
        out[-1].append(x)
        total += n
    return out


def session_groups(sessions: list[str]) -> list[list[str]]:
    """sessions in groups that each fit one answer of a TOPIC_REPLY (SESSION_BYTES, MAX_LONG_LIST_LEN)."""
    return frame_chunks(sessions, _session_size, MAX_LONG_LIST_LEN, SESSION_BYTES)


def _session_size(s: str) -> int:
    return len(s.encode()) + 2  # (msgpack's string header: 1 byte up to 31, 2 up to 255)


def _payload_size(r: Record) -> int:
    return len(r.payload)


def _answer_size(a: Answer) -> int:
    return len(a.body) + sum(len(s) for s in a.sessions)


def chunks(records: list[Record]) -> list[list[Record]]:
    """Split records into batches that fit a frame (by payload size); always at least one batch."""
    n = len(records)
    if n == 1 or (n <= MAX_BATCH and sum([len(r.payload) for r in records]) <= MAX_BATCH_BYTES):
        # What frame_chunks would make of it, one batch, without a call per record (a lone record is a batch
        # of its own whatever its size): nearly every turn's records fit one frame.
        return [list(records)]
    return frame_chunks(records, _payload_size)


class PeerProgress:
    """How far each peer has got through what this broker asked of it: the newest of our correlation ids it
    answered (a REPLICATED, the PULL that answers an OFFER, the REPLICATE that answers a PULL), and when.

    A time-out's re-send (a batch, a back-fill, an offer, a pull; an answer kept open) is for a message lost on
    the way: a route through a broker that had not yet noticed a failure, a link that closed.  A peer that
    answers what was sent to it before the message, and nothing sent after it, has not lost it: it is still
    working through a queue that holds it (links deliver in order).  Re-sending then only lengthens that queue.
    When a broker joined next to 30,000 topics, the new broker's neighbours re-sent ~2,000-9,000 batches and offers
    to it every 5 s for minutes, every one a time-out of something still queued, and spent their loops on that
    (bench_join.py; docs/benchmarks-scale.md).  `behind` tells the roles to wait instead, as TCP does not count
    a segment lost while the acknowledgements of the ones before it are still coming in.

    The offers, back-fills and pulls this broker sends (`asked`: the walk of a view change's, and anti-entropy
    rounds, hand-off offers and take-over pulls too) are counted per peer until it answers one sent at or after
    them; `room` tells the walk how many more a peer may be sent now, as a TCP window bounds what is in flight, so
    a peer's queue holds at most a window of them ahead of a live batch."""

    __slots__ = ("_asked", "_last", "_peers", "_window")

    def __init__(self, window: int) -> None:
        self._peers: dict[str, tuple[int, float]] = {}  # node id -> (newest corr answered, when an answer last came)
        self._last = 0  # the newest corr this broker allocated (a dead life's late answer is ignored)
        # node id -> the walk's requests to it not answered yet, as (corr, when sent), oldest first (`room`); at
        # most a window each: a peer that answers nothing (and stays in the view) is sent anti-entropy rounds and
        # hand-off offers, which do not wait for room, and its queue must not grow with them.
        self._asked: dict[str, deque[tuple[int, float]]] = {}
        self._window = max(1, window)

    def sent(self, corr: int) -> None:
        self._last = corr

    def mark(self) -> int:
        """Where a message sent now stands: everything sent before it went with a lower corr, everything after
        with this one or higher (a message under a corr of its own: that corr)."""
        return self._last + 1

    def answered(self, node: str, corr: int, now: float) -> None:
        """node answered our corr (late answers of an earlier one count as progress, not as a newer position)."""
        if corr > self._last:
            return  # not ours: an answer to this broker's previous life
        had = self._peers.get(node)
        newest = corr if had is None or corr > had[0] else had[0]
        self._peers[node] = (newest, now)
        asked = self._asked.get(node)
        while asked and asked[0][0] <= newest:
            asked.popleft()  # answered, or sent before something answered: taken off node's queue

    def heard(self, node: str) -> bool:
        """node answered something of ours (since it came into the view)."""
        return node in self._peers

    def behind(self, node: str, mark: int, now: float, within: float) -> bool:
        """node answered something of ours sent before `mark` (a `mark()`) within the last `within` seconds, and
        nothing sent at or after it: what was sent there is most likely still queued at node, not lost."""
        had = self._peers.get(node)
        return had is not None and had[0] < mark <= self._last + 1 and now - had[1] <= within

    def asked(self, node: str, corr: int, now: float) -> None:
        """An offer, a back-fill or a pull went to node under corr (`room`)."""
        q = self._asked.get(node)
        if q is None:
            q = self._asked[node] = deque(maxlen=self._window)  # (full: the oldest goes, and there is no room)
        q.append((corr, now))

    def room(self, now: float, within: float) -> int:
        """How many more of the walk's requests the busiest peer may be sent: the window (BULK_WINDOW) less those
        it has not answered.  One unanswered for `within` seconds no longer counts (lost, or the peer is failing:
        the failure detector takes it out of the view, and `forget` its queue)."""
        most = 0
        for q in self._asked.values():
            while q and now - q[0][1] > within:
                q.popleft()
            most = max(most, len(q))
        return self._window - most

    def forget(self, keep: Mapping[str, object]) -> None:
        """Drop the peers not in keep (the view)."""
        self._peers = {n: x for n, x in self._peers.items() if n in keep}
        self._asked = {n: q for n, q in self._asked.items() if n in keep}


class TopicTable:
    """The state the roles share (see the module docstring)."""

    def __init__(self, overlay: Overlay, config: PubSubConfig, store: TopicStore) -> None:
        self.ov = overlay
        self.config = config
        self.store = store
        self.replicas: dict[str, Replica] = {}
        # Replicas with a precise time-out under way (an unconfirmed batch, an offer, a pull, a back-fill, a move),
        # by when the earliest of them is up (`Replica.due_at`): a tick looks at those whose time has come
        # (`due`), the others a slice per tick, each within SWEEP_PERIOD (broker/sweep.py).  Armed where that work
        # starts (`wake`) and again by the tick that looked (`rearm`).  A heap, not a set looked at every tick:
        # while 100,000 topics each had a batch in flight to the secondary, every tick (every 0.05 s) walked them
        # all and held the loop past the links' heartbeats (docs/benchmarks-scale.md).  An entry whose replica was
        # armed earlier since, or dropped, is skipped when it comes up (`_live`).
        self._timeouts: list[tuple[float, int, Replica]] = []
        self._armed = count()
        # When the earliest time-out of a replica's work under way is up: set by the engine from the roles that
        # own the time-outs (replication, sync, moves); math.inf when none is.
        self.deadline: Callable[[Replica], float] = lambda r: math.inf
        # Counts the changes of which topics are held (a replica made or dropped, a delegate list kept or
        # dropped): STATUS sorts the names again only after one (the broker's `held_page`).
        self.held_version = 0
        self._sweep: Sweep[str] = Sweep()
        self._corr = count(1 + secrets.randbelow(CORR_SPAN))  # (CORR_SPAN says why)
        self.peers = PeerProgress(config.bulk_window)
        self._homes: dict[str, Coord] = {}
        # ranked() per coordinate for the current view (`_ranked_nodes`), and that view's nodes by distance.
        self._ranked: dict[Coord, tuple[NodeInfo, ...]] = {}
        self._ranked_view: Mapping[str, NodeInfo] | None = None
        self._nearest: NearestNodes[str] = NearestNodes({})
        # Topics with new work, flushed once per batch of input (one replication, ACK and DELIVER frame carry
        # everything that arrived together); the engine flushes them through `on_flush`.
        self.dirty: dict[str, Replica] = {}
        # Why this broker refuses new messages (its stored messages are over --max-memory: HolderRole
        # check_memory), or "".
        self.full = ""
        self._flush_scheduled = False
        self.on_flush: Callable[[], None] = lambda: None
        # Set by the engine: a reply (sessions, encoded message) for sessions of this broker (the access role
        # hands it to them); no TOPIC_REPLY is built for what never leaves the broker.
        self.on_local_reply: Callable[[Sequence[str], bytes, Message | None], None] = lambda s, body, sent: None
        # Answers for other access brokers, by node id, sent once the input at hand is handled (`flush_replies`):
        # a holder's acknowledgements and deliveries to one access broker travel in one routed frame.
        self._replies: dict[str, tuple[NodeInfo, list[Answer]]] = {}
        self.counters: dict[str, int] = {
            "published": 0,
            "published_bytes": 0,
            "delivered": 0,
            "delivered_bytes": 0,
            "acked": 0,
            "duplicates": 0,
            "takeovers": 0,
            "handovers": 0,
            "replicated_batches": 0,
            "replicated_pipelined": 0,  # batches sent while an earlier one was unconfirmed (REPLICATION_WINDOW)
            "replication_resends": 0,  # time-outs after which the unconfirmed records were sent again
            "replicate_without_meta": 0,  # records-only batches a copy without the topic's meta left unconfirmed
            "lost": 0,
            "moves": 0,
            "moved_bytes": 0,
            "moves_aborted": 0,
            "delegations": 0,
            "forwarded_requests": 0,
            "syncs": 0,  # pulls finished by a new, returning or taking-over primary
            "offers": 0,  # OFFERs sent (retiring, demoted, shutting down, back-fill, anti-entropy)
            "anti_entropy_offers": 0,  # of those, a primary's anti-entropy rounds with its secondary (replication tick)
            "synced_records": 0,  # records another holder lacked, sent by this one (PULL and OFFER answers)
            "reverse_offers": 0,  # a copy offered its primary records the primary did not keep (`_offer_back`)
            "topic_full": 0,  # new subscribers and publishers refused: the topic had max_topic_entries
            "copies_refused": 0,  # copies this broker could not store (its disk full), answered `refused`
            "empty_forgotten": 0,  # replicas of topics with nothing in them, forgotten (holder.sweep_empty)
            "relocations": 0,  # copies a move left behind that followed the topic (ranks `relocate`)
            "coalesced": 0,  # a client's one-message PUBLISH frames handled in one batch with the one before
            "resubscribed": 0,  # local sessions' subscriptions registered again at a topic's new N1 (access)
            "heads": 0,  # HEADS sent to subscribers: publishers gone quiet with their newest seq, or empty (idle)
        }
        # Observability: events for the metrics log (the broker sets PubSub.event; docs/logs.md).
        self.event: Callable[..., None] = no_event

    def hold(self, r: Replica) -> None:
        """r is this broker's replica of its topic from now on (made, or read back from disk)."""
        self.replicas[r.name] = r
        self.held_version += 1

    def wake(self, r: Replica) -> None:
        """r has work with a precise time-out under way: a tick looks at it when the earliest is up (the next tick
        if its time-out cannot be told yet: the work's state is set after the call)."""
        at = self.deadline(r)
        self._arm(r, at if at < math.inf else self.ov.now())

    def _arm(self, r: Replica, at: float) -> None:
        if at < r.due_at:  # (a later time-out waits for the look at the earlier one, which arms it: `rearm`)
            r.due_at = at
            heapq.heappush(self._timeouts, (at, next(self._armed), r))
            if len(self._timeouts) > 2 * len(self.replicas) + 1024:
                self._timeouts = [e for e in self._timeouts if self._live(e)]  # (re-armed earlier, or dropped)
                heapq.heapify(self._timeouts)

    def _live(self, entry: tuple[float, int, Replica]) -> bool:
        at, _, r = entry
        return r.due_at == at and self.replicas.get(r.name) is r

    def due(self, now: float) -> list[Replica]:
        """The replicas the timers look at in this tick: those whose earliest time-out is up, and the sweep's
        next slice.  The tick arms again those still with work under way (`rearm`)."""
        out: dict[str, Replica] = {}
        heap = self._timeouts
        while heap and heap[0][0] <= now and len(out) < DUE_SLICE:
            entry = heapq.heappop(heap)
            if self._live(entry):
                up = entry[2]
                up.due_at = math.inf
                out[up.name] = up
        replicas = self.replicas
        for name in self._sweep.take(replicas, now):
            if (r := replicas.get(name)) is not None:
                out[name] = r
        return list(out.values())

    def look_again(self, r: Replica) -> None:
        """The next tick looks at r (one that `due` returned and this tick left for later)."""
        self._arm(r, self.ov.now())

    def overdue(self, now: float) -> bool:
        """A time-out is up that `due` left for a later tick (DUE_SLICE)."""
        heap = self._timeouts
        return bool(heap) and heap[0][0] <= now

    def rearm(self, looked: Iterable[Replica]) -> None:
        """After the tick's looks: arm each replica looked at for its earliest time-out still under way.  One
        whose time-out cannot be told (nothing the roles time) is left to the sweep's slices."""
        deadline = self.deadline
        for r in looked:
            if r.due_at == math.inf and r.timing_out() and (at := deadline(r)) < math.inf:
                self._arm(r, at)

    def armed(self) -> list[Replica]:
        """The replicas armed for a time-out."""
        return [e[2] for e in self._timeouts if self._live(e)]

    def next_corr(self) -> int:
        corr = next(self._corr)
        self.peers.sent(corr)
        return corr

    def home(self, topic: str) -> Coord:
        """h(t), cached (bounded)."""
        c = self._homes.get(topic)
        if c is None:
            c = geohash(topic)
            if len(self._homes) < 100_000:
                self._homes[topic] = c
        return c

    def closest_id(self, coord: Coord) -> str:
        """The id of N1(coord) among the brokers this one knows (the view always holds this broker)."""
        return self._ranked_nodes(coord)[0].id

    def ranked(self, coord: Coord) -> list[NodeInfo]:
        """N1, N2, N3 of coord (fewer if fewer brokers are known)."""
        return list(self._ranked_nodes(coord))

    def _ranked_nodes(self, coord: Coord) -> tuple[NodeInfo, ...]:
        # Cached per coordinate for the current view: an access broker asks for every request whether it is
        # N1 of the topic's coordinate, a primary ranks its topic's holders on every flush.
        hit = self._ranked.get(coord) if self.ov.view() is self._ranked_view else None
        if hit is None:
            view, nearest = self._view_nearest()
            hit = tuple(view[i] for i in nearest([coord], 3)[0])
            if len(self._ranked) < RANKED_CACHE:
                self._ranked[coord] = hit
        return hit

    def rank_many(self, coords: Iterable[Coord]) -> None:
        """Rank many coordinates for the current view at once, into the cache `_ranked_nodes` reads: a view
        change re-ranks every topic held and every topic this broker's sessions subscribe (NearestNodes)."""
        view, nearest = self._view_nearest()
        ranked = self._ranked
        todo = list(dict.fromkeys(c for c in coords if c not in ranked))[: max(0, RANKED_CACHE - len(ranked))]
        for c, ids in zip(todo, nearest(todo, 3), strict=True):
            ranked[c] = tuple(view[i] for i in ids)

    def _view_nearest(self) -> tuple[Mapping[str, NodeInfo], NearestNodes[str]]:
        """The current view and its NearestNodes; a new view also empties the ranking cache."""
        view = self.ov.view()
        if view is not self._ranked_view:
            self._ranked_view = view
            self._ranked.clear()
            self._nearest = NearestNodes({nid: n.coord for nid, n in view.items()})
        return view, self._nearest

    def rerank(self, r: Replica, rank: int | None = None) -> None:
        """r's rank is this broker's for its coordinate now (or `rank`, already worked out); its bytes count by
        that rank in the store's tallies (what the loads sum).  The one place a replica's rank is set."""
        r.rank = self.rank_of_me(r.coord) if rank is None else rank
        self.store.ranked(r.log, r.rank)

    def rank_of_me(self, coord: Coord) -> int:
        """1, 2 or 3 if this broker is N1, N2 or N3 of coord, else 0."""
        me = self.ov.me.id
        for i, n in enumerate(self._ranked_nodes(coord), start=1):
            if n.id == me:
                return i
        return 0

    def holders(self, coord: Coord, *, without_me: bool = False) -> list[NodeInfo]:
        """The brokers that keep a topic at coord: N1 .. N_resilience (this one left out when it is leaving)."""
        view, nearest = self._view_nearest()
        me = self.ov.me.id
        ids = [i for i in nearest([coord], 4)[0] if not (without_me and i == me)]
        return [view[i] for i in ids[: self.config.resilience]]

    def secondary(self, r: Replica) -> NodeInfo | None:
        """The broker that must hold a copy of r (None at resilience 1 or alone)."""
        if self.config.resilience < 2:
            return None  # no ranking of the view per flush when no copy is kept
        ranked = self._ranked_nodes(r.coord)
        return ranked[1] if len(ranked) > 1 else None

    def mark(self, r: Replica) -> None:
        """r has new work for the end of this turn's input (replicate, acknowledge, deliver)."""
        self.dirty[r.name] = r
        self.schedule()

    def schedule(self) -> None:
        if not self._flush_scheduled:
            self._flush_scheduled = True
            self.ov.defer(self._flush)

    def _flush(self) -> None:
        self._flush_scheduled = False
        self.on_flush()

    def reply(self, access: NodeInfo, sessions: list[str], msg: Message) -> None:
        """Answer sessions at an access broker (here, or routed there)."""
        self.reply_bytes(access, sessions, encode_message(msg), msg)

    def reply_bytes(self, access: NodeInfo, sessions: list[str], body: bytes, sent: Message | None = None) -> None:
        """An encoded answer for sessions at an access broker: handed over at once if that is this broker, else
        gathered with the other answers for it into one TOPIC_REPLY (`flush_replies`: at the end of the routed
        message being handled, or of the turn)."""
        if access.id == self.ov.me.id:
            self.on_local_reply(sessions, body, sent)
            return
        pending = self._replies.get(access.id)
        if pending is None:
            self._replies[access.id] = (access, [Answer(tuple(sessions), body)])
            self.schedule()
        else:
            pending[1].append(Answer(tuple(sessions), body))

    def tell_subscribers(self, subs: Iterable[SubRef], msg: Message) -> None:
        """One message to subscribers, once per access broker (and group of sessions)."""
        body = encode_message(msg)
        for access, sessions in _by_access(subs).values():
            for group in session_groups(sessions):
                self.reply_bytes(access, group, body)

    def flush_replies(self) -> None:
        """Send the answers gathered so far: one TOPIC_REPLY per access broker (and frame-sized chunk), in order."""
        if not self._replies:
            return
        out, self._replies = self._replies, {}
        for access, answers in out.values():
            for batch in frame_chunks(answers, _answer_size):
                self.ov.route(access.coord, TopicReply(access.id, tuple(batch)))

    def drop(self, r: Replica) -> None:
        """Forget r and its data (no longer this broker's to hold)."""
        if self.replicas.get(r.name) is r:
            del self.replicas[r.name]
            self.held_version += 1
            self.store.drop(r.name)
        if r.stage is not Stage.GONE:
            r.enter(Transition.DROP)

    def deliver_to(self, subs: Iterable[SubRef], topic: str, recs: list[Record]) -> None:
        """Deliver records to subscribers, one DELIVER per access broker and chunk."""
        groups = _by_access(subs)
        if not groups or not recs:
            return
        for batch in chunks(recs):
            body = encode_message(Deliver(topic, tuple(batch)))
            size = sum([len(r.payload) for r in batch])
            for access, sessions in groups.values():
                self.counters["delivered"] += len(sessions) * len(batch)
                self.counters["delivered_bytes"] += len(sessions) * size
                if len(sessions) <= SESSIONS_CHECKED:  # (the common case, without a call per delivery)
                    self.reply_bytes(access, sessions, body)
                else:
                    for group in session_groups(sessions):
                        self.reply_bytes(access, group, body)


def _by_access(subs: Iterable[SubRef]) -> dict[str, tuple[NodeInfo, list[str]]]:
    """Subscribers grouped by access broker: node id -> (that broker, its sessions)."""
    groups: dict[str, tuple[NodeInfo, list[str]]] = {}
    for s in subs:
        g = groups.get(s.access.id)
        if g is None:
            groups[s.access.id] = (s.access, [s.session])
        else:
            g[1].append(s.session)
    return groups
