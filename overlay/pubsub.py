"""Pub/sub messages: what clients say to their access broker and what brokers route to a topic's coordinate.

Clients speak CONTROL frames to the broker they are attached to (their *access* broker).  The access broker
wraps each request into a ROUTED frame addressed to the topic's coordinate C(t) (h(t) until delegated), so it
reaches the topic's primary N1(C(t)) by greedy forwarding; answers are routed back to the access broker's own
coordinate, of which it is the closest node.  Registered in the `overlay.protocol` codec on import.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field, fields
from typing import Any, ClassVar, Final, Literal, NamedTuple, TypeAlias

from overlay.protocol import (
    MAX_CORR,
    MAX_FRAME_SIZE,
    MAX_ID_LEN,
    MAX_LONG_LIST_LEN,
    ControlFrame,
    Frame,
    LocalProtocolError,
    Message,
    NodeInfo,
    check_body,
    check_corr,
    control_frame,
    dec_bytes,
    dec_coord,
    dec_float,
    dec_list,
    dec_node,
    dec_str,
    enc_node,
    pack_value,
    register_field_type,
    register_message,
)
from overlay.seqset import Digest

Coord: TypeAlias = tuple[float, float]

# A payload must fit in one frame together with its envelope (topic, ids, routing header); 1 KiB of headroom
# covers the largest envelope (256-byte topic, two 64-byte ids, a NodeInfo with a 262-byte address).
MAX_PAYLOAD_SIZE: Final = MAX_FRAME_SIZE - 1024
# A SUBSCRIBED carries the topic's publisher table only up to this many publishers (~300 KB at the longest ids).
SUBSCRIBED_TABLE_MAX: Final = 4096
# How many stored messages one FETCH answer or one replication batch carries; more are paged.
MAX_BATCH: Final = 512
# Only so many bytes of payload go into one batch frame, so batches stay under MAX_FRAME_SIZE.
MAX_BATCH_BYTES: Final = MAX_FRAME_SIZE // 2

PubSubCode: TypeAlias = Literal[
    "bad_topic",  # the topic name breaks a naming rule (overlay.topics)
    "too_large",  # payload over MAX_PAYLOAD_SIZE
    "already_subscribed",  # a second SUBSCRIBE for the same topic on one session
    "not_subscribed",  # UNSUBSCRIBE of a topic the session is not subscribed to
    "unknown_topic",  # FETCH or MOVE_TOPIC of a topic no broker holds
    "unreachable",  # the topic's coordinate could not be reached (overlay partitioned or hop limit)
    "not_allowed",  # an ACL denies it
    "timeout",  # the primary did not answer in time
    "storage_full",  # the holder's disk or memory is full: the message was not stored (docs/storage.md)
    "shutting_down",  # the broker is leaving
    "out_of_order",  # a publisher's sequence has a gap the client can fill: re-send from `expected`
    "bad_request",  # anything else the client got wrong
    "rate_limited",  # over the broker's per-client publish rate (--publish-rate): re-send later
    "topic_full",  # a new subscriber or publisher of a topic that has MAX_TOPIC_ENTRIES (or --max-topic-entries)
]


def _check_publisher(publisher: str, seq: int) -> None:
    if not 0 < len(publisher) <= MAX_ID_LEN or not publisher.isprintable():
        raise LocalProtocolError(f"publisher id must be 1..{MAX_ID_LEN} printable characters, got {publisher!r}")
    if not 0 <= seq <= MAX_CORR:
        raise LocalProtocolError(f"sequence number must be in 0..{MAX_CORR}, got {seq}")


def _check_ts(ts: float, what: str) -> None:
    if not math.isfinite(ts):
        raise LocalProtocolError(f"{what} must be a finite number of seconds, got {ts}")


# A topic's subscribers plus the publishers in its table (a broker forgets one silent for a day) at most: both
# travel in every REPLICATE that carries the topic's meta, beside up to a frame of records, and that must fit a
# frame between brokers.  With the longest ids (MAX_ID_LEN) a subscriber costs at most 66 bytes there and a
# publisher 75 (its id and sequence number); 32,768 of them take under 2.5 MB, leaving MAX_LINK_FRAME_SIZE room
# for the largest record and 1,000 access brokers with the longest ids and addresses (tests/test_topic_limits.py
# builds that REPLICATE).  A new subscriber or publisher beyond it is refused (`topic_full`), the topic's others go on.
MAX_TOPIC_ENTRIES: Final = 1 << 15

# Besides its payload a stored message keeps a timestamp, a sequence number and the publisher id; 24 bytes
# plus the id's length is what those cost in the msgpack form used for replication, so L_T(t) counts them.
MESSAGE_OVERHEAD: Final = 24


class Record(NamedTuple):
    """One stored message: as a broker keeps it, and as it travels in FETCH answers, replication, hand-over.

    A NamedTuple rather than a dataclass: a busy broker makes ~10^5 of these per second, and msgpack packs
    a batch of them as it is.  Records that arrive on the wire are checked by `check_record`; the broker
    builds its own from a checked PUBLISH.
    """

    ts: float
    publisher: str
    seq: int
    payload: bytes

    @property
    def size(self) -> int:
        """Bytes this message adds to its topic's load L_T(t)."""
        return record_size(self.publisher, self.payload)


