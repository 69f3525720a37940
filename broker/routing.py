"""Routing: greedy forwarding of ROUTED frames, and one table for the routed messages that end here.

Greedy forwarding (`on_routed`) reads only the ROUTED header and passes a frame to the neighbour closest to
its destination; the broker closest to the destination decodes the body and hands the message to the one
handler registered for its class: the node's own (JOIN, ROUTE_PROBE and the replies it relays to its
clients), the balancer's (COORD_QUERY, COORD_OFFER) and pub/sub's (`PubSub.routed_handlers()`).  A class
registered twice is a wiring bug, refused at start; a message nobody handles is counted and dropped, never
raised into the read loop.

`Routing` is a part of the Broker (broker/node.py), in its own module: its methods work on the node's links,
view and counters and are typed on the Broker they belong to.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, Final

from broker.link import LinkClosed, PeerLink
from net import trace
from overlay.delegation import CoordOffer, CoordQuery
from overlay.protocol import (
    FLAG_TRACE,
    MAX_LINK_FRAME_SIZE,
    Coord,
    Error,
    Join,
    JoinAccept,
    LocalProtocolError,
    Message,
    NodeInfo,
    Ping,
    Refuse,
    RemoteProtocolError,
    RoutedFrame,
    RouteProbe,
    RouteReply,
    decode_message,
    encode_message,
    encode_routed,
    forward_routed,
)

if TYPE_CHECKING:
    from broker.balancer import Balancer
    from broker.config import BrokerConfig
    from broker.guard import Guard
    from broker.pubsub import PubSub
    from broker.stats import BrokerStats
    from overlay.dt import NeighbourView

# Requests this broker relays for its clients (route probes, joins) and waits on; beyond this many a client
# gets "busy" rather than the broker growing without bound when replies are lost.
MAX_PENDING: Final = 65536
# Hop-limit drops are logged once per this many so a routing loop cannot flood the log.
DROP_LOG_EVERY: Final = 1000
# Write-buffer level above which a batch's reader waits for the next hop to drain (see PeerLink.drain).
FLUSH_THRESHOLD: Final = 256 * 1024
# A routed message this broker originates and is itself closest to is handled at once, in the same call; one
# whose handling originates it again for a destination that routes here too (the home forwarding to a delegate
# coordinate whose closest broker its view knows but no neighbour leads to, while the overlay forms after a full
# restart) went round until Python's recursion limit, and the RecursionError closed the link the first one came
# on (benchmarks/chaos.py, level 3, seed 75).  Past this depth of such local deliveries it is dropped, counted
# as having no route; the client asks again.  Legitimate chains (a request that answers a local session) are a
# few deep.
MAX_LOCAL_DEPTH: Final = 16
# A routed message that stops here while the view knows a closer broker that no link leads to yet (a Delaunay
# neighbour being linked, as while the overlay forms after a restart: `NeighbourView.knows_closer`) is held, not
# handled here: handled, a request for a topic whose closest broker is that one went round to this broker until
# MAX_LOCAL_DEPTH dropped it, and an answer for that broker's clients was lost.  It goes on once a link leads
# closer (tried after each reconciliation of the links and at pub/sub's ticks) or, after this long, is handled here
# as before.  A routed message whose next hop's link has just broken (the neighbour died, and its link's close has
# not reached the view yet) is held the same way, not dropped: once the view has let the neighbour go, it goes on
# around it, or to the broker now closest to its destination (it was dropped, and a replication batch, an ACK or a
# DELIVER waited for its time-out or repair; chaos.py counted ~100 such drops in a run of 24 faults).  One whose
# link is still broken after this long is dropped, as before ...
HOLD_FOR: Final = 1.0
# ... and at most this many, of at most this many encoded bytes, are held at once; beyond, a message is handled
# as before at once.
MAX_HELD: Final = 4096
MAX_HELD_BYTES: Final = 32 * 1024 * 1024
# Once a hold ran out for a destination, the next messages for it are handled here at once until the view changes:
# a closer broker this one cannot link to (say, across a partition, learned again from an advert) must not delay
# every message of a topic this side serves meanwhile by HOLD_FOR.  At most this many destinations are noted.
MAX_GAVE_UP: Final = 4096

Handler = Callable[[Any], None]


@dataclass(slots=True)
class Held:
    """A routed message held until a link leads closer to its destination, or leads around a link that broke
    (HOLD_FOR)."""

    until: float  # loop time after which it is handled here (or, its next hop's link broken, dropped)
    size: int  # encoded bytes (MAX_HELD_BYTES)
    dest: Coord
    msg: Message | None  # originated here (`send_routed`) ...
    flags: int
    frame: RoutedFrame | None  # ... or passed on by a neighbour (`on_routed`)


class DuplicateHandler(ValueError):
    """Two parts of the broker registered a handler for the same routed message class."""


class DispatchTable:
    """Routed message class -> handler (see the module docstring)."""

    def __init__(self) -> None:
        self._handlers: dict[type[Message], Handler] = {}

    def register(self, cls: type[Message], handler: Handler) -> None:
        """Route messages of class cls to handler; DuplicateHandler if the class has one already."""
        if cls in self._handlers:
            raise DuplicateHandler(f"{cls.__name__} ({cls.op}) already has a handler: {self._handlers[cls]!r}")
        self._handlers[cls] = handler

    def register_all(self, handlers: Mapping[type[Message], Handler]) -> None:
        """register() each entry of handlers."""
        for cls, handler in handlers.items():
            self.register(cls, handler)

    def dispatch(self, msg: Message) -> bool:
        """Hand msg to its handler; False if no handler is registered for its class."""
        handler = self._handlers.get(type(msg))
        if handler is None:
            return False
        handler(msg)
        return True

    def __contains__(self, cls: object) -> bool:
        return cls in self._handlers


class Routing:
    """Forwarding, delivery and the requests relayed for clients (see the module docstring)."""

    # The node's state this part works on (set up by Broker.__init__ in broker/node.py).
    config: BrokerConfig
    log: logging.Logger
    guard: Guard
    node_id: str
    info: NodeInfo
    view: NeighbourView
    peers: dict[str, PeerLink]
    stats: BrokerStats
    pubsub: PubSub
    balancer: Balancer
    routes: DispatchTable
    _pending: dict[int, tuple[PeerLink, int]]
    _corr: Iterator[int]
    _dirty: set[PeerLink]
    _congested: set[PeerLink]
    _hops: int
    _local_depth: int  # local deliveries of messages this broker originated, nested (MAX_LOCAL_DEPTH)
    _held: list[Held]  # routed messages waiting for a link that leads closer (HOLD_FOR) ...
    _held_bytes: int  # ... and their encoded bytes
    _gave_up: dict[Coord, int]  # destination -> the view's version when a hold for it ran out (MAX_GAVE_UP)
    # ... and the parts of the other modules it calls.
    _answer_join: Callable[[Join], JoinAccept | Refuse]
    _outside_text: Callable[[Coord], str]
    _now: Callable[[], float]

    def written(self, link: PeerLink) -> None:
        """Something was written to link in this turn (checked for backpressure by needs_flush)."""
        # A client link with a send limit is bounded by it instead (link.write): waiting for a slow subscriber
        # would stall every link this broker reads from.  (Forwarding adds its next hop, a broker link, which
        # has none, directly.)
        if not link.send_limit:
            self._dirty.add(link)

    def needs_flush(self) -> bool:
        """True if a next hop written to since the last check holds more than FLUSH_THRESHOLD unsent bytes."""
        dirty = self._dirty
        while dirty:
            link = dirty.pop()
            if link.write_buffered > FLUSH_THRESHOLD:
                self._congested.add(link)
        return bool(self._congested)

    async def flush(self) -> None:
        """Backpressure: wait until the congested next hops have drained."""
        while self._congested:
            await self._congested.pop().drain()

    # ---- greedy forwarding -------------------------------------------------------------------------------

    def on_routed(self, link: PeerLink, frame: RoutedFrame) -> None:
        """Greedy forwarding: pass the frame to the neighbour closest to its destination, or deliver it."""
        peer = link.peer
        if peer is None and not link.may_route:
            self.guard.counters["routed_from_non_broker"] += 1
            raise RemoteProtocolError(f"routed frame from {link.role} {link.identity or '?'}: only brokers route")
        nh, onward = self.view.route(frame.x, frame.y)
        if self.guard.forged(frame, peer, self.info, None if nh is None else onward):
            return
        if nh is None:
            if self.view.settled or not self._hold(Held(0.0, len(frame.body), (frame.x, frame.y), None, 0, frame)):
                self._deliver(frame)
            return
        self._forward(frame, nh)

    def _forward(self, frame: RoutedFrame, nh: str, held: Held | None = None) -> None:
        """Pass frame on to neighbour nh.  held: its hold, for a frame held before (HOLD_FOR)."""
        if frame.hops + 1 >= frame.hop_limit:  # same test as protocol.may_forward, inlined on the hot path
            self.stats.dropped_hop_limit += 1
            if self.stats.dropped_hop_limit % DROP_LOG_EVERY == 1:
                self.log.warning(
                    "dropped a frame for (%s, %s) at its hop limit %d (%d dropped so far)",
                    frame.x,
                    frame.y,
                    frame.hop_limit,
                    self.stats.dropped_hop_limit,
                )
            return
        out = self.peers.get(nh)
        if out is None:  # (a link gone under a stale view: `send_routed`)
            self._no_link(held or Held(0.0, len(frame.body), (frame.x, frame.y), None, 0, frame))
            return
        body = None
        if frame.flags & FLAG_TRACE:
            body = self._trace(frame.body)
            if body is None:
                return
        if trace.ENABLED:
            trace.mark("forward", frame.body)
        try:
            out.write(forward_routed(frame, body))
        except LinkClosed:
            self._no_link(held or Held(0.0, len(frame.body), (frame.x, frame.y), None, 0, frame))
            return
        self.stats.forwarded += 1
        self.stats.forwarded_bytes += len(frame.body)
        self._dirty.add(out)

    def _trace(self, body: bytes) -> bytes | None:
        try:
            probe = decode_message(body)
        except RemoteProtocolError as exc:
            self.stats.dropped_bad_body += 1
            self.log.warning("dropped a traced frame with a bad body: %s", exc)
            return None
        if not isinstance(probe, RouteProbe):
            self.stats.dropped_bad_body += 1
            return None
        return encode_message(replace(probe, path=(*probe.path, self.info)))

    def send_routed(self, dest: Coord, msg: Message, flags: int = 0, held: Held | None = None) -> None:
        """Originate a routed message (or handle it here if this broker is the closest).  held: its hold, for a
        message held before (HOLD_FOR)."""
        nh = self.view.next_hop(dest[0], dest[1])
        if nh is None:
            if not self.view.settled and self._hold(held or Held(0.0, 0, dest, msg, flags, None)):
                return
            if self._local_depth >= MAX_LOCAL_DEPTH:
                self.stats.dropped_no_route += 1
                self.log.warning(
                    "dropped a %s for %s that kept coming back here: no neighbour leads there yet", msg.op, dest
                )
                return
            self._local_depth += 1
            try:
                self._handle_delivered(msg, 0)
            finally:
                self._local_depth -= 1
            return
        out = self.peers.get(nh)
        if out is None:
            # The view still names a neighbour whose link is gone: a leaving broker stops updating its view
            # once it closes its links, and its pub/sub engine's last turn may still send (a KeyError here
            # ended that turn with a traceback).  As a closed link below.
            self._no_link(held or Held(0.0, 0, dest, msg, flags, None))
            return
        try:
            body = encode_message(msg, MAX_LINK_FRAME_SIZE)
        except LocalProtocolError as exc:
            # More than a frame (a topic's subscriber list or publisher table in a REPLICATE beyond what
            # MAX_TOPIC_ENTRIES lets in, as after two partitions' lists merged): dropped
            # as a lost message would be, loudly, and the broker goes on (raised, it stopped this turn's work).
            self.stats.dropped_too_large += 1
            topic = getattr(msg, "topic", None)
            self.log.error(  # noqa: TRY400 - a size, not a bug: the message says it, a traceback would not
                'not sent: %s%s (counted in sedax_dropped_messages_total{reason="too_large"})',
                exc,
                f" (topic {topic})" if topic else "",
            )
            return
        if trace.ENABLED:
            trace.mark(f"send {msg.op}", body)
        try:
            out.write(encode_routed(dest, body, hop_limit=self.config.max_hops, flags=flags))
        except LinkClosed:
            self._no_link(held or Held(0.0, len(body), dest, msg, flags, None))
            return
        self._dirty.add(out)

    # ---- held until a link leads closer (HOLD_FOR) --------------------------------------------------------

    def _hold(self, h: Held) -> bool:
        """Hold h if a known broker is closer to its destination than this one (see HOLD_FOR); False: handle
        it here now."""
        view = self.view
        if not view.knows_closer(h.dest[0], h.dest[1]):
            return False
        now = self._now()
        if not h.until:
            if self._gave_up.get(h.dest) == view.version:
                return False
            if h.msg is not None:
                try:
                    h.size = len(encode_message(h.msg, MAX_LINK_FRAME_SIZE))  # (held messages are rare)
                except LocalProtocolError:
                    return False  # more than a frame: it could go on to no neighbour; handled here, as before
        elif now >= h.until:  # (`_keep` counts it and lets it go)
            if len(self._gave_up) >= MAX_GAVE_UP:
                self._gave_up.clear()
            self._gave_up[h.dest] = view.version
        return self._keep(h, now)

    def _no_link(self, h: Held) -> None:
        """h's next hop has no open link (it broke under the message, or the view is stale): held if it may be
        (`_keep`), else dropped and counted."""
        if not self._keep(h):
            self.stats.dropped_no_route += 1

    def _keep(self, h: Held, now: float | None = None) -> bool:
        """Hold h until HOLD_FOR after it was first held, within MAX_HELD and MAX_HELD_BYTES; False if it may not be
        (its time is up, or the bounds are reached).  Called by `_hold`, and for a message whose next hop's link
        broke under it."""
        if now is None:
            now = self._now()
        if not h.until:
            if len(self._held) >= MAX_HELD or self._held_bytes + h.size > MAX_HELD_BYTES:
                return False
            h.until = now + HOLD_FOR
            self.stats.routed_held += 1
        elif now >= h.until:
            self.stats.routed_held_expired += 1
            return False
        self._held.append(h)
        self._held_bytes += h.size
        return True

    def release_held(self) -> None:
        """Route the held messages again: on to a link that now leads closer, held on, or (their time up, or
        the closer broker forgotten) handled here."""
        if not self._held:
            return
        held, self._held = self._held, []
        self._held_bytes = 0
        for h in held:
            if h.frame is not None:
                frame = h.frame
                nh = self.view.next_hop(frame.x, frame.y)
                if nh is not None:
                    self._forward(frame, nh, h)
                elif not self._hold(h):
                    self._deliver(frame)
            elif h.msg is not None:
                self.send_routed(h.dest, h.msg, h.flags, h)  # (h keeps its deadline and its size)

    def _deliver(self, frame: RoutedFrame) -> None:
        try:
            msg = decode_message(frame.body)
        except RemoteProtocolError as exc:
            self.stats.dropped_bad_body += 1
            self.log.warning("dropped a routed frame with a bad body: %s", exc)
            return
        if trace.ENABLED:
            trace.mark(f"arrive {msg.op}", frame.body)
        self._handle_delivered(msg, frame.hops + 1)

    def _handle_delivered(self, msg: Message, hops: int) -> None:
        self.stats.routed_delivered += 1
        self.stats.hops.observe(hops)
        self._hops = hops
        if not self.routes.dispatch(msg):
            self.stats.dropped_bad_body += 1
            self.log.warning("dropped a routed %s that this broker does not handle", msg.op)

    def _register_routes(self) -> None:
        """The routed messages that end here, by class: the node's, the balancer's and pub/sub's."""
        r = self.routes
        r.register(Join, self._join_arrived)
        r.register(RouteProbe, self._probe_arrived)
        for reply in (RouteReply, JoinAccept, Refuse, Error):
            r.register(reply, self._complete)
        r.register(Ping, lambda _msg: None)  # a routed PING only tests delivery (benchmarks): counted, not answered
        r.register(CoordQuery, self.balancer.on_query)
        r.register(CoordOffer, self.balancer.on_offer)
        r.register_all(self.pubsub.routed_handlers())

    def _join_arrived(self, msg: Join) -> None:
        if msg.origin is None:
            self.stats.dropped_bad_body += 1  # a JOIN without its bootstrap broker cannot be answered
            return
        if msg.origin.id != self.node_id and self.view.next_hop(*msg.origin.coord) is None:
            # The answer would end here instead of at the bootstrap broker: this broker's links are not all up
            # yet (it joined a moment ago).  The newcomer stops waiting once a neighbour links to it.
            self.log.info(
                "answering the JOIN of %s, but no linked neighbour leads back to %s (linked: %s)",
                msg.node.id,
                msg.origin.id,
                sorted(self.view.linked),
            )
        self.send_routed(msg.origin.coord, self._answer_join(msg))

    def _probe_arrived(self, msg: RouteProbe) -> None:
        if msg.origin is None:
            self.stats.dropped_bad_body += 1
            return
        path = msg.path if msg.path and msg.path[-1].id == self.node_id else (*msg.path, self.info)
        self.send_routed(msg.origin.coord, RouteReply(msg.corr, self.info, self._hops, path))

    def _complete(self, msg: RouteReply | JoinAccept | Refuse | Error) -> None:
        entry = self._pending.pop(msg.corr, None)
        if entry is None:
            self.log.info("reply %s for unknown request %d (client gone?)", msg.op, msg.corr)
            return
        link, client_corr = entry
        if link.established:
            try:
                link.send_nowait(replace(msg, corr=client_corr))
            except LinkClosed:
                return  # the client's connection broke a moment ago; its close is on the way
            self.written(link)

    def _register(self, link: PeerLink, client_corr: int) -> int | None:
        if len(self._pending) >= MAX_PENDING:
            return None
        corr = next(self._corr)
        self._pending[corr] = (link, client_corr)
        return corr

    def _start_probe(self, link: PeerLink, corr: int, target: Coord) -> None:
        if not self.config.space.contains(target):
            link.send_nowait(Error(corr, "coordinate_outside_space", self._outside_text(target)))
            return
        mine = self._register(link, corr)
        if mine is None:
            link.send_nowait(Error(corr, "busy", f"{MAX_PENDING} requests pending"))
            return
        self.send_routed(target, RouteProbe(mine, target, self.info, (self.info,)), FLAG_TRACE)
