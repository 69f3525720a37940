"""Pub/sub on one broker: the access side for its client sessions and the holder side for its topics.

Access side: a client request (SUBSCRIBE, PUBLISH, ...) is wrapped in a TOPIC_REQUEST and routed to the
topic's coordinate C(t); the answers come back as TOPIC_REPLY routed to this broker's own coordinate.

Holder side: the broker closest to C(t) is the topic's primary (Sec. I-A).  It stores each message, copies
it to the second-closest broker (the secondary) at resilience 2 and 3, acknowledges once both hold it, and
then delivers it to the subscribers.  When the overlay changes, every broker re-ranks itself for the topics
it holds: a secondary that became closest takes over (its copy is complete up to the last acknowledgement)
and re-delivers the last moments, which subscribers de-duplicate by (publisher, seq); a broker that became
closest without holding the topic pulls it from the previous holders before serving (Sec. III-C).

Level 2 versus 3 (Sec. IV-B): after a *failure*, the new secondary receives only new messages at level 2 (its
capacity L2_N has no room for more), but the full history at level 3, so that a second failure loses
nothing.  After a join, a new secondary always receives the full history, since no failure has been spent.

This module is I/O-free: the broker gives it an `Overlay` port (send, route, clock) and calls `tick()`.
"""

from __future__ import annotations

import logging
import struct
from collections.abc import Callable, Collection, Iterable, Mapping
from dataclasses import dataclass, field
from itertools import count
from typing import Final, Protocol

from broker.acl import Acl, refusal
from broker.store import Retention, TopicLog, TopicStore
from overlay.delegation import (
    Activate,
    DelegateUpdate,
    DelegateUpdated,
    Lease,
    Leased,
    MoveTopic,
    NodeLoad,
    Release,
    TertiaryNote,
    TopicMoved,
)
from overlay.geometry import UNIT_SQUARE, Coord, Space, closest, distance, geohash
from overlay.load import failure_sums, l3_additional
from overlay.protocol import FrameKind, Message, NodeInfo, RemoteProtocolError, decode_message, encode_message
from overlay.pubsub import (
    MAX_BATCH,
    MAX_BATCH_BYTES,
    MAX_PAYLOAD_SIZE,
    Ack,
    Delegation,
    Deliver,
    Done,
    Failed,
    Fetch,
    Fetched,
    Locate,
    Located,
    Nack,
    Publish,
    Pull,
    Record,
    Redirect,
    Replicate,
    Replicated,
    SessionGone,
    SubRef,
    Subscribe,
    Subscribed,
    TopicReply,
    TopicRequest,
    Unsubscribe,
    Waiter,
)
from overlay.topics import BadTopic, validate_topic

log = logging.getLogger("sedax.pubsub")

# A replica that has not confirmed a batch in this long is presumed gone; the batch goes to whoever is the
# secondary by then.  Well under a second, so a publisher's acknowledgement is not held up for long.
REPLICATION_TIMEOUT: Final = 0.5
# The re-send time-out doubles while a replica stays silent (a busy machine), up to this.
MAX_RTO: Final = 8.0
# How long a broker that became closest waits for the previous holders to hand a topic over before it
# serves the topic from what it has.
PULL_TIMEOUT: Final = 1.0
# After a take-over the new primary re-delivers what it received in this window before the failure: the
# old primary may have died between replicating and delivering.  Subscribers drop what they already had.
REDELIVER_WINDOW: Final = 2.0
# Timestamps of one topic strictly increase, so "FETCH since ts" never skips a message stored in the same
# clock tick as the one before it.
TS_EPSILON: Final = 1e-6

# How long a primary waits for the new coordinate's holders to confirm a hand-over before it aborts the move
# and keeps serving the topic where it was.
MOVE_TIMEOUT: Final = 5.0
# A former primary forwards requests that still reach it for this long after a move (clients it could not
# redirect, the home's list not yet updated), then forgets the topic.
FORWARD_TTL: Final = 60.0
# A topic that moved is not moved again by the balancer for this long (hysteresis: no ping-pong).
MOVE_COOLDOWN: Final = 10.0
# Coordinates closer than this are the same coordinate (they travel as floats through JSON and msgpack).
SAME_COORD: Final = 1e-12

_CONTROL_PREFIX: Final = struct.Struct(">IB")


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
        """Every live broker this one knows (itself, its neighbours and theirs), by node id."""
        ...

    def route(self, dest: Coord, msg: Message) -> None:
        """Send msg in a ROUTED frame toward dest (handled here if this broker is closest)."""
        ...

    def to_session(self, session: str, frame: bytes) -> bool:
        """Send a frame to a local client session; False if there is no such session."""
        ...

    def now(self) -> float:
        """Wall-clock seconds (message timestamps, retention)."""
        ...

    def defer(self, fn: Callable[[], None]) -> None:
        """Run fn once the input at hand is processed (the next loop iteration), to batch its output."""
        ...


@dataclass(frozen=True, slots=True)
class PubSubConfig:
    """Settings of the pub/sub layer."""

    resilience: int = 2
    retention: Retention = field(default_factory=Retention)
    replication_timeout: float = REPLICATION_TIMEOUT
    pull_timeout: float = PULL_TIMEOUT
    redeliver_window: float = REDELIVER_WINDOW
    move_timeout: float = MOVE_TIMEOUT
    forward_ttl: float = FORWARD_TTL
    move_cooldown: float = MOVE_COOLDOWN
    space: Space = UNIT_SQUARE
    # A tertiary forgets a TERTIARY_NOTE this long after it was sent (primaries repeat theirs every load report
    # interval), so a topic that moved away stops weighing on its former tertiary's L3_N at once.
    note_ttl: float = 4.0
    acl: Acl | None = None  # topic ACL the holder enforces (broker/acl.py); None = everything allowed


@dataclass(slots=True)
class _Waiting:
    record: Record
    access: NodeInfo
    session: str


@dataclass(slots=True)
class _Move:
    """A hand-over in progress at the old primary."""

    corr: int
    to: Coord
    started: float
    reply: tuple[NodeInfo, str, int] | None  # (access, session, corr) of an operator's MOVE_TOPIC
    leased: bool = False
    lease_corr: int = 0
    force: bool = False


@dataclass(slots=True)
class _Staged:
    """A hand-over received at the new primary, waiting for its replica and then for ACTIVATE."""

    origin: NodeInfo
    corr: int
    since: float
    waiters: tuple[Waiter, ...]
    confirmed: bool = False


@dataclass(slots=True)
class _Holder:
    """What the holder side keeps per topic besides the stored data."""

    name: str
    log: TopicLog
    coord: Coord
    home: Coord
    delegates: list[Delegation]
    subscribers: dict[tuple[str, str], SubRef] = field(default_factory=dict)
    rank: int = 0  # 1 primary, 2 secondary, 3 tertiary, 0 none
    replica: str | None = None  # the secondary that holds everything up to the last confirmed batch
    backfill: bool = True  # the next batch to the secondary must carry the whole history
    last_ts: float = 0.0
    outbox: list[Record] = field(default_factory=list)  # stored, not yet sent to the secondary
    waiting: list[_Waiting] = field(default_factory=list)  # stored, not yet acknowledged to the publisher
    # Indexes over `waiting` so a re-sent message costs O(1): the lowest waiting seq per publisher, and the
    # highest seq each (access, session, publisher) already waits for (a cumulative ACK will cover it).
    first_waiting: dict[str, int] = field(default_factory=dict)
    waiter_max: dict[tuple[str, str, str], int] = field(default_factory=dict)
    undelivered: list[Record] = field(default_factory=list)  # stored, waiting for the replica before delivery
    inflight: tuple[int, str, float, float] | None = None  # (corr, target id, sent at, last ts in the batch)
    sent: dict[int, tuple[str, float]] = field(default_factory=dict)  # corr -> (target, last ts), unconfirmed
    rto: float = REPLICATION_TIMEOUT  # current re-send timeout; doubles while the replica stays silent
    pulling: dict[int, str] = field(default_factory=dict)  # pull corr -> asked node id
    pull_started: float = 0.0
    pull_retried: bool = False  # the unanswered pulls went out once more
    queued: list[tuple[NodeInfo, str, Message]] = field(default_factory=list)  # requests held during a pull
    meta_dirty: bool = False  # subscribers changed: the secondary needs the new list
    takeover: bool = False  # became primary by a failure; re-deliver once the other holders answered
    moving: _Move | None = None  # old primary: hand-over in progress, requests wait
    staged: _Staged | None = None  # new primary: hand-over received, not yet active
    placing: bool = False  # home: choosing the topic's first coordinate (Alg. 1), requests wait
    moved_at: float = 0.0