def record_size(publisher: str, payload: bytes) -> int:
    """Bytes a stored message adds to its topic's load L_T(t): payload, publisher id and MESSAGE_OVERHEAD."""
    return len(payload) + len(publisher) + MESSAGE_OVERHEAD


def check_record(rec: Record) -> Record:
    """rec if its timestamp, publisher id and sequence number are well-formed, else LocalProtocolError."""
    _check_ts(rec.ts, "record timestamp")
    _check_publisher(rec.publisher, rec.seq)
    return rec


@dataclass(frozen=True, slots=True)
class SubRef:
    """A subscription as the topic's holders keep it: access broker, and the client session there."""

    access: NodeInfo
    session: str

    def __post_init__(self) -> None:
        if not 0 < len(self.session) <= MAX_ID_LEN:
            raise LocalProtocolError(f"session id must be 1..{MAX_ID_LEN} characters")


@dataclass(frozen=True, slots=True)
class Delegation:
    """One entry of a topic's delegate list (Sec. III-A): a coordinate and when the topic started there."""

    coord: Coord
    start: float


# A topic's delegate list keeps the home's entry and the latest moves, this many in all.  Only the last entry
# routes requests (Sec. III-B) and a move hands the whole history to the new coordinate, so the older ones
# hold nothing of the topic; unbounded, the list of a topic moved at every cool-down (30 s) outgrew what a
# message may carry (MAX_LIST_LEN entries) within nine hours, and every REPLICATE of its meta grew with it.
MAX_DELEGATES: Final = 64


def delegated(dl: Sequence[Delegation], to: Coord, start: float) -> list[Delegation]:
    """dl with a move to `to` at `start` appended, held to MAX_DELEGATES (the first entry and the latest).

    The new entry starts after the last one even if the clock of the broker moving the topic is behind the clock
    of the one that moved it last: lists are ordered by their last start (`later`)."""
    if dl:
        start = max(start, dl[-1].start + 1e-6)
    out = [*dl, Delegation(to, start)]
    if len(out) > MAX_DELEGATES:
        out = [out[0], *out[len(out) - MAX_DELEGATES + 1 :]]
    return out


def later(dl: Sequence[Delegation], than: Sequence[Delegation]) -> bool:
    """dl records a move `than` does not know of: its last entry started later.  Two brokers that hold a topic
    at different coordinates (a copy left behind by a move whose RELEASE was lost with a restart) compare their
    lists so: the one with the later list is where the topic lives, and the other hands its records there."""
    return bool(dl) and (not than or dl[-1].start > than[-1].start)


@dataclass(frozen=True, slots=True)
class Waiter:
    """A publish stored but not yet acknowledged, handed over with its topic: the new primary acknowledges."""

    access: NodeInfo
    session: str
    publisher: str
    seq: int
    ts: float


def _dec_record(v: Any) -> Record:
    ts, pub, seq, payload = dec_list(v)
    if type(pub) is not str or type(seq) is not int or type(payload) is not bytes:
        raise TypeError("a record is [ts, publisher, seq, payload]")
    return check_record(Record(dec_float(ts), pub, seq, payload))


_isfinite = math.isfinite
_tuple_new = tuple.__new__


