"""The broker's measurements in one object, and the read-only view of a broker that observers use.

`BrokerStats` holds every counter of the broker's own (routing, membership) under one name each, and the four
distributions that need a measurement where they happen: hops of routed messages, publish-to-ACK latency, heal
time, the event loop's lag (`Buckets`, a plain count array the metrics endpoint turns into Prometheus histograms
at scrape time).
The pub/sub and balancer counters live with their layers; `Observed.counter_values()` joins them.

`Observed` is what the metrics endpoint (broker/metrics.py) and the event log (broker/eventlog.py) read: they
depend on this protocol, not on the Broker class, so observability sits beside the node, not around it.
"""

from __future__ import annotations

import time
from bisect import bisect_left
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Final, Protocol

import msgpack

from overlay.protocol import NodeInfo, RemoteProtocolError, decode_message, encode_message
from overlay.pubsub import Ack, Nack

if TYPE_CHECKING:
    from broker.config import BrokerConfig

# Hops of routed messages: greedy routing over the Delaunay graph takes O(sqrt(n)) hops; 64 is the default limit.
HOP_BOUNDS: Final = (0, 1, 2, 3, 4, 5, 6, 8, 10, 12, 16, 20, 24, 32, 48, 64)
# Publish-to-ACK: one replication round trip on a quiet overlay (~ms) up to a failover (~1 s) and beyond.
LATENCY_BOUNDS: Final = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
# Heal time: the failure-detection window is ~0.6 s by default; re-linking adds a few round trips.
HEAL_BOUNDS: Final = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0)
# How late the broker's beat ran (its event loop busy with something else): a neighbour takes a broker silent for
# the heartbeat window (0.6 s by default) for dead, so the buckets reach past it.
LAG_BOUNDS: Final = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)
# Publishes timed at once by one broker; beyond this new ones go untimed (counted), so clients that never
# see their acknowledgement cannot grow the table without bound.
MAX_TIMED: Final = 65536


class Buckets:
    """Counts of observations per bucket (upper bounds inclusive, as Prometheus's `le`) and their sum."""

    __slots__ = ("bounds", "counts", "total")

    def __init__(self, bounds: Sequence[float]) -> None:
        self.bounds = tuple(float(b) for b in bounds)
        self.counts = [0] * (len(self.bounds) + 1)
        self.total = 0.0

    def observe(self, value: float) -> None:
        """Count one observation."""
        self.counts[bisect_left(self.bounds, value)] += 1
        self.total += value

    @property
    def count(self) -> int:
        """Observations so far."""
        return sum(self.counts)

    def cumulative(self) -> list[tuple[str, float]]:
        """(le, observations <= le) pairs ending with +Inf, as HistogramMetricFamily takes them."""
        out: list[tuple[str, float]] = []
        acc = 0
        for bound, c in zip(self.bounds, self.counts, strict=False):
            acc += c
            out.append((repr(bound), acc))  # le values: Python and Prometheus parse the same text
        out.append(("+Inf", acc + self.counts[-1]))
        return out


# ACK and NACK frames to a session are recognised by their first bytes (a 5-byte frame header, then the
# message's array header and its op: encode_message writes every field, so the header is the same for every
# ACK, and for every NACK), so only they are decoded.
_FRAME_HEAD: Final = 5
_ACK_TAG: Final = encode_message(Ack("t", "p", 0, 0.0))[: 1 + len(msgpack.packb("ack"))]
_NACK_TAG: Final = encode_message(Nack("t", "p", 0, "bad_topic", "x"))[: 1 + len(msgpack.packb("nack"))]


class AckTimer:
    """Publish-to-ACK latency at the access broker: a client's PUBLISH starts a clock that the (cumulative)
    ACK covering it, on its way back to the same session, stops.  Re-sends keep the first clock."""

    def __init__(self, into: Buckets, limit: int = MAX_TIMED) -> None:
        self.into = into
        self.limit = limit
        # session -> (topic, publisher) -> (seq, start) in seq order; sequence numbers are per topic and publisher
        self.waiting: dict[str, dict[tuple[str, str], deque[tuple[int, float]]]] = {}
        self.size = 0
        self.untimed = 0

    def started(self, session: str, topic: str, publisher: str, seq: int) -> None:
        """A PUBLISH arrived from a local client."""
        per = self.waiting.get(session)
        q = per.get((topic, publisher)) if per is not None else None
        if q and q[-1][0] >= seq:
            return  # a re-send: its clock already runs
        if self.size >= self.limit:
            self.untimed += 1
            return
        if per is None:
            per = self.waiting[session] = {}
        if q is None:
            q = per[(topic, publisher)] = deque()
        q.append((seq, time.monotonic()))
        self.size += 1

    def answered(self, session: str, topic: str, publisher: str, seq: int, acked: bool) -> None:
        """An ACK (acked) or NACK for (topic, publisher) up to seq went to a local session: an ACK stops the
        clocks it covers, a NACK drops the one it refuses (no ACK will come for it)."""
        per = self.waiting.get(session)
        key = (topic, publisher)
        q = per.get(key) if per is not None else None
        if per is None or q is None:
            return
        if acked:
            now = time.monotonic()
            while q and q[0][0] <= seq:
                self.into.observe(now - q.popleft()[1])
                self.size -= 1
        else:
            kept = deque(e for e in q if e[0] != seq)
            self.size -= len(q) - len(kept)
            q = per[key] = kept
        if not q:
            del per[key]
            if not per:
                del self.waiting[session]

    def frame(self, session: str, frame: bytes) -> None:
        """An encoded frame to a local session that has publishes waiting, when the sender did not have the
        message at hand (an answer from another broker's TOPIC_REPLY): an ACK or NACK is decoded for `answered`."""
        if frame.startswith(_ACK_TAG, _FRAME_HEAD):
            acked = True
        elif frame.startswith(_NACK_TAG, _FRAME_HEAD):
            acked = False
        else:
            return
        try:
            msg = decode_message(frame[_FRAME_HEAD:])
        except RemoteProtocolError:
            return
        if isinstance(msg, Ack | Nack):
            self.answered(session, msg.topic, msg.publisher, msg.seq, acked)

    def session_closed(self, session: str) -> None:
        """Forget the clocks of a session that went away."""
        per = self.waiting.pop(session, None)
        if per is not None:
            self.size -= sum(len(q) for q in per.values())


