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

from broker.store import Retention, StoredMessage, TopicLog, TopicStore
from overlay.geometry import Coord, closest, geohash
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
    PubSubCode,
    Pull,
    Record,
    Replicate,
    Replicated,
    SessionGone,
    SubRef,
    Subscribe,
    Subscribed,
    TopicReply,
    TopicRequest,
    Unsubscribe,
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


@dataclass(slots=True)
class _Waiting:
    record: Record
    access: NodeInfo
    session: str


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
    queued: list[tuple[NodeInfo, str, Message]] = field(default_factory=list)  # requests held during a pull
    meta_dirty: bool = False  # subscribers changed: the secondary needs the new list
    takeover: bool = False  # became primary by a failure; re-deliver once the other holders answered


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
        }
        # Observability: events for the metrics log (the broker sets Broker.event; docs/logs.md).
        self.event: Callable[..., None] = _no_event

    # ================================================================ access side (local client sessions)
    def client_message(self, session: str, msg: Message) -> None:
        """A message from a client attached to this broker."""
        match msg:
            case Publish():
                if err := self._check_publish(msg):
                    code, text = err
                    self._to_local(session, Nack(msg.topic, msg.publisher, msg.seq, code, text))
                    return
            case Subscribe() | Unsubscribe() | Fetch() | Locate():
                try:
                    validate_topic(msg.topic)
                except BadTopic as exc:
                    self._to_local(session, Failed(msg.corr, msg.topic, "bad_topic", str(exc)))
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

    def _check_publish(self, msg: Publish) -> tuple[PubSubCode, str] | None:
        if msg.topic not in self._valid_topics:
            try:
                validate_topic(msg.topic)
            except BadTopic as exc:
                return ("bad_topic", str(exc))
            if len(self._valid_topics) < 100_000:  # a cache, not a second topic table
                self._valid_topics.add(msg.topic)
        if len(msg.payload) > MAX_PAYLOAD_SIZE:
            return ("too_large", f"payload of {len(msg.payload)} bytes is over the limit of {MAX_PAYLOAD_SIZE}")
        return None

    def _send_request(self, topic: str, session: str, msg: Message) -> None:
        coord = self.coords.get(topic) or self._home(topic)
        me = self.ov.me
        h = self._holders.get(topic)
        if (h.rank == 1 and h.coord == coord) if h is not None else self._closest_id(coord) == me.id:
            self._handle_request(me, session, msg)  # 0 hops: no envelope at all
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
                self.ov.route(coord, TopicRequest(me, session, tuple(chunk)))
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
                    self._handle_request(msg.access, msg.session, inner)
            case TopicReply():
                self._reply_arrived(msg)
            case Replicate():
                self._replicate_arrived(msg)
            case Replicated():
                self._replicated_arrived(msg)
            case Pull():
                self._pull_arrived(msg)
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

    def _holder(self, topic: str) -> _Holder:
        h = self._holders.get(topic)
        if h is None:
            home = geohash(topic)
            h = _Holder(topic, self.store.ensure(topic), home, home, [Delegation(home, 0.0)])
            h.rank = self._rank_of_me(h.coord)
            self._holders[topic] = h
        return h

    def _handle_request(self, access: NodeInfo, session: str, req: Message) -> None:
        topic = getattr(req, "topic", None)
        if not isinstance(topic, str):
            log.warning("dropping a topic request without a topic: %s", req.op)
            return
        known = topic in self._holders
        h = self._holder(topic)
        if h.pulling or (not known and self._start_pull(h)):
            h.queued.append((access, session, req))  # served once the previous holders answered
            return
        self._serve(h, access, session, req)

    def _serve(self, h: _Holder, access: NodeInfo, session: str, req: Message) -> None:
        match req:
            case Publish():
                self._publish(h, access, session, req)
            case Subscribe():
                key = (access.id, session)
                h.subscribers[key] = SubRef(access, session)
                h.meta_dirty = True
                if req.since is not None:
                    self._deliver_to([SubRef(access, session)], h.name, [_record(m) for m in h.log.since(req.since)])
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
                if not h.log.messages and not h.log.last_seq and not h.subscribers:
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
                    out.append(_record(m))
                self._reply(access, [session], Fetched(req.corr, h.name, tuple(out), more))
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
                        tuple(h.delegates),
                        h.log.size,
                        len(h.subscribers),
                    ),
                )
                self._forget_if_empty(h)
            case _:
                log.warning("dropping unexpected topic request %s", req.op)

    def _forget_if_empty(self, h: _Holder) -> None:
        # A FETCH or LOCATE of a topic nobody published to must not create state that lingers.
        if not h.log.messages and not h.log.last_seq and not h.subscribers and not h.waiting:
            self._holders.pop(h.name, None)
            self.store.drop(h.name)

    def _publish(self, h: _Holder, access: NodeInfo, session: str, p: Publish) -> None:
        if err := self._check_publish(p):
            code, text = err
            self._reply(access, [session], Nack(p.topic, p.publisher, p.seq, code, text))
            return
        last = h.log.last_seq.get(p.publisher, -1)
        if p.seq <= last:
            # A re-send (its acknowledgement was lost, or it is still on its way to the replica).
            self.counters["duplicates"] += 1
            first = h.first_waiting.get(p.publisher)
            if first is None or p.seq < first:
                self._reply(access, [session], Ack(p.topic, p.publisher, p.seq, 0.0))  # stored and safe already
                return
            key = (access.id, session, p.publisher)
            if h.waiter_max.get(key, -1) < p.seq:  # a new asker (e.g. after a reconnect): answer with the batch
                self._wait(h, Record(h.last_ts, p.publisher, p.seq, b""), access, session)
            return
        if p.seq > last + 1 and p.base > last + 1:
            # The publisher had [last + 1, base) acknowledged, yet this broker never got them: they were lost
            # with a failed broker (resilience level 1, or more failures than the level survives).  Count and
            # log the loss, then continue the sequence after it so subscribers see the gap.
            lost = p.base - last - 1
            self.counters["lost"] += lost
            log.warning(
                "topic %s: %d acknowledged message(s) of publisher %s before seq %d are lost", h.name, lost,
                p.publisher, p.base,
            )  # fmt: skip
            last = p.base - 1
            h.log.last_seq[p.publisher] = last
        if p.seq > last + 1:
            # Earlier messages are still on their way or were dropped in a failover: the publisher has them.
            self._reply(
                access,
                [session],
                Nack(p.topic, p.publisher, p.seq, "out_of_order", f"expected seq {last + 1} first", last + 1),
            )
            return
        now = self.ov.now()
        ts = max(now, h.last_ts + TS_EPSILON)
        h.last_ts = ts
        rec = Record(ts, p.publisher, p.seq, p.payload)
        h.log.append(StoredMessage(ts, p.publisher, p.seq, p.payload), now)
        self.counters["published"] += 1
        self.counters["published_bytes"] += len(p.payload)
        self._wait(h, rec, access, session)
        h.undelivered.append(rec)
        h.outbox.append(rec)
        self._mark(h)

    @staticmethod
    def _wait(h: _Holder, rec: Record, access: NodeInfo, session: str) -> None:
        h.waiting.append(_Waiting(rec, access, session))
        h.first_waiting.setdefault(rec.publisher, rec.seq)
        key = (access.id, session, rec.publisher)
        h.waiter_max[key] = max(h.waiter_max.get(key, -1), rec.seq)

    # ---- replication ---------------------------------------------------------------------------------
    def _flush(self, h: _Holder) -> None:
        """Send the next batch to the secondary, or acknowledge and deliver when no copy is required."""
        if h.rank != 1 or h.pulling:
            return  # while pulling, _pull_progress flushes once the other holders have answered
        sec = self._secondary(h)
        if sec is None:
            h.outbox.clear()
            h.meta_dirty = False
            self._commit(h, float("inf"))
            return
        if h.inflight is not None:
            return
        if not h.outbox and not h.meta_dirty and h.replica == sec.id and not h.backfill:
            return
        if h.replica != sec.id:
            h.replica = None
        # A back-fill replaces whatever the secondary had with the whole history; otherwise it merges.
        full = h.backfill
        records = [_record(m) for m in h.log.messages] if full else list(h.outbox)
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
        self._flush(h)

    def _commit(self, h: _Holder, upto: float) -> None:
        """Messages stored up to timestamp upto are safe: acknowledge them, then deliver in order."""
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
        h = self._holder(r.topic)
        if r.full and r.corr not in h.pulling and h.rank != 1:
            h.log.messages.clear()
            h.log.size = 0
        h.log.merge((StoredMessage(x.ts, x.publisher, x.seq, x.payload) for x in r.records), now)
        for pub, seq in r.last_seq.items():
            if seq > h.log.last_seq.get(pub, -1):
                h.log.last_seq[pub] = seq
                h.log.last_seen[pub] = now
        if h.log.messages:
            h.last_ts = max(h.last_ts, h.log.messages[-1].ts)
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
        for n in others:
            corr = next(self._corr)
            h.pulling[corr] = n.id
            self.ov.route(n.coord, Pull(corr, h.name, h.coord, self.ov.me))
        return True

    def _pull_arrived(self, p: Pull) -> None:
        h = self._holders.get(p.topic)
        if h is None or (not h.log.messages and not h.subscribers and not h.log.last_seq):
            self.ov.route(p.origin.coord, Replicated(p.corr, p.topic, self.ov.me.id))
            return
        batches = _chunks([_record(m) for m in h.log.messages])
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
        took_over, h.takeover = h.takeover, False
        if took_over:
            self._redeliver(h)
        queued, h.queued = h.queued, []
        for access, session, req in queued:
            self._serve(h, access, session, req)
        if h.name in self._holders:  # not forgotten as empty by a FETCH/LOCATE
            if not took_over:
                h.backfill = True  # a join made us primary: the secondary gets everything we now hold
            self._flush(h)  # after a take-over, view_changed decided whether the history is copied

    # ---- overlay changes -------------------------------------------------------------------------------
    def view_changed(self, failed: Collection[str] = ()) -> None:
        """The broker's view of the overlay changed; failed names the brokers that died (not those that left
        gracefully or joined).  Every topic is re-ranked: take-over, new secondary, hand-over, or drop."""
        for h in list(self._holders.values()):
            old = h.rank
            h.rank = self._rank_of_me(h.coord)
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
        log.info("taking over topic %s (%d messages, %d subscribers)", h.name, len(h.log.messages), len(h.subscribers))
        # The other holders may know more than we do (the dead primary may have replicated to a secondary
        # that our view did not rank second at the time): merge their copies first, like a returning primary
        # (Sec. III-C), then re-deliver.  Requests wait in the meantime, at most pull_timeout.
        if self._start_pull(h):
            h.takeover = True
        else:
            self._redeliver(h)

    def _redeliver(self, h: _Holder) -> None:
        window = h.last_ts - self.config.redeliver_window
        self._deliver_to(h.subscribers.values(), h.name, [_record(m) for m in h.log.since(window)])

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
        self.store.expire(now)

    # ---- status and loads ------------------------------------------------------------------------------
    def topics(self) -> list[tuple[str, str, int]]:
        """(topic, role, stored bytes) for every topic held."""
        names = {1: "primary", 2: "secondary", 3: "tertiary"}
        return [(h.name, names.get(h.rank, "none"), h.log.size) for h in self._holders.values()]

    def loads(self) -> dict[str, int]:
        """L1_N, L2_N, L3_N of this broker in bytes (eqs. 1, 2, 4) from the topics it holds."""
        l1 = sum(h.log.size for h in self._holders.values() if h.rank == 1)
        l2 = l1 + sum(h.log.size for h in self._holders.values() if h.rank == 2)
        t3 = []
        for h in self._holders.values():
            if h.rank == 3:
                ranked = self._ranked(h.coord)
                t3.append((ranked[0].id, ranked[1].id, float(h.log.size)))
        return {"L1": l1, "L2": l2, "L3": l2 + int(l3_additional(failure_sums(t3)))}


def _no_event(kind: str, **fields: object) -> None:
    """Events go nowhere unless the broker connects its metrics log."""


def _record(m: StoredMessage) -> Record:
    return Record(m.ts, m.publisher, m.seq, m.payload)


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