def _dec_records(v: Any) -> tuple[Record, ...]:
    """[[ts, publisher, seq, payload], ...] as Records, checked as `_dec_record` checks one (which also says what
    is wrong with one that fails here): the publisher id once per run of records that share it, the array taken
    as the Record itself.  With a call of `_dec_record` per record a DELIVER or REPLICATE of 512 records took
    1.6 µs a record to decode, as much as the subscriber's whole handling of the message."""
    out: list[Record] = []
    checked = ""  # the publisher id of the record before, already checked
    for x in dec_list(v):
        if type(x) is list and len(x) == 4:
            ts, pub, seq, payload = x
            if (
                type(ts) is float
                and _isfinite(ts)
                and type(pub) is str
                and type(seq) is int
                and 0 <= seq <= MAX_CORR
                and type(payload) is bytes
            ):
                if pub != checked:
                    _check_publisher(pub, seq)
                    checked = pub
                out.append(_tuple_new(Record, x))
                continue
        out.append(_dec_record(x))  # an integer timestamp (msgpack packs 2.0 as a float), or what is wrong
    return tuple(out)


def _enc_subrefs(subs: tuple[SubRef, ...]) -> list[list[Any]]:
    """A topic's subscribers as [[access broker, [session, ...]], ...]: the broker once per group, not once per
    subscriber (~15 bytes a subscriber instead of ~90, which is what lets MAX_TOPIC_ENTRIES fit a frame)."""
    if not subs:
        return []
    groups: dict[NodeInfo, list[str]] = {}
    for s in subs:
        g = groups.get(s.access)
        if g is None:
            groups[s.access] = [s.session]
        else:
            g.append(s.session)
    return [[enc_node(access), sessions] for access, sessions in groups.items()]


def _dec_subrefs(v: Any) -> tuple[SubRef, ...]:
    out: list[SubRef] = []
    for group in dec_list(v, MAX_LONG_LIST_LEN):
        node, sessions = dec_list(group)
        access = dec_node(node)
        for session in dec_list(sessions, MAX_LONG_LIST_LEN - len(out)):
            if type(session) is not str:
                raise TypeError("a subscriber group is [node, [session, ...]]")
            out.append(SubRef(access, session))
    return tuple(out)


def _dec_waiter(v: Any) -> Waiter:
    node, session, pub, seq, ts = dec_list(v)
    if type(session) is not str or type(pub) is not str or type(seq) is not int:
        raise TypeError("a waiter is [node, session, publisher, seq, ts]")
    return Waiter(dec_node(node), session, pub, seq, dec_float(ts))


def _dec_delegation(v: Any) -> Delegation:
    coord, start = dec_list(v)
    return Delegation(dec_coord(coord), dec_float(start))


register_field_type(
    "tuple[Record, ...]",
    lambda rs: rs,  # records are tuples: msgpack packs them as arrays as they are
    _dec_records,
)
register_field_type("tuple[SubRef, ...]", _enc_subrefs, _dec_subrefs)  # a topic's subscribers
register_field_type(
    "tuple[Delegation, ...]",
    lambda ds: [[[d.coord[0], d.coord[1]], d.start] for d in ds],
    lambda v: tuple(_dec_delegation(x) for x in dec_list(v)),
)
register_field_type(
    "tuple[Waiter, ...]",
    lambda ws: [[enc_node(w.access), w.session, w.publisher, w.seq, w.ts] for w in ws],
    lambda v: tuple(_dec_waiter(x) for x in dec_list(v, MAX_LONG_LIST_LEN)),  # a topic's waiting publishes
)


def _dec_bytes_tuple(v: Any) -> tuple[bytes, ...]:
    items = dec_list(v)
    if not items:
        return ()  # the common case (a PUBLISH of one message): no generator for nothing
    return tuple(dec_bytes(x) for x in items)


register_field_type("tuple[bytes, ...]", list, _dec_bytes_tuple)


class SessionRequests(NamedTuple):
    """One session's requests in a TOPIC_REQUEST: the session, who it authenticated as, its encoded requests."""

    session: str
    identity: str
    requests: tuple[bytes, ...]


class Answer(NamedTuple):
    """One answer in a TOPIC_REPLY: the sessions it is for and the encoded message (an ACK, a DELIVER, ...)."""

    sessions: tuple[str, ...]
    body: bytes


def _dec_session_id(v: Any) -> str:
    if type(v) is not str or not 0 < len(v) <= MAX_ID_LEN:
        raise ValueError(f"a session id is 1..{MAX_ID_LEN} characters")
    return v


def _dec_sessions(v: Any) -> tuple[str, ...]:
    """The sessions of one access broker that a message is for: they grow with a topic (MAX_LONG_LIST_LEN)."""
    return tuple(_dec_session_id(s) for s in dec_list(v, MAX_LONG_LIST_LEN))