class BrokerStats:
    """The broker's own counters and distributions (see the module docstring)."""

    def __init__(self) -> None:
        # Routed messages passed on toward their destination, and their bytes.
        self.forwarded = 0
        self.forwarded_bytes = 0
        # Routed messages that ended here (this broker is the closest to their destination): pub/sub and control.
        self.routed_delivered = 0
        # Routed messages dropped: at their hop limit, with a body that does not decode (or nobody handles),
        # because the next hop's link broke, or, sent from here, because they encode to more than a frame.
        self.dropped_hop_limit = 0
        self.dropped_bad_body = 0
        self.dropped_no_route = 0
        self.dropped_too_large = 0
        # Routed messages held because the view knew a closer broker that no link led to yet (routing.HOLD_FOR).
        self.routed_held = 0
        self.routed_held_expired = 0  # ... and of them, handled here after HOLD_FOR because no link led closer
        self.failures_detected = 0  # neighbours found dead (reset, silence)
        # Silent links whose peer a common neighbour still heard: no failover (a false one avoided).
        self.suspicions_refuted = 0
        self.joins_accepted = 0  # brokers admitted as their closest
        self.hops = Buckets(HOP_BOUNDS)
        self.ack_latency = Buckets(LATENCY_BOUNDS)
        self.heal = Buckets(HEAL_BOUNDS)
        self.loop_lag = Buckets(LAG_BOUNDS)  # each heartbeat tick's lateness (Broker._ticker)
        self.acks = AckTimer(self.ack_latency)
        # time.monotonic() of the first failure not yet healed (see Broker._check_healed), or None.
        self.healing_since: float | None = None

    def counters(self) -> dict[str, int]:
        """The counters by their one name (STATUS, the metrics log's snapshots, the metrics endpoint)."""
        return {
            "forwarded": self.forwarded,
            "forwarded_bytes": self.forwarded_bytes,
            "routed_delivered": self.routed_delivered,
            "dropped_hop_limit": self.dropped_hop_limit,
            "dropped_bad_body": self.dropped_bad_body,
            "dropped_no_route": self.dropped_no_route,
            "dropped_too_large": self.dropped_too_large,
            "routed_held": self.routed_held,
            "routed_held_expired": self.routed_held_expired,
            "failures_detected": self.failures_detected,
            "suspicions_refuted": self.suspicions_refuted,
            "joins_accepted": self.joins_accepted,
        }


@dataclass(slots=True)
class TopicCensus:
    """The topics held, counted for a scrape of the metrics: by this broker's role for each (and their stored
    bytes by role), by the state of each replica with the other holders, and the bytes behind and the pulls or
    offers pending, summed (LoadRole.census: a slice at a time, the event loop free in between)."""

    roles: dict[str, int] = field(default_factory=dict)
    stored: dict[str, int] = field(default_factory=dict)
    states: dict[str, int] = field(default_factory=dict)
    behind: int = 0
    pending: int = 0


@dataclass(frozen=True, slots=True)
class Gauges:
    """What a broker holds right now (read at scrape or snapshot time)."""

    neighbours: tuple[NodeInfo, ...]  # established links to Delaunay neighbours
    links: int  # open connections: brokers, clients, admin tools
    sessions: int  # attached client sessions
    stored_memory: int = 0  # what the stored messages take in memory, estimated (TopicStore.memory)
    max_memory: int = 0  # --max-memory in bytes (resolved: never 0 in a running broker)
    certificate_expires: float = 0.0  # notAfter of the TLS certificate or its CA, the earlier; 0 without TLS
    last_reload_ok: bool = True  # False from a refused reload (SIGHUP) until one takes effect
    crl_next_update: float = 0.0  # when the first CRL of --tls-crl is due (nextUpdate); 0 without one


class Observed(Protocol):
    """A broker as the metrics endpoint and the event log read it."""

    @property
    def node_id(self) -> str: ...

    @property
    def info(self) -> NodeInfo: ...

    @property
    def config(self) -> BrokerConfig: ...

    @property
    def stats(self) -> BrokerStats: ...

    def counter_values(self) -> dict[str, int]:
        """Every cumulative counter: the broker's, pub/sub's and the balancer's."""
        ...

    def loads(self) -> dict[str, int]:
        """L1_N, L2_N, L3_N in bytes."""
        ...

    async def topic_rows(self) -> list[tuple[str, str, int]]:
        """(topic, role, stored bytes) of every topic held (a slice of them per turn of the event loop)."""
        ...

    async def topic_census(self) -> TopicCensus:
        """The topics held, counted by role and by state (a slice of them per turn of the event loop)."""
        ...

    def gauges(self) -> Gauges: ...

    def unhealthy(self) -> str | None:
        """Why the broker does not serve (GET /healthz answers 503 with it), or None."""
        ...

    def unready(self) -> str | None:
        """Why the broker does not take clients now (GET /readyz answers 503 with it), or None."""
        ...