class PubSub:
    """The pub/sub layer of one broker (see the module docstring)."""

    def __init__(self, overlay: Overlay, config: PubSubConfig | None = None) -> None:
        self.ov = overlay
        self.config = config or PubSubConfig()
        self.store = TopicStore(self.config.retention)
        self._holders: dict[str, _Holder] = {}
        self._corr = count(1)
        self._session_topics: dict[str, set[str]] = {}  # access side: what each local session subscribed
        self.coords: dict[str, Coord] = {}  # access side: C(t) of topics, learned from answers
        # Requests for remote primaries and topics with new work, flushed once per batch of input: one
        # TOPIC_REQUEST, one replication, one ACK and one DELIVER frame carry everything that arrived together.
        self._outgoing: dict[tuple[Coord, str], list[bytes]] = {}
        self._dirty: dict[str, _Holder] = {}
        self._flush_scheduled = False
        self._valid_topics: set[str] = set()
        self._homes: dict[str, Coord] = {}
        # Home role (Sec. III-A): delegate lists of topics whose home this broker is (or the home's secondary).
        self.delegate_lists: dict[str, list[Delegation]] = {}
        self._last_move: dict[str, float] = {}  # home: when each topic last moved (cool-down)
        self._leases: dict[str, tuple[float, str]] = {}  # home: topic -> (expiry, leaseholder id)
        self._forward: dict[str, tuple[Coord, float]] = {}  # former primary: topic -> (new coordinate, until)
        self._dl_unconfirmed: dict[int, tuple[str, tuple[Delegation, ...], float]] = {}  # corr -> (topic, list, sent)
        self._t3notes: dict[str, tuple[str, str, float, float]] = {}  # tertiary: topic -> (N1, N2, size, until)
        self._lease_waits: dict[int, str] = {}  # lease corr -> topic
        # Set by the broker: Alg. 1 placement of a new topic (topic, done callback with the chosen coordinate or
        # None).
        self.placer: Callable[[str, Callable[[Coord | None], None]], None] | None = None
        # Access side: who each local session authenticated as; sent along in TOPIC_REQUEST for the holder's ACL.
        self.identities: dict[str, str] = {}
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
            "lost": 0,
            "moves": 0,
            "moved_bytes": 0,
            "moves_aborted": 0,
            "delegations": 0,
            "forwarded_requests": 0,
        }
        # Observability: events for the metrics log (the broker sets Broker.event; docs/logs.md).
        self.event: Callable[..., None] = _no_event

    # ================================================================ access side (local client sessions)
    def client_message(self, session: str, msg: Message) -> None:
        """A message from a client attached to this broker."""
        match msg:
            case Publish():
                if refusal := self._check_publish(msg):
                    self._to_local(session, refusal)
                    return
            case Subscribe() | Unsubscribe() | Fetch() | Locate() | MoveTopic():
                try:
                    validate_topic(msg.topic)
                except BadTopic as exc:
                    self._to_local(session, Failed(msg.corr, msg.topic, "bad_topic", str(exc)))
                    return
                if isinstance(msg, MoveTopic) and not self.config.space.contains(msg.to):
                    s = self.config.space
                    text = (
                        f"({msg.to[0]}, {msg.to[1]}) is outside the space [{s.xmin}, {s.xmax}] x [{s.ymin}, {s.ymax}]"
                    )
                    self._to_local(session, Failed(msg.corr, msg.topic, "bad_request", text))
                    return
                if isinstance(msg, Subscribe):
                    topics = self._session_topics.setdefault(session, set())
                    if msg.topic in topics:
                        self._to_local(
                            session,
                            Failed(
                                msg.corr,
                                msg.topic,
                                "already_subscribed",
                                f"this session is already subscribed to {msg.topic!r}; unsubscribe first",
                            ),
                        )
                        return
                    topics.add(msg.topic)
                elif isinstance(msg, Unsubscribe):
                    self._session_topics.get(session, set()).discard(msg.topic)
            case _:
                raise RemoteProtocolError(f"{msg.op} is not a client request")
        self._send_request(msg.topic, session, msg)

    def _check_publish(self, msg: Publish) -> Nack | None:
        """The refusal of a malformed PUBLISH: the whole batch at its start, or at its first oversized payload."""
        if msg.topic not in self._valid_topics:
            try:
                validate_topic(msg.topic)
            except BadTopic as exc:
                return Nack(msg.topic, msg.publisher, msg.seq, "bad_topic", str(exc))
            if len(self._valid_topics) < 100_000:  # a cache, not a second topic table
                self._valid_topics.add(msg.topic)
        if (i := msg.oversized(MAX_PAYLOAD_SIZE)) is not None:
            size = len(msg.payloads()[i])
            text = f"payload of seq {msg.seq + i} is {size} bytes, over the limit of {MAX_PAYLOAD_SIZE}"
            return Nack(msg.topic, msg.publisher, msg.seq + i, "too_large", text)
        return None

    def _send_request(self, topic: str, session: str, msg: Message) -> None:
        coord = self.coords.get(topic) or self._home(topic)
        me = self.ov.me
        h = self._holders.get(topic)
        if (h.rank == 1 and h.coord == coord) if h is not None else self._closest_id(coord) == me.id:
            self._handle_request(me, session, msg, coord, identity=self.identities.get(session, ""))  # 0 hops
        else:
            self._outgoing.setdefault((coord, session), []).append(encode_message(msg))
            self._schedule()

    def _schedule(self) -> None:
        if not self._flush_scheduled:
            self._flush_scheduled = True
            self.ov.defer(self._flush_batch)

    def _flush_batch(self) -> None:
        self._flush_scheduled = False
        out, self._outgoing = self._outgoing, {}
        me = self.ov.me
        for (coord, session), reqs in out.items():
            for chunk in _byte_chunks(reqs):
                self.ov.route(
                    coord,
                    TopicRequest(me, session, tuple(chunk), dest=coord, identity=self.identities.get(session, "")),
                )
        dirty, self._dirty = self._dirty, {}
        for h in dirty.values():
            self._flush(h)

    def _home(self, topic: str) -> Coord:
        c = self._homes.get(topic)
        if c is None:
            c = geohash(topic)
            if len(self._homes) < 100_000:  # a cache of h(t), bounded
                self._homes[topic] = c
        return c

    def _mark(self, h: _Holder) -> None:
        self._dirty[h.name] = h
        self._schedule()

    def session_closed(self, session: str) -> None:
        """A local client went away: end its subscriptions at the topics' primaries."""
        for topic in self._session_topics.pop(session, set()):
            self._send_request(topic, session, Unsubscribe(0, topic))
        self.identities.pop(session, None)

    def subscriptions(self, session: str) -> int:
        """How many topics a local session is subscribed to."""
        return len(self._session_topics.get(session, ()))

    def _to_local(self, session: str, msg: Message) -> None:
        self.ov.to_session(session, control_frame(encode_message(msg)))

    def _reply_arrived(self, rep: TopicReply) -> None:
        me = self.ov.me
        if rep.access != me.id:
            # The access broker the reply was for is gone and this broker is now closest to its coordinate.
            self._sessions_gone(rep.sessions, rep.reply)
            return
        frame = control_frame(rep.reply)
        missing = [s for s in rep.sessions if not self.ov.to_session(s, frame)]
        if missing:
            self._sessions_gone(missing, rep.reply)

    def _sessions_gone(self, sessions: Iterable[str], reply: bytes) -> None:
        try:
            msg = decode_message(reply)
        except RemoteProtocolError:
            return
        if isinstance(msg, Deliver):
            coord = self.coords.get(msg.topic) or geohash(msg.topic)
            for s in sessions:
                self.ov.route(coord, SessionGone(msg.topic, self.ov.me.id, s))

    # ====================================================================== routed messages for this node
    def routed(self, msg: Message) -> bool:
        """A ROUTED message that reached this broker (closest to its destination); False if not pub/sub."""
        match msg:
            case TopicRequest():
                for raw in msg.requests:
                    try:
                        inner = decode_message(raw)
                    except RemoteProtocolError as exc:
                        log.warning("dropping a topic request with a bad inner message: %s", exc)
                        continue
                    self._handle_request(msg.access, msg.session, inner, msg.dest, msg.via_home, msg.identity)
            case TopicReply():
                self._reply_arrived(msg)
            case Replicate():
                self._replicate_arrived(msg)
            case Replicated():
                self._replicated_arrived(msg)
            case Pull():
                self._pull_arrived(msg)
            case Lease():
                self._lease_arrived(msg)
            case Leased():
                self._leased_arrived(msg)
            case Activate():
                self._activate_arrived(msg)
            case Release():
                self._t3notes.pop(msg.topic, None)
                h = self._holders.get(msg.topic)
                if h is not None and _same(h.coord, msg.coord) and h.moving is None and (h.rank != 1 or h.staged):
                    if h.staged is not None:
                        self._drop_staged(h)
                    else:
                        self._drop(h)
            case DelegateUpdate():
                self._delegate_update_arrived(msg)
            case DelegateUpdated():
                self._dl_unconfirmed.pop(msg.corr, None)
            case TopicMoved():
                self._topic_moved_arrived(msg)
            case TertiaryNote():
                until = self.ov.now() + self.config.note_ttl
                for (topic, n1, n2), size in zip(msg.pairs, msg.sizes, strict=True):
                    self._t3notes[topic] = (n1, n2, size, until)
            case SessionGone():
                h = self._holders.get(msg.topic)
                if h is not None and h.subscribers.pop((msg.access, msg.session), None) is not None:
                    h.meta_dirty = True
                    self._mark(h)
            case _:
                return False
        return True

    # ========================================================================================= holder side
    def _closest_id(self, coord: Coord, k: int = 1) -> str:
        return closest({nid: n.coord for nid, n in self.ov.view().items()}, coord, k)[k - 1]

    def _ranked(self, coord: Coord) -> list[NodeInfo]:
        view = self.ov.view()
        ids = closest({nid: n.coord for nid, n in view.items()}, coord, 3)
        return [view[i] for i in ids]

    def _rank_of_me(self, coord: Coord) -> int:
        me = self.ov.me.id
        for i, n in enumerate(self._ranked(coord), start=1):
            if n.id == me:
                return i
        return 0

    def _secondary(self, h: _Holder) -> NodeInfo | None:
        ranked = self._ranked(h.coord)
        return ranked[1] if len(ranked) > 1 and self.config.resilience >= 2 else None

    def _holder(self, topic: str, coord: Coord | None = None) -> _Holder:
        h = self._holders.get(topic)
        if h is None:
            home = self._home(topic)
            at = coord if coord is not None else home
            dl = self.delegate_lists.get(topic)
            h = _Holder(topic, self.store.ensure(topic), at, home, list(dl) if dl else [Delegation(home, 0.0)])
            h.rank = self._rank_of_me(h.coord)
            self._holders[topic] = h
        return h

    def _handle_request(
        self,
        access: NodeInfo,
        session: str,
        req: Message,
        dest: Coord | None = None,
        via_home: bool = False,
        identity: str = "",
    ) -> None:
        topic = getattr(req, "topic", None)
        if not isinstance(topic, str):
            log.warning("dropping a topic request without a topic: %s", req.op)
            return
        # The first holder enforces the ACL, whatever the access broker did; requests it forwards (home to
        # delegate, old primary to new) travel between authenticated brokers and are not checked again.
        acl = None if via_home else self.config.acl
        if acl is not None and (denied := refusal(acl, identity, req, "holder")) is not None:
            self._reply(access, [session], denied)
            return
        h = self._holders.get(topic)
        if h is not None and (h.pulling or h.moving or h.staged or h.placing):
            h.queued.append((access, session, req))  # served once the hand-over, pull or placement is done
            return
        if h is not None and h.rank == 1:
            if dest is not None and not _same(dest, h.coord):
                self._redirect(access, [session], topic, h.coord)
            self._serve(h, access, session, req)
            return
        home = self._home(topic)
        me_home = self._closest_id(home) == self.ov.me.id
        dl = self.delegate_lists.get(topic)
        if me_home and dl and not _same(dl[-1].coord, home) and self._closest_id(dl[-1].coord) != self.ov.me.id:
            # Sec. III-B: the home forwards to the delegate coordinate C(t) and the client learns it.
            self._forward_request(access, session, req, dl[-1].coord, via_home=True)
            return
        fwd = self._forward.get(topic)
        if fwd is not None:
            self._forward_request(access, session, req, fwd[0], via_home=True)
            return
        if not me_home and not via_home and dest is not None and not _same(dest, home):
            # Addressed to a delegate coordinate whose holders are gone or never were: the home knows.
            self._forward_request(access, session, req, home, via_home=False, identity=identity)
            return
        at = dest if (via_home and dest is not None and not me_home) else home
        h = self._holder(topic, at)
        if self._start_pull(h):
            h.queued.append((access, session, req))  # served once the previous holders answered
            return
        if isinstance(req, (Publish, Subscribe)) and self._maybe_place(h):
            h.queued.append((access, session, req))  # a new topic: Alg. 1 decides where it lives first
            return
        self._serve(h, access, session, req)

    def _forward_request(
        self, access: NodeInfo, session: str, req: Message, coord: Coord, *, via_home: bool, identity: str = ""
    ) -> None:
        self.counters["forwarded_requests"] += 1
        msg = TopicRequest(access, session, (encode_message(req),), via_home=via_home, dest=coord, identity=identity)
        self.ov.route(coord, msg)
        if via_home:
            self._redirect(access, [session], getattr(req, "topic", ""), coord)

    def _redirect(self, access: NodeInfo, sessions: list[str], topic: str, coord: Coord) -> None:
        msg = TopicMoved(access.id, tuple(sessions), topic, coord)
        if access.id == self.ov.me.id:
            self._topic_moved_arrived(msg)
        else:
            self.ov.route(access.coord, msg)

    def _topic_moved_arrived(self, m: TopicMoved) -> None:
        """Access side: address the topic's later requests to its new coordinate and tell the sessions."""
        if m.access != self.ov.me.id:
            return
        if _same(m.coord, self._home(m.topic)):
            self.coords.pop(m.topic, None)
        elif len(self.coords) < 100_000 or m.topic in self.coords:
            self.coords[m.topic] = m.coord
        frame = control_frame(encode_message(Redirect(m.topic, m.coord)))
        for s in m.sessions:
            self.ov.to_session(s, frame)

    def _maybe_place(self, h: _Holder) -> bool:
        """Alg. 1: a topic created at its home gets the best coordinate the selection finds (Sec. VI-A)."""
        if self.placer is None or not _same(h.coord, h.home) or h.rank != 1:
            return False
        if h.log.rows or h.log.last_seq or h.subscribers or h.name in self.delegate_lists:
            return False
        h.placing = True
        topic = h.name

        def placed(coord: Coord | None) -> None:
            cur = self._holders.get(topic)
            if cur is not h:
                return
            h.placing = False
            if coord is None or _same(coord, h.coord) or self._closest_id(coord) == self.ov.me.id:
                self._release_queue(h)
                return
            now = self.ov.now()
            dl = [Delegation(h.home, 0.0), Delegation(coord, now)]
            self._set_delegates(topic, dl)
            self.counters["delegations"] += 1
            self.event("delegation", topic=topic, load=0.0, frm=h.home, to=coord)
            queued, h.queued = h.queued, []
            self._drop(h)
            for access, session, req in queued:
                self._forward_request(access, session, req, coord, via_home=True)

        self.placer(topic, placed)
        return True

    def _release_queue(self, h: _Holder) -> None:
        queued, h.queued = h.queued, []
        for access, session, req in queued:
            if self._holders.get(h.name) is h and h.rank == 1 and not (h.moving or h.staged or h.placing):
                self._serve(h, access, session, req)
            else:
                self._handle_request(access, session, req, h.coord, True)

    def _drop(self, h: _Holder) -> None:
        if self._holders.get(h.name) is h:
            del self._holders[h.name]
            self.store.drop(h.name)

    def _serve(self, h: _Holder, access: NodeInfo, session: str, req: Message) -> None:
        match req:
            case Publish():
                self._publish(h, access, session, req)
            case Subscribe():
                key = (access.id, session)
                h.subscribers[key] = SubRef(access, session)
                h.meta_dirty = True
                if req.since is not None:
                    self._deliver_to([SubRef(access, session)], h.name, list(h.log.since(req.since)))
                self._reply(access, [session], Subscribed(req.corr, h.name, h.coord))
                self._mark(h)
            case Unsubscribe():
                if h.subscribers.pop((access.id, session), None) is None:
                    if req.corr:
                        self._reply(
                            access,
                            [session],
                            Failed(req.corr, h.name, "not_subscribed", f"not subscribed to {h.name!r}"),
                        )
                    return
                h.meta_dirty = True
                if req.corr:
                    self._reply(access, [session], Done(req.corr))
                self._mark(h)
            case Fetch():
                if not h.log.rows and not h.log.last_seq and not h.subscribers:
                    self._forget_if_empty(h)
                    self._reply(
                        access,
                        [session],
                        Failed(req.corr, h.name, "unknown_topic", f"no broker holds messages of {h.name!r}"),
                    )
                    return
                recs = h.log.since(req.since, req.limit + 1)
                more = len(recs) > req.limit
                out: list[Record] = []
                size = 0
                for m in recs[: req.limit]:
                    size += len(m.payload)
                    if out and size > MAX_BATCH_BYTES:
                        more = True
                        break
                    out.append(m)
                self._reply(access, [session], Fetched(req.corr, h.name, tuple(out), more))
            case MoveTopic():
                self.request_move(h.name, req.to, reply=(access, session, req.corr), force=True)
            case Locate():
                ranked = self._ranked(h.coord)
                self._reply(
                    access,
                    [session],
                    Located(
                        req.corr,
                        h.name,
                        h.home,
                        h.coord,
                        ranked[0],
                        ranked[1] if len(ranked) > 1 else None,
                        ranked[2] if len(ranked) > 2 and self.config.resilience >= 3 else None,
                        tuple(self.delegate_lists.get(h.name) or h.delegates),
                        h.log.size,
                        len(h.subscribers),
                    ),
                )
                self._forget_if_empty(h)
            case _:
                log.warning("dropping unexpected topic request %s", req.op)

    def _forget_if_empty(self, h: _Holder) -> None:
        # A FETCH or LOCATE of a topic nobody published to must not create state that lingers.
        if not h.log.rows and not h.log.last_seq and not h.subscribers and not h.waiting:
            self._holders.pop(h.name, None)
            self.store.drop(h.name)

    def _publish(self, h: _Holder, access: NodeInfo, session: str, p: Publish) -> None:
        # A local client's publish was checked on arrival (client_message); one from another access broker
        # is checked here, once.
        if access.id != self.ov.me.id and (refusal := self._check_publish(p)):
            self._reply(access, [session], refusal)
            return
        seq = p.seq
        for payload in p.payloads():
            if not self._publish_one(h, access, session, p.publisher, seq, payload, p.base):
                break  # out of order: the publisher re-sends from the expected number, the rest with it
            seq += 1

    def _publish_one(
        self, h: _Holder, access: NodeInfo, session: str, publisher: str, seq: int, payload: bytes, base: int
    ) -> bool:
        """Store one message (or re-acknowledge a duplicate); False if it is out of order."""
        last = h.log.last_seq.get(publisher, -1)
        if seq <= last:
            # A re-send (its acknowledgement was lost, or it is still on its way to the replica).
            self.counters["duplicates"] += 1
            first = h.first_waiting.get(publisher)
            if first is None or seq < first:
                self._reply(access, [session], Ack(h.name, publisher, seq, 0.0))  # stored and safe already
                return True
            key = (access.id, session, publisher)
            if h.waiter_max.get(key, -1) < seq:  # a new asker (e.g. after a reconnect): answer with the batch
                self._wait(h, Record(h.last_ts, publisher, seq, b""), access, session)
            return True
        if seq > last + 1 and base > last + 1:
            # The publisher had [last + 1, base) acknowledged, yet this broker never got them: they were lost
            # with a failed broker (resilience level 1, or more failures than the level survives).  Count and
            # log the loss, then continue the sequence after it so subscribers see the gap.
            lost = base - last - 1
            self.counters["lost"] += lost
            log.warning(
                "topic %s: %d acknowledged message(s) of publisher %s before seq %d are lost", h.name, lost,
                publisher, base,
            )  # fmt: skip
            last = base - 1
            h.log.last_seq[publisher] = last
        if seq > last + 1:
            # Earlier messages are still on their way or were dropped in a failover: the publisher has them.
            self._reply(
                access,
                [session],
                Nack(h.name, publisher, seq, "out_of_order", f"expected seq {last + 1} first", last + 1),
            )
            return False
        now = self.ov.now()
        ts = max(now, h.last_ts + TS_EPSILON)
        h.last_ts = ts
        rec = Record(ts, publisher, seq, payload)
        h.log.append(rec, now)
        self.counters["published"] += 1
        self.counters["published_bytes"] += len(payload)
        self._wait(h, rec, access, session)
        h.undelivered.append(rec)
        h.outbox.append(rec)
        self._mark(h)
        return True

    @staticmethod
    def _wait(h: _Holder, rec: Record, access: NodeInfo, session: str) -> None:
        h.waiting.append(_Waiting(rec, access, session))
        h.first_waiting.setdefault(rec.publisher, rec.seq)
        key = (access.id, session, rec.publisher)
        h.waiter_max[key] = max(h.waiter_max.get(key, -1), rec.seq)

    # ---- replication ---------------------------------------------------------------------------------
    def _flush(self, h: _Holder) -> None:
        """Send the next batch to the secondary, or acknowledge and deliver when no copy is required."""
        if h.rank != 1 or h.pulling or h.moving:
            return  # while pulling, _pull_progress flushes once the other holders have answered
        sec = self._secondary(h)
        if sec is None:
            h.outbox.clear()
            h.meta_dirty = False
            h.backfill = False
            self._commit(h, float("inf"))
            self._staged_ready(h)
            return
        if h.inflight is not None:
            return
        if not h.outbox and not h.meta_dirty and h.replica == sec.id and not h.backfill:
            return
        if h.replica != sec.id:
            h.replica = None
        # A back-fill replaces whatever the secondary had with the whole history; otherwise it merges.
        full = h.backfill
        records = h.log.records() if full else list(h.outbox)
        batches = _chunks(records)
        corr = 0
        for i, batch in enumerate(batches):
            corr = next(self._corr)
            self.ov.route(
                sec.coord,
                Replicate(
                    corr,
                    h.name,
                    h.coord,
                    self.ov.me,
                    tuple(batch),
                    tuple(h.subscribers.values()),
                    tuple(h.delegates),
                    full and i == 0,
                    dict(h.log.last_seq),
                ),
            )
        upto = h.waiting[-1].record.ts if h.waiting else h.last_ts
        h.inflight = (corr, sec.id, self.ov.now(), upto)
        h.sent[corr] = (sec.id, upto)
        if len(h.sent) > 64:  # confirmations that never came; the newest re-send supersedes them
            for old in sorted(h.sent)[:-64]:
                del h.sent[old]
        h.outbox.clear()
        h.meta_dirty = False
        self.counters["replicated_batches"] += 1

    def _replicated_arrived(self, r: Replicated) -> None:
        h = self._holders.get(r.topic)
        if h is None:
            return
        if r.corr in h.pulling:
            del h.pulling[r.corr]  # the asked node holds nothing of it
            self._pull_progress(h)
            return
        if h.moving is not None:
            if r.corr == h.moving.corr and h.moving.leased:
                self._move_confirmed(h)
            return  # replica confirmations wait: an aborted move re-copies everything to the secondary
        entry = h.sent.pop(r.corr, None)
        if entry is None or entry[0] != r.node:
            return  # not ours, or from a node we no longer replicate to
        target, upto = entry
        # Any confirmation counts, also of an earlier batch that was re-sent after a time-out: under load a
        # reply slower than the time-out must not make the primary re-send forever.
        for c in [c for c, (t, u) in h.sent.items() if t == target and u <= upto]:
            del h.sent[c]
        if h.inflight is not None and h.inflight[3] <= upto:
            h.inflight = None
        h.replica = target
        h.backfill = False
        h.rto = self.config.replication_timeout
        self._commit(h, upto)
        self._staged_ready(h)
        self._flush(h)

    def _commit(self, h: _Holder, upto: float) -> None:
        """Messages stored up to timestamp upto are safe: acknowledge them, then deliver in order."""
        if h.staged is not None or h.moving is not None:
            return  # a hand-over in progress: one node acknowledges and delivers, the one that ends up primary
        done = [w for w in h.waiting if w.record.ts <= upto]
        if not done:
            return
        h.waiting = [w for w in h.waiting if w.record.ts > upto]
        h.first_waiting.clear()
        h.waiter_max.clear()
        for w in h.waiting:
            h.first_waiting.setdefault(w.record.publisher, w.record.seq)
            key = (w.access.id, w.session, w.record.publisher)
            h.waiter_max[key] = max(h.waiter_max.get(key, -1), w.record.seq)
        upto = max(w.record.ts for w in done)
        # ACK is cumulative per publisher: one answers everything a session published in this batch.
        last: dict[tuple[str, str, str], tuple[_Waiting, Record]] = {}
        for w in done:
            key = (w.access.id, w.session, w.record.publisher)
            if key not in last or w.record.seq > last[key][1].seq:
                last[key] = (w, w.record)
        for w, rec in last.values():
            self._reply(w.access, [w.session], Ack(h.name, rec.publisher, rec.seq, rec.ts))
        self.counters["acked"] += len(done)
        deliver = [r for r in h.undelivered if r.ts <= upto]
        h.undelivered = [r for r in h.undelivered if r.ts > upto]
        self._deliver_to(h.subscribers.values(), h.name, deliver)

    def _deliver_to(self, subs: Iterable[SubRef], topic: str, recs: list[Record]) -> None:
        groups: dict[str, tuple[NodeInfo, list[str]]] = {}
        for s in subs:
            groups.setdefault(s.access.id, (s.access, []))[1].append(s.session)
        if not groups or not recs:
            return
        for batch in _chunks(recs):
            body = encode_message(Deliver(topic, tuple(batch)))
            size = sum(len(r.payload) for r in batch)
            for access, sessions in groups.values():
                self.counters["delivered"] += len(sessions) * len(batch)
                self.counters["delivered_bytes"] += len(sessions) * size
                self._reply_bytes(access, sessions, body)

    def _reply(self, access: NodeInfo, sessions: list[str], msg: Message) -> None:
        self._reply_bytes(access, sessions, encode_message(msg))

    def _reply_bytes(self, access: NodeInfo, sessions: list[str], body: bytes) -> None:
        if access.id == self.ov.me.id:
            self._reply_arrived(TopicReply(access.id, tuple(sessions), body))
        else:
            self.ov.route(access.coord, TopicReply(access.id, tuple(sessions), body))

    def _replicate_arrived(self, r: Replicate) -> None:
        now = self.ov.now()
        if r.handover:
            self._handover_arrived(r, now)
            return
        h = self._holders.get(r.topic)
        if h is not None and h.moving is not None:
            # The topic's new primary picked this node as its secondary while the move is under way: this node
            # already holds everything it is sent, and becomes the replica when the move completes.
            if r.corr:
                self.ov.route(r.origin.coord, Replicated(r.corr, r.topic, self.ov.me.id))
            return
        if h is not None and h.pulling and r.corr in h.pulling and not _same(r.coord, h.coord):
            # The asked node knows the topic at another coordinate: a delegate list, not data for us.
            self._learn_delegates(r.topic, list(r.delegates))
            del h.pulling[r.corr]
            self._pull_progress(h)
            return
        h = self._holder(r.topic, r.coord)
        if r.full and r.corr not in h.pulling and h.rank != 1:
            h.log.clear()
        h.log.merge(r.records, now)
        for pub, seq in r.last_seq.items():
            if seq > h.log.last_seq.get(pub, -1):
                h.log.last_seq[pub] = seq
                h.log.last_seen[pub] = now
        if (newest := h.log.last_ts) is not None:
            h.last_ts = max(h.last_ts, newest)
        subs = {(s.access.id, s.session): s for s in r.subscribers}
        if h.rank == 1:
            h.subscribers.update(subs)  # handed over to us: keep what we had as well
        else:
            h.subscribers = subs
        h.coord = r.coord
        h.delegates = list(r.delegates)
        h.rank = self._rank_of_me(h.coord)
        if r.corr in h.pulling:
            del h.pulling[r.corr]
            self._pull_progress(h)
            return
        if r.corr:  # 0: a leading chunk of a multi-frame copy; the last one carries the corr to confirm
            self.ov.route(r.origin.coord, Replicated(r.corr, r.topic, self.ov.me.id))

    # ---- pulling a topic from its previous holders (Sec. III-C) ----------------------------------------
    def _start_pull(self, h: _Holder) -> bool:
        if h.rank != 1:
            return False
        others = self._ranked(h.coord)[1:]
        if not others:
            return False
        h.pull_started = self.ov.now()
        h.pull_retried = False
        for n in others:
            corr = next(self._corr)
            h.pulling[corr] = n.id
            self.ov.route(n.coord, Pull(corr, h.name, h.coord, self.ov.me))
        return True

    def _pull_arrived(self, p: Pull) -> None:
        h = self._holders.get(p.topic)
        dl = self.delegate_lists.get(p.topic)
        if (h is None or not _same(h.coord, p.coord)) and dl:
            me = self.ov.me
            self.ov.route(p.origin.coord, Replicate(p.corr, p.topic, dl[-1].coord, me, (), (), tuple(dl), False, {}))
            return
        if h is None or (not h.log.rows and not h.subscribers and not h.log.last_seq):
            self.ov.route(p.origin.coord, Replicated(p.corr, p.topic, self.ov.me.id))
            return
        batches = _chunks(h.log.records())
        for i, batch in enumerate(batches):
            last = i == len(batches) - 1
            self.ov.route(
                p.origin.coord,
                Replicate(
                    p.corr if last else 0,
                    h.name,
                    h.coord,
                    self.ov.me,
                    tuple(batch),
                    tuple(h.subscribers.values()),
                    tuple(h.delegates),
                    False,
                    dict(h.log.last_seq),
                ),
            )
        self.counters["handovers"] += 1

    def _pull_progress(self, h: _Holder) -> None:
        if h.pulling:
            return
        dl = self.delegate_lists.get(h.name)
        if dl and not _same(dl[-1].coord, h.coord) and not h.log.rows and not h.subscribers:
            # This broker became the home of a topic that lives at a delegate coordinate: forward, hold nothing.
            queued, h.queued = h.queued, []
            self._drop(h)
            for access, session, req in queued:
                self._forward_request(access, session, req, dl[-1].coord, via_home=True)
            return
        took_over, h.takeover = h.takeover, False
        if took_over:
            self._redeliver(h)
        elif any(isinstance(r, (Publish, Subscribe)) for _, _, r in h.queued) and self._maybe_place(h):
            return  # a new topic: Alg. 1 decides where it lives; requests wait for it
        queued, h.queued = h.queued, []
        for access, session, req in queued:
            self._serve(h, access, session, req)
        if h.name in self._holders:  # not forgotten as empty by a FETCH/LOCATE
            if not took_over:
                h.backfill = True  # a join made us primary: the secondary gets everything we now hold
            self._flush(h)  # after a take-over, view_changed decided whether the history is copied

    # ---- moving a topic (Sec. III, overlay.delegation) ------------------------------------------------------
    def request_move(
        self, topic: str, to: Coord, reply: tuple[NodeInfo, str, int] | None = None, force: bool = False
    ) -> str | None:
        """Start moving a topic this broker is the primary of to coordinate `to`.

        Returns None once the move is under way, or why it cannot start.  The home grants a lease first
        (one move per topic at a time, a cool-down unless forced); see overlay.delegation for the phases.
        """
        h = self._holders.get(topic)
        why = None
        if h is None or h.rank != 1:
            why = f"this broker is not the primary of {topic!r}"
        elif h.moving or h.staged or h.pulling or h.placing:
            why = f"{topic!r} is being moved, pulled or placed; try again in a moment"
        elif _same(h.coord, to):
            why = f"{topic!r} is already at ({to[0]}, {to[1]})"
        if why is not None:
            if reply is not None:
                self._reply(reply[0], [reply[1]], Failed(reply[2], topic, "bad_request", why))
            return why
        assert h is not None
        corr = next(self._corr)
        me = self.ov.me
        h.moving = _Move(corr, to, self.ov.now(), reply, force=force)
        if self._closest_id(h.home) == me.id:
            ok, reason = self._grant(topic, h.coord, to, me.id, force)
            self._lease_result(h, ok, reason)
        else:
            self._lease_waits[corr] = topic
            self.ov.route(h.home, Lease(corr, topic, h.coord, to, me, force))
        return None

    def _grant(self, topic: str, frm: Coord, to: Coord, who: str, force: bool) -> tuple[bool, str]:
        """The home's serialisation of moves: one lease per topic, the topic where the home believes it is."""
        now = self.ov.now()
        dl = self.delegate_lists.get(topic)
        cur = dl[-1].coord if dl else self._home(topic)
        if not _same(cur, frm):
            return False, f"the home has {topic!r} at ({cur[0]}, {cur[1]}), not at ({frm[0]}, {frm[1]})"
        lease = self._leases.get(topic)
        if lease is not None and lease[0] > now and lease[1] != who:
            return False, f"another move of {topic!r} is in progress"
        last = self._last_move.get(topic)
        if not force and last is not None and now - last < self.config.move_cooldown:
            return False, f"{topic!r} moved {now - last:.1f} s ago (cool-down {self.config.move_cooldown:.0f} s)"
        self._leases[topic] = (now + 2 * self.config.move_timeout, who)
        return True, ""

    def _lease_arrived(self, m: Lease) -> None:
        ok, reason = self._grant(m.topic, m.frm, m.to, m.origin.id, m.force)
        self.ov.route(m.origin.coord, Leased(m.corr, m.topic, ok, reason))

    def _leased_arrived(self, m: Leased) -> None:
        topic = self._lease_waits.pop(m.corr, None)
        h = self._holders.get(topic) if topic is not None else None
        if h is not None and h.moving is not None and h.moving.corr == m.corr and not h.moving.leased:
            self._lease_result(h, m.granted, m.reason)

    def _lease_result(self, h: _Holder, ok: bool, reason: str) -> None:
        mv = h.moving
        assert mv is not None
        if not ok:
            self._abort_move(h, f"the home refused: {reason}")
            return
        mv.leased = True
        mv.started = self.ov.now()
        if self._closest_id(mv.to) == self.ov.me.id:
            self._local_move(h)
        else:
            self._send_handover(h)

    def _send_handover(self, h: _Holder) -> None:
        mv = h.moving
        assert mv is not None
        last: dict[tuple[str, str, str], _Waiting] = {}
        for w in h.waiting:
            key = (w.access.id, w.session, w.record.publisher)
            if key not in last or w.record.seq > last[key].record.seq:
                last[key] = w
        waiters = tuple(
            Waiter(w.access, w.session, w.record.publisher, w.record.seq, w.record.ts) for w in last.values()
        )
        delivered_upto = h.undelivered[0].ts - TS_EPSILON / 2 if h.undelivered else h.last_ts
        dl = (*h.delegates, Delegation(mv.to, self.ov.now()))
        batches = _chunks(h.log.records())
        me = self.ov.me
        for i, batch in enumerate(batches):
            final = i == len(batches) - 1
            self.ov.route(
                mv.to,
                Replicate(
                    mv.corr if final else 0,
                    h.name,
                    mv.to,
                    me,
                    tuple(batch),
                    tuple(h.subscribers.values()),
                    dl,
                    i == 0,
                    dict(h.log.last_seq),
                    handover=True,
                    delivered_upto=delivered_upto,
                    waiters=waiters if final else (),
                ),
            )

    def _handover_arrived(self, r: Replicate, now: float) -> None:
        h = self._holders.get(r.topic)
        if h is not None and h.moving is not None:
            log.warning("ignoring a hand-over of %s from %s: this broker is moving it itself", r.topic, r.origin.id)
            return
        if h is None:
            h = self._holder(r.topic, r.coord)
        if r.full:
            h.log.clear()
            h.waiting.clear()
            h.first_waiting.clear()
            h.waiter_max.clear()
            h.undelivered.clear()
            h.queued.clear()
        h.log.merge(r.records, now)
        for pub, seq in r.last_seq.items():
            if seq > h.log.last_seq.get(pub, -1):
                h.log.last_seq[pub] = seq
                h.log.last_seen[pub] = now
        if (newest := h.log.last_ts) is not None:
            h.last_ts = max(h.last_ts, newest)
        h.subscribers = {(s.access.id, s.session): s for s in r.subscribers}
        h.coord = r.coord
        h.delegates = list(r.delegates)
        h.rank = self._rank_of_me(h.coord)
        if not r.corr:
            return  # a leading chunk; the final one carries the corr, the waiters and the delivery mark
        h.staged = _Staged(r.origin, r.corr, now, r.waiters)
        h.undelivered = list(h.log.since(r.delivered_upto))
        h.backfill = True
        h.replica = None
        h.inflight = None
        h.outbox.clear()
        h.sent.clear()
        h.meta_dirty = True
        h.pulling.clear()
        self._flush(h)

    def _drop_staged(self, h: _Holder) -> None:
        """A hand-over that will not be activated: drop it here and at the replicas it was copied to."""
        queued, h.queued = h.queued, []
        me = self.ov.me
        for n in self._ranked(h.coord)[1:]:
            self.ov.route(n.coord, Release(h.name, h.coord, me))
        self._drop(h)
        for access, session, req in queued:
            self._forward_request(access, session, req, h.home, via_home=False)

    def _staged_ready(self, h: _Holder) -> None:
        """New primary: the replica caught up with the hand-over, so the old primary may let go."""
        st = h.staged
        if st is None or st.confirmed or h.backfill:
            return
        st.confirmed = True
        self.ov.route(st.origin.coord, Replicated(st.corr, h.name, self.ov.me.id))

    def _move_confirmed(self, h: _Holder) -> None:
        mv = h.moving
        assert mv is not None
        h.moving = None
        now = self.ov.now()
        old = h.coord
        size = h.log.size
        me = self.ov.me
        self.ov.route(mv.to, Activate(h.name, mv.to, me))
        # Requests that waited go behind the ACTIVATE on the same path, so the new primary serves them.
        queued, h.queued = h.queued, []
        for access, session, req in queued:
            self._forward_request(access, session, req, mv.to, via_home=True)
        self._redirect_all(h, mv.to)
        dl = [*h.delegates, Delegation(mv.to, now)]
        self._set_delegates(h.name, dl)
        self._forward[h.name] = (mv.to, now + self.config.forward_ttl)
        self._release_old(h.name, old, mv.to)
        self.counters["moves"] += 1
        self.counters["moved_bytes"] += size
        self.event("move", topic=h.name, load=float(size), frm=old, to=mv.to)
        log.info("moved topic %s (%d bytes) from (%.4f, %.4f) to (%.4f, %.4f)", h.name, size, *old, *mv.to)
        if mv.reply is not None:
            self._reply(mv.reply[0], [mv.reply[1]], Done(mv.reply[2]))
        self._clear_primary_state(h)
        h.coord = mv.to
        h.delegates = dl
        h.moved_at = now
        h.rank = self._rank_of_me(h.coord)
        if h.rank not in (2, 3) or (h.rank == 3 and self.config.resilience < 3):
            self._drop(h)

    def _local_move(self, h: _Holder) -> None:
        """The new coordinate is in this broker's own cell: it stays primary, its replicas change."""
        mv = h.moving
        assert mv is not None
        h.moving = None
        now = self.ov.now()
        old = h.coord
        h.coord = mv.to
        h.delegates = [*h.delegates, Delegation(mv.to, now)]
        h.moved_at = now
        self._set_delegates(h.name, h.delegates)
        self._redirect_all(h, mv.to)
        self._release_old(h.name, old, mv.to)
        # The new secondary must hold everything before anything more is acknowledged.
        h.backfill = True
        h.replica = None
        h.inflight = None
        h.outbox = list(h.undelivered)
        h.meta_dirty = True
        self.counters["moves"] += 1
        self.event("move", topic=h.name, load=0.0, frm=old, to=mv.to)
        if mv.reply is not None:
            self._reply(mv.reply[0], [mv.reply[1]], Done(mv.reply[2]))
        self._release_queue(h)
        self._flush(h)

    def _abort_move(self, h: _Holder, reason: str) -> None:
        mv = h.moving
        assert mv is not None
        h.moving = None
        self._lease_waits.pop(mv.corr, None)
        self.counters["moves_aborted"] += 1
        log.info("move of topic %s to (%.4f, %.4f) abandoned: %s", h.name, *mv.to, reason)
        if mv.leased and self._closest_id(mv.to) != self.ov.me.id:
            self.ov.route(mv.to, Release(h.name, mv.to, self.ov.me))
        if self._closest_id(h.home) == self.ov.me.id:
            self._leases.pop(h.name, None)
        if mv.reply is not None:
            self._reply(mv.reply[0], [mv.reply[1]], Failed(mv.reply[2], h.name, "timeout", reason))
        h.backfill = True  # the secondary may have missed what waited: copy everything again
        h.replica = None
        h.inflight = None
        h.outbox = list(h.undelivered)
        h.meta_dirty = True
        self._release_queue(h)
        self._flush(h)

    def _activate_arrived(self, m: Activate) -> None:
        h = self._holders.get(m.topic)
        if h is None or h.staged is None or not _same(h.coord, m.coord):
            log.warning("ACTIVATE of %s from %s without a staged hand-over here", m.topic, m.origin.id)
            return
        st, h.staged = h.staged, None
        h.moved_at = self.ov.now()
        self.counters["delegations"] += 1
        for w in st.waiters:
            self._reply(w.access, [w.session], Ack(h.name, w.publisher, w.seq, w.ts))
        self.counters["acked"] += len(st.waiters)
        deliver, h.undelivered = h.undelivered, []
        self._deliver_to(h.subscribers.values(), h.name, deliver)
        self._release_queue(h)
        self._flush(h)

    def _redirect_all(self, h: _Holder, to: Coord) -> None:
        groups: dict[str, tuple[NodeInfo, set[str]]] = {}
        for sub in h.subscribers.values():
            groups.setdefault(sub.access.id, (sub.access, set()))[1].add(sub.session)
        for w in h.waiting:
            groups.setdefault(w.access.id, (w.access, set()))[1].add(w.session)
        for access, sessions in groups.values():
            self._redirect(access, sorted(sessions), h.name, to)

    def _release_old(self, topic: str, old: Coord, new: Coord) -> None:
        keep = {n.id for n in self._ranked(new)}
        me = self.ov.me
        for n in self._ranked(old)[1:]:
            if n.id not in keep:
                self.ov.route(n.coord, Release(topic, old, me))

    @staticmethod
    def _clear_primary_state(h: _Holder) -> None:
        h.waiting.clear()
        h.first_waiting.clear()
        h.waiter_max.clear()
        h.undelivered.clear()
        h.outbox.clear()
        h.inflight = None
        h.sent.clear()
        h.replica = None

    def _set_delegates(self, topic: str, dl: list[Delegation]) -> None:
        """Record a topic's new delegate list at its home (here, or by DELEGATE_UPDATE until confirmed)."""
        home = self._home(topic)
        if self._closest_id(home) == self.ov.me.id:
            self._store_delegates(topic, dl)
            return
        corr = next(self._corr)
        self._dl_unconfirmed[corr] = (topic, tuple(dl), self.ov.now())
        self.ov.route(home, DelegateUpdate(corr, topic, tuple(dl), self.ov.me))

    def _store_delegates(self, topic: str, dl: list[Delegation]) -> None:
        cur = self.delegate_lists.get(topic)
        if cur and dl and cur[-1].start > dl[-1].start:
            return  # an older update arriving late
        self.delegate_lists[topic] = list(dl)
        self._last_move[topic] = self.ov.now()
        self._leases.pop(topic, None)
        h = self._holders.get(topic)
        if h is not None:
            h.delegates = list(dl)
        self._sync_home_secondary(topic)

    def _sync_home_secondary(self, topic: str) -> None:
        ranked = self._ranked(self._home(topic))
        dl = self.delegate_lists.get(topic)
        if dl and len(ranked) > 1 and ranked[0].id == self.ov.me.id:
            self.ov.route(ranked[1].coord, DelegateUpdate(0, topic, tuple(dl), self.ov.me, sync=True))

    def _learn_delegates(self, topic: str, dl: list[Delegation]) -> None:
        cur = self.delegate_lists.get(topic)
        if dl and (not cur or cur[-1].start <= dl[-1].start):
            self.delegate_lists[topic] = dl

    def _delegate_update_arrived(self, m: DelegateUpdate) -> None:
        if m.sync:
            self._learn_delegates(m.topic, list(m.delegates))
            return
        self._store_delegates(m.topic, list(m.delegates))
        self.ov.route(m.origin.coord, DelegateUpdated(m.corr, m.topic))

    # ---- overlay changes -------------------------------------------------------------------------------
    def view_changed(self, failed: Collection[str] = ()) -> None:
        """The broker's view of the overlay changed; failed names the brokers that died (not those that left
        gracefully or joined).  Every topic is re-ranked: take-over, new secondary, hand-over, or drop."""
        for topic in list(self.delegate_lists):
            r = self._rank_of_me(self._home(topic))
            if r == 1:
                self._sync_home_secondary(topic)  # the home's secondary may be new
            elif r != 2:
                del self.delegate_lists[topic]
        for h in list(self._holders.values()):
            old = h.rank
            h.rank = self._rank_of_me(h.coord)
            if h.moving is not None or h.staged is not None:
                continue  # finishes (or times out) as it is; the roles are settled afterwards
            if h.rank == 1:
                if old != 1:
                    self._take_over(h)
                sec = self._secondary(h)
                if sec is not None and h.replica != sec.id:
                    lost_by_failure = h.replica in failed or (old != 1 and bool(failed))
                    # Sec. IV-B: only level 3 provisions the capacity to copy history after a failure.
                    h.backfill = self.config.resilience >= 3 or not lost_by_failure
                    h.replica = None
                    if h.inflight is not None and h.inflight[1] != sec.id:
                        h.inflight = None  # re-sent to the new secondary below
                        h.outbox = list(h.undelivered)
                    h.meta_dirty = True
                self._flush(h)
            elif h.rank in (2, 3) and (h.rank == 2 or self.config.resilience >= 3):
                h.inflight = None
                h.waiting.clear()  # the new primary acknowledges: publishers re-send what we did not ack
                h.first_waiting.clear()
                h.waiter_max.clear()
                h.outbox.clear()
                h.undelivered.clear()
            else:
                self._holders.pop(h.name, None)
                self.store.drop(h.name)

    def _take_over(self, h: _Holder) -> None:
        self.counters["takeovers"] += 1
        self.event("takeover", topic=h.name)
        log.info("taking over topic %s (%d messages, %d subscribers)", h.name, len(h.log.rows), len(h.subscribers))
        # The other holders may know more than we do (the dead primary may have replicated to a secondary
        # that our view did not rank second at the time): merge their copies first, like a returning primary
        # (Sec. III-C), then re-deliver.  Requests wait in the meantime, at most pull_timeout.
        if self._start_pull(h):
            h.takeover = True
        else:
            self._redeliver(h)

    def _redeliver(self, h: _Holder) -> None:
        window = h.last_ts - self.config.redeliver_window
        self._deliver_to(h.subscribers.values(), h.name, list(h.log.since(window)))

    # ---- time ------------------------------------------------------------------------------------------
    def tick(self) -> None:
        """Timers: replication and pull time-outs, retention."""
        now = self.ov.now()
        for h in list(self._holders.values()):
            if h.inflight is not None and now - h.inflight[2] > h.rto:
                log.warning("replica %s of %s did not confirm within %.1f s; re-sending", h.inflight[1], h.name, h.rto)
                h.rto = min(h.rto * 2, MAX_RTO)
                h.inflight = None
                # Re-send everything not yet confirmed (a pending back-fill stays a back-fill); the replica
                # merges, so what it already had is not duplicated.
                h.outbox = list(h.undelivered)
                h.meta_dirty = True
                self._flush(h)
            if h.pulling and now - h.pull_started > self.config.pull_timeout:
                h.pulling.clear()
                self._pull_progress(h)
            elif h.pulling and not h.pull_retried and now - h.pull_started > self.config.pull_timeout / 4:
                # Right after a failure a pull can be routed through a broker that has not yet noticed it and
                # be lost there; asking again once the overlay has healed beats waiting out the time-out (the
                # requests of the topic wait meanwhile).  A second answer is merged like one that comes after the
                # time-out: the merge drops what is already stored.
                h.pull_retried = True
                view = self.ov.view()
                for corr, nid in h.pulling.items():
                    if (node := view.get(nid)) is not None:
                        self.ov.route(node.coord, Pull(corr, h.name, h.coord, self.ov.me))
            if h.moving is not None and now - h.moving.started > self.config.move_timeout:
                self._abort_move(h, f"no confirmation from the new coordinate within {self.config.move_timeout:.1f} s")
            if h.staged is not None and now - h.staged.since > 2 * self.config.move_timeout + 1.0:
                log.warning("hand-over of %s from %s never activated; dropping it", h.name, h.staged.origin.id)
                self._drop_staged(h)
        for topic in [t for t, (_, until) in self._forward.items() if until < now]:
            del self._forward[topic]
        for corr, (topic, dl, sent) in list(self._dl_unconfirmed.items()):
            if now - sent > 1.0:  # the home's confirmation is missing: the list must not be lost
                self._dl_unconfirmed[corr] = (topic, dl, now)
                self.ov.route(self._home(topic), DelegateUpdate(corr, topic, dl, self.ov.me))
        for topic in [t for t, v in self._t3notes.items() if v[3] < now]:
            del self._t3notes[topic]
        self.store.expire(now)

    # ---- status and loads ------------------------------------------------------------------------------
    def topics(self) -> list[tuple[str, str, int]]:
        """(topic, role, stored bytes) for every topic held, and the delegated topics this broker is home of.

        Roles: primary (at the topic's home coordinate), delegate (primary at a delegate coordinate),
        secondary, tertiary, home (keeps the delegate list of a topic that lives elsewhere).
        """
        out = []
        for h in self._holders.values():
            if h.rank == 1:
                role = "primary" if _same(h.coord, h.home) else "delegate"
            else:
                role = {2: "secondary", 3: "tertiary"}.get(h.rank, "none")
            out.append((h.name, role, h.log.size))
        me = self.ov.me.id
        for topic, dl in self.delegate_lists.items():
            if not _same(dl[-1].coord, self._home(topic)) and self._closest_id(self._home(topic)) == me:
                out.append((topic, "home", 0))
        return out

    def topic_coord(self, topic: str) -> Coord | None:
        """C(t) of a topic this broker holds, or None."""
        h = self._holders.get(topic)
        return h.coord if h is not None else None

    def primary_topics(self) -> dict[str, int]:
        """Topics this broker is responsible for and free to move (Alg. 2's candidates): name -> bytes."""
        return {
            h.name: h.log.size
            for h in self._holders.values()
            if h.rank == 1 and not (h.moving or h.staged or h.pulling or h.placing)
        }

    def topic_triple(self, topic: str) -> tuple[str, str, str]:
        """N1, N2, N3 node ids of a topic's coordinate ('' where there is none)."""
        h = self._holders.get(topic)
        coord = h.coord if h is not None else self._home(topic)
        ids = [n.id for n in self._ranked(coord)]
        return (ids[0], ids[1] if len(ids) > 1 else "", ids[2] if len(ids) > 2 else "")

    def _t3_items(self) -> list[tuple[str, str, float]]:
        items: dict[str, tuple[str, str, float]] = {}
        for topic, (n1, n2, size, _) in self._t3notes.items():
            items[topic] = (n1, n2, size)
        for h in self._holders.values():
            if h.rank == 3:
                ranked = self._ranked(h.coord)
                items[h.name] = (ranked[0].id, ranked[1].id, float(h.log.size))
        return list(items.values())

    def load_record(self) -> NodeLoad:
        """This broker's load record for LOAD_REPORT: t1, t2 and the eq. (3) failure sums, in bytes."""
        t1 = float(sum(h.log.size for h in self._holders.values() if h.rank == 1))
        t2 = float(sum(h.log.size for h in self._holders.values() if h.rank == 2))
        return NodeLoad(self.ov.me, t1, t2, failure_sums(self._t3_items()), self.ov.now())

    def loads(self) -> dict[str, int]:
        """L1_N, L2_N, L3_N of this broker in bytes (eqs. 1, 2, 4) from the topics it holds."""
        l1 = sum(h.log.size for h in self._holders.values() if h.rank == 1)
        l2 = l1 + sum(h.log.size for h in self._holders.values() if h.rank == 2)
        return {"L1": l1, "L2": l2, "L3": l2 + int(l3_additional(failure_sums(self._t3_items())))}

    def tertiary_notes(self) -> dict[str, tuple[NodeInfo, list[tuple[str, str, str]], list[float]]]:
        """Level 3: for each third-closest node of this broker's topics, what it would take over (eq. 3)."""
        out: dict[str, tuple[NodeInfo, list[tuple[str, str, str]], list[float]]] = {}
        if self.config.resilience < 3:
            return out
        for h in self._holders.values():
            if h.rank != 1:
                continue
            ranked = self._ranked(h.coord)
            if len(ranked) < 3:
                continue
            entry = out.setdefault(ranked[2].id, (ranked[2], [], []))
            entry[1].append((h.name, ranked[0].id, ranked[1].id))
            entry[2].append(float(h.log.size))
        return out


def _same(a: Coord, b: Coord) -> bool:
    return distance(a, b) < SAME_COORD


def _no_event(kind: str, **fields: object) -> None:
    """Events go nowhere unless the broker connects its metrics log."""


def _byte_chunks(items: list[bytes]) -> list[list[bytes]]:
    """Split encoded requests into batches that fit a frame."""
    out: list[list[bytes]] = [[]]
    size = 0
    for b in items:
        if out[-1] and (len(out[-1]) >= MAX_BATCH or size + len(b) > MAX_BATCH_BYTES):
            out.append([])
            size = 0
        out[-1].append(b)
        size += len(b)
    return out


def _chunks(records: list[Record]) -> list[list[Record]]:
    """Split records into batches that fit a frame; always at least one (possibly empty) batch."""
    out: list[list[Record]] = [[]]
    size = 0
    for r in records:
        if out[-1] and (len(out[-1]) >= MAX_BATCH or size + len(r.payload) > MAX_BATCH_BYTES):
            out.append([])
            size = 0
        out[-1].append(r)
        size += len(r.payload)
    return out