# A field of the sessions a topic's message is for at one access broker (TOPIC_MOVED).
Sessions: TypeAlias = tuple[str, ...]
register_field_type("Sessions", list, _dec_sessions)


def _dec_session_requests(v: Any) -> SessionRequests:
    session, identity, requests = dec_list(v)
    return SessionRequests(_dec_session_id(session), dec_str(identity), _dec_bytes_tuple(requests))


def _dec_answer(v: Any) -> Answer:
    sessions, body = dec_list(v)
    return Answer(_dec_sessions(sessions), dec_bytes(body))


# Both are tuples of tuples (and of tuples of str or bytes): msgpack packs them as arrays as they are.
register_field_type(
    "tuple[SessionRequests, ...]",
    lambda xs: xs,
    lambda v: tuple(_dec_session_requests(x) for x in dec_list(v)),
)
register_field_type("tuple[Answer, ...]", lambda xs: xs, lambda v: tuple(_dec_answer(x) for x in dec_list(v)))


# A digest names every publisher of a topic (dedup state is kept for a day): MAX_LONG_LIST_LEN publishers, each
# with at most as many ranges; the frame size bounds it in any case.


def _dec_digest(v: Any) -> Digest:
    if type(v) is not dict:
        raise TypeError(f"a digest is a map, got {type(v).__name__}")
    if len(v) > MAX_LONG_LIST_LEN:
        raise ValueError(f"digest of {len(v)} publishers exceeds {MAX_LONG_LIST_LEN}")
    out: Digest = {}
    for pub, pairs in v.items():
        if type(pairs) is not list or len(pairs) > MAX_LONG_LIST_LEN:
            raise ValueError("a digest maps a publisher to at most 65536 ranges")
        ranges = []
        for pair in pairs:
            lo, hi = dec_list(pair)
            if type(lo) is not int or type(hi) is not int or not 0 <= lo <= hi:
                raise ValueError("a digest range is [lo, hi] with 0 <= lo <= hi")
            ranges.append((lo, hi))
        out[dec_str(pub)] = tuple(ranges)
    return out


register_field_type(
    "Digest",
    lambda d: {pub: [list(r) for r in ranges] for pub, ranges in d.items()},
    _dec_digest,
)
register_field_type(
    "Digest | None",
    lambda d: None if d is None else {pub: [list(r) for r in ranges] for pub, ranges in d.items()},
    lambda v: None if v is None else _dec_digest(v),
)
register_field_type(
    "float | None",
    lambda v: v,
    lambda v: None if v is None else dec_float(v),
)
register_field_type(
    "PubSubCode",
    lambda v: v,
    lambda v: _code(v),
)
_CODES: Final = frozenset(PubSubCode.__args__)  # type: ignore[attr-defined]


def _code(v: Any) -> str:
    if type(v) is not str or v not in _CODES:
        raise ValueError(f"unknown error code {v!r}")
    return v


# ----------------------------------------------------------------------------- client <-> access broker


@register_message
@dataclass(frozen=True, slots=True)
class Subscribe(Message):
    """Subscribe this session to a topic; with `since`, first replay the stored messages newer than it."""

    op: ClassVar[Literal["subscribe"]] = "subscribe"
    corr: int
    topic: str
    since: float | None = None

    def __post_init__(self) -> None:
        check_corr(self.corr)
        if self.since is not None:
            _check_ts(self.since, "since")


@register_message
@dataclass(frozen=True, slots=True)
class Subscribed(Message):
    """The topic's primary registered the subscription; `coord` is the topic's current coordinate C(t).

    `last_ts` is the primary's newest timestamp when it registered the subscription: every message stored after
    it reaches the subscriber, so a client whose access broker fails before the subscription delivered anything
    catches up from there (None from a broker that predates the field).

    `publishers` is the topic's publisher table then (each publisher's last seq; one not in it owes the
    subscription every message from seq 0), when `publishers_known` (a subscription from now, and at most
    SUBSCRIBED_TABLE_MAX publishers, none forgotten): the client then tells a publisher's first messages lost on
    the way (a partition's other side, merged after a later one arrived) from ones published before it subscribed.
    """

    op: ClassVar[Literal["subscribed"]] = "subscribed"
    corr: int
    topic: str
    coord: Coord
    last_ts: float | None = None
    publishers: dict[str, int] = field(default_factory=dict)
    publishers_known: bool = False

    def __post_init__(self) -> None:
        if self.last_ts is not None:
            _check_ts(self.last_ts, "last_ts")


@register_message
@dataclass(frozen=True, slots=True)
class Unsubscribe(Message):
    """End a subscription."""

    op: ClassVar[Literal["unsubscribe"]] = "unsubscribe"
    corr: int
    topic: str

    def __post_init__(self) -> None:
        check_corr(self.corr)


@register_message
@dataclass(frozen=True, slots=True)
class Done(Message):
    """A request without other answer (UNSUBSCRIBE) succeeded."""

    op: ClassVar[Literal["done"]] = "done"
    corr: int


@register_message
@dataclass(frozen=True, slots=True)
class Publish(Message):
    """Publish one message; (publisher, seq) identifies it for acknowledgement and de-duplication.

    A publisher numbers its messages on each topic 0, 1, 2, ... without gaps; `base` is its lowest
    unacknowledged number when it sent this one (everything below was acknowledged).  The primary accepts
    seq = last + 1, re-acknowledges seq <= last, and for a gap asks for a re-send (`out_of_order`) unless
    base shows the missing ones were acknowledged before: then they were lost with a failed broker and the
    gap is accepted, so subscribers see it and report the loss instead of waiting forever.

    `more` carries the payloads of seq + 1, seq + 2, ... of the same publisher and topic: a client batches
    what it publishes to one topic in one turn of its event loop, so the brokers check, route and account
    a batch once instead of once per message (each message is still stored, acknowledged and delivered on
    its own).
    """

    op: ClassVar[Literal["publish"]] = "publish"
    topic: str
    publisher: str
    seq: int
    payload: bytes
    base: int = 0
    more: tuple[bytes, ...] = ()

    def __post_init__(self) -> None:
        # The topic name and the payload size are checked by the broker, which answers NACK with the reason;
        # a malformed envelope (ids, numbers) is a protocol error.
        _check_publisher(self.publisher, self.seq)
        if not 0 <= self.base <= self.seq:
            raise LocalProtocolError(f"base must be in 0..seq ({self.seq}), got {self.base}")
        if self.more:
            if len(self.more) >= MAX_BATCH:
                raise LocalProtocolError(f"a publish carries at most {MAX_BATCH} payloads, got {len(self.more) + 1}")
            if self.seq + len(self.more) > MAX_CORR:
                raise LocalProtocolError(f"sequence numbers of a batch must stay within 0..{MAX_CORR}")

    @property
    def count(self) -> int:
        """How many messages this publish carries (1 + len(more))."""
        return 1 + len(self.more)

    def payloads(self) -> tuple[bytes, ...]:
        """The payloads of seq, seq + 1, ... in order."""
        return (self.payload, *self.more)

    def oversized(self, limit: int) -> int | None:
        """The index (0 for `payload`) of the first payload longer than limit bytes, or None if none is."""
        if len(self.payload) <= limit and (not self.more or max(map(len, self.more)) <= limit):
            return None
        return next(i for i, x in enumerate(self.payloads()) if len(x) > limit)


def coalesce_publishes(frames: list[Frame], max_payload: int = MAX_PAYLOAD_SIZE) -> list[Frame]:
    """One read's frames from a client, with each run of consecutive PUBLISHes of one publisher and topic,
    numbered one after the other, as one batched PUBLISH (`Publish.more`).

    A device that sends one PUBLISH per message (as MQTT clients do) costs the broker a pass through access,
    primary, store, ACK and delivery per frame; what reached it in one read together is handled as the batch a
    batching client would have sent, which the protocol already defines: every message is still stored,
    acknowledged and delivered on its own, in order.  A refusal of the batch names its first seq and applies
    from there on, as for any batch (docs/protocol.md).  A run stops before a payload over max_payload (the
    broker's --max-payload: its NACK, too_large, stays that frame's own) and within MAX_BATCH messages and
    MAX_BATCH_BYTES.  The earliest `base` of a run is kept (a client's bases only grow).
    """
    out: list[Frame] = []
    n = len(frames)
    i = 0
    while i < n:
        f = frames[i]
        m = f.message if type(f) is ControlFrame else None
        if type(m) is not Publish:
            out.append(f)
            i += 1
            continue
        assert isinstance(f, ControlFrame) and isinstance(m, Publish)
        payloads = list(m.payloads())
        size = sum(map(len, payloads))
        j = i + 1
        if size <= MAX_BATCH_BYTES and max(map(len, payloads)) <= max_payload:
            topic, publisher, nxt = m.topic, m.publisher, m.seq + len(payloads)
            while j < n:
                g = frames[j]
                q = g.message if type(g) is ControlFrame else None
                if type(q) is not Publish or q.seq != nxt or q.topic != topic or q.publisher != publisher:
                    break
                if not q.more:  # the common case, one message a frame: no tuple, no sums
                    add = len(q.payload)
                    if len(payloads) >= MAX_BATCH or size + add > MAX_BATCH_BYTES or add > max_payload:
                        break
                    payloads.append(q.payload)
                else:
                    more = q.payloads()
                    add = sum(map(len, more))
                    if (
                        len(payloads) + len(more) > MAX_BATCH
                        or size + add > MAX_BATCH_BYTES
                        or max(map(len, more)) > max_payload
                    ):
                        break
                    payloads += more
                size += add
                nxt += q.count
                j += 1
        out.append(
            f
            if j == i + 1
            else ControlFrame(Publish(m.topic, m.publisher, m.seq, payloads[0], m.base, tuple(payloads[1:])))
        )
        i = j
    return out


class PublishFrames:
    """The CONTROL frames of one publisher's single-message PUBLISHes to one topic: byte for byte what
    `encode_control(Publish(topic, publisher, seq, payload, base))` gives, without building, checking and
    encoding a Publish per message.  The envelope's fixed part (op, topic, publisher) is packed once; a frame
    packs the three numbers and the payload.  A device that sends one PUBLISH per message spent about a third of
    its client CPU per message on the generic path (benchmarks-latency.md, "Twentieth round").
    """

    __slots__ = ("_head",)

    def __init__(self, topic: str, publisher: str) -> None:
        _check_publisher(publisher, 0)
        # The array form of Publish (overlay.protocol `_compile`): [op, topic, publisher, seq, payload, base, more].
        n = len(fields(Publish))
        assert n < 15, "a fixarray header"
        self._head = bytes([0x90 | (n + 1)]) + pack_value(Publish.op) + pack_value(topic) + pack_value(publisher)

    def frame(self, seq: int, payload: bytes, base: int) -> bytes:
        """The frame of message seq (base: the lowest unacknowledged seq, as in Publish); LocalProtocolError,
        as from encode_control, for numbers out of range or a frame over MAX_FRAME_SIZE."""
        if not 0 <= base <= seq <= MAX_CORR:
            raise LocalProtocolError(f"need 0 <= base ({base}) <= seq ({seq}) <= {MAX_CORR}")
        body = b"".join((self._head, pack_value(seq), pack_value(payload), pack_value(base), b"\x90"))
        return control_frame(check_body(Publish.op, body))


@register_message
@dataclass(frozen=True, slots=True)
class Ack(Message):
    """Cumulative: the primary stored every message of this publisher on this topic up to seq (and, at
    resilience 2 and 3, so did the secondary).  One ACK answers a whole batch, since a primary accepts a
    publisher's messages strictly in sequence order."""

    op: ClassVar[Literal["ack"]] = "ack"
    topic: str
    publisher: str
    seq: int
    ts: float


@register_message
@dataclass(frozen=True, slots=True)
class Nack(Message):
    """The message was refused; it will not be delivered.  code says why, text what to do."""

    op: ClassVar[Literal["nack"]] = "nack"
    topic: str
    publisher: str
    seq: int
    code: PubSubCode
    text: str
    expected: int = -1  # with out_of_order: the first sequence number to re-send


@register_message
@dataclass(frozen=True, slots=True)
class Deliver(Message):
    """Messages for a subscriber, in publish order per publisher (one frame carries a batch)."""

    op: ClassVar[Literal["deliver"]] = "deliver"
    topic: str
    records: tuple[Record, ...]


@register_message
@dataclass(frozen=True, slots=True)
class Heads(Message):
    """The newest seq of each publisher named, as the topic's primary holds it, for the subscribers of the topic.

    The primary sends it once such a publisher has been quiet for a while (broker settings: `HEADS_QUIET`,
    every anti-entropy round).  A subscriber finds a gap in a publisher's sequence when that publisher's next
    message arrives; one whose last messages never arrived (a DELIVER lost with a link, records merged from
    another holder without a push) had nothing to find it by while the publisher stayed quiet.  A subscriber
    behind a head fetches up to it.  At most SUBSCRIBED_TABLE_MAX publishers per HEADS.
    """

    op: ClassVar[Literal["heads"]] = "heads"
    topic: str
    publishers: dict[str, int]


@register_message
@dataclass(frozen=True, slots=True)
class Fetch(Message):
    """Stored messages of a topic with timestamp > since, oldest first, at most limit."""

    op: ClassVar[Literal["fetch"]] = "fetch"
    corr: int
    topic: str
    since: float = 0.0
    limit: int = MAX_BATCH

    def __post_init__(self) -> None:
        check_corr(self.corr)
        _check_ts(self.since, "since")
        if not 1 <= self.limit <= MAX_BATCH:
            raise LocalProtocolError(f"fetch limit must be in 1..{MAX_BATCH}, got {self.limit}")


@register_message
@dataclass(frozen=True, slots=True)
class Fetched(Message):
    """Answer to FETCH; `more` says another FETCH since the last record's ts would return more.

    `resilience` is the answering holder's level: at 2 and 3 an acknowledged message survives any single change,
    so a client that finds a gap the holder cannot fill yet waits longer for it (a partition's other side
    merging in) before counting it lost.  A FETCHED from a broker that predates the field decodes to 1."""

    op: ClassVar[Literal["fetched"]] = "fetched"
    corr: int
    topic: str
    records: tuple[Record, ...]
    more: bool
    resilience: int = 1


@register_message
@dataclass(frozen=True, slots=True)
class Locate(Message):
    """Where is a topic: home, current coordinate, holders and delegate list."""

    op: ClassVar[Literal["locate"]] = "locate"
    corr: int
    topic: str

    def __post_init__(self) -> None:
        check_corr(self.corr)


@register_message
@dataclass(frozen=True, slots=True)
class Located(Message):
    """Answer to LOCATE."""

    op: ClassVar[Literal["located"]] = "located"
    corr: int
    topic: str
    home: Coord
    coord: Coord
    primary: NodeInfo
    secondary: NodeInfo | None
    tertiary: NodeInfo | None
    delegates: tuple[Delegation, ...]
    size: int
    subscribers: int


@register_message
@dataclass(frozen=True, slots=True)
class Redirect(Message):
    """The topic now lives at another coordinate C(t): address later requests there (Sec. III-B)."""

    op: ClassVar[Literal["redirect"]] = "redirect"
    topic: str
    coord: Coord


@register_message
@dataclass(frozen=True, slots=True)
class Failed(Message):
    """A request (matched by corr) failed; code says why and text what to do.  The connection stays open."""

    op: ClassVar[Literal["failed"]] = "failed"
    corr: int
    topic: str
    code: PubSubCode
    text: str


# ------------------------------------------------------------------------------- broker <-> broker (ROUTED)


@register_message
@dataclass(frozen=True, slots=True)
class TopicRequest(Message):
    """Client requests on their way to the topic's primary, with the access broker to answer.

    `batches` are the requests of one or more sessions of the access broker for this coordinate, gathered
    over one loop turn (one frame per coordinate and turn, not per session): each session's own messages
    (SUBSCRIBE, UNSUBSCRIBE, PUBLISH, FETCH, LOCATE) as encoded, in order, with who the access broker
    authenticated that session as (TLS certificate name or token name), against which the topic's holder
    checks its ACL.  The primary answers with TOPIC_REPLY routed to `access.coord`.  `via_home` is set once
    the home node has looked the topic up in its delegate list, so a delegate does not send it back (Sec.
    III-B).
    """

    op: ClassVar[Literal["topic_request"]] = "topic_request"
    access: NodeInfo
    batches: tuple[SessionRequests, ...]
    via_home: bool = False
    dest: Coord | None = None  # the coordinate the sender addressed (h(t) or a delegate coordinate C(t))


@register_message
@dataclass(frozen=True, slots=True)
class TopicReply(Message):
    """Answers and deliveries for client sessions on the access broker at the routed destination: what one
    holder had for that broker in one loop turn, in the order it answered (one frame, not one per answer)."""

    op: ClassVar[Literal["topic_reply"]] = "topic_reply"
    access: str  # node id the reply is meant for; another node reached means that access broker is gone
    answers: tuple[Answer, ...]


@register_message
@dataclass(frozen=True, slots=True)
class SessionGone(Message):
    """Sent back to a topic's coordinate when a delivery found no such session: drop the subscription."""

    op: ClassVar[Literal["session_gone"]] = "session_gone"
    topic: str
    access: str
    session: str


@register_message
@dataclass(frozen=True, slots=True)
class Replicate(Message):
    """Primary -> replica: new records, and the topic's subscriber list, delegates and publisher table; answered
    by REPLICATED.

    `full` marks the first frame of a hand-over's complete copy: the receiver forgets the publishes and deliveries
    a stale copy of it waited for (the records merge as a set union).  A new secondary's history travels as the
    answer to an OFFER.  `coord` is C(t), `delegates` the delegate list (Sec. III-A).
    `meta` False: the batch carries records only (`subscribers`, `delegates` and `last_seq` are empty and mean
    "unchanged"), because the replica confirmed the current ones already; the publisher table follows from the
    records.  A copy that never received them from its primary confirms no such batch (the re-send has them).
    """

    op: ClassVar[Literal["replicate"]] = "replicate"
    corr: int
    topic: str
    coord: Coord
    origin: NodeInfo
    records: tuple[Record, ...]
    subscribers: tuple[SubRef, ...]
    delegates: tuple[Delegation, ...]
    full: bool
    last_seq: dict[str, int]
    # A hand-over to a new coordinate (overlay.delegation): the receiver holds it staged until ACTIVATE, then
    # acknowledges `waiters` and delivers the records newer than `delivered_upto`.  A primary's batch carries
    # `delivered_upto` too: it has delivered and acknowledged every record stored up to it, so a copy that takes
    # over re-delivers and re-copies what came after, however long ago the primary stalled.
    handover: bool = False
    delivered_upto: float = 0.0
    waiters: tuple[Waiter, ...] = ()
    # A re-sync between holders (an answer to PULL or OFFER): records to merge; `subscribers` are added to the
    # receiver's, never replace them (the sender need not be the primary).
    sync: bool = False
    meta: bool = True  # subscribers, delegates and last_seq are carried (else: unchanged since confirmed)


@register_message
@dataclass(frozen=True, slots=True)
class Replicated(Message):
    """Replica -> primary: REPLICATE corr is stored.  Also the answer to PULL when the node holds nothing.

    With `refused` (version 6): the copy could not be stored (its data directory is full, or its memory over the
    broker's --max-memory); the text names the broker and what to do.  Nothing is confirmed: the primary refuses
    new publishes (storage_full) and sends the batch again until a copy confirms it."""

    op: ClassVar[Literal["replicated"]] = "replicated"
    corr: int
    topic: str
    node: str
    refused: str = ""


@register_message
@dataclass(frozen=True, slots=True)
class Pull(Message):
    """A broker that became closest to a topic's coordinate asks the previous holder for the topic before
    serving it (Sec. III-C: a returning primary checks with its secondary first).  Answered by a full
    REPLICATE, or by REPLICATED when the asked node holds nothing of the topic."""

    op: ClassVar[Literal["pull"]] = "pull"
    corr: int
    topic: str
    coord: Coord
    origin: NodeInfo
    # What the asking node already holds: the answer carries only the rest (None: everything).
    have: Digest | None = None


@register_message
@dataclass(frozen=True, slots=True)
class Offer(Message):
    """A holder -> a broker that holds (or must now hold) the topic: "I hold `have`".  The receiver answers
    REPLICATED (corr) when it holds all of it already, else PULL (same corr, its own digest), which the offerer
    answers with the missing records (REPLICATE, sync) and the receiver confirms with REPLICATED (corr).  Used
    when a broker stops holding a topic (a join or leave moved it out of the top ranks, a graceful shutdown),
    and between primary and replicas to repair gaps (anti-entropy)."""

    op: ClassVar[Literal["offer"]] = "offer"
    corr: int
    topic: str
    coord: Coord
    origin: NodeInfo
    have: Digest
    # The offerer is shutting down: the receiver ranks itself as if the offerer were gone already.
    leaving: bool = False
    # The offerer's delegate list: a receiver holding the topic at another coordinate tells which copy a move
    # left behind (overlay.pubsub.later; broker/pubsub/ranks.py `relocate`).
    delegates: tuple[Delegation, ...] = ()
    # The offerer's subscribers, when it is not the primary (a demoted primary, a retiring copy): the primary
    # adds those it lacks, also when it holds every record offered and pulls nothing.
    subscribers: tuple[SubRef, ...] = ()
