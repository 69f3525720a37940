"""One connection of a broker (to a broker, a client or an admin tool): handshake, read loop, heartbeat, send
path and close with a reason.

A `PeerLink` moves bytes between a `Transport` (net/transport.py: TCP/TLS streams, or memory in tests) and the
sans-IO codec of `overlay.protocol`; what the messages mean is decided by its `LinkHandler` (the broker).  The
parts every connection shares — limits, close reasons, the initiator's handshake, request correlation, the
heartbeat — are net/connection.py's.  Link states follow a transition table with a sticky ERROR state, as h11
does for HTTP connections.
"""

from __future__ import annotations

import asyncio
import enum
import itertools
import logging
from collections.abc import Callable
from typing import Final, Protocol

from broker.tasks import TaskSet
from net.connection import (
    LINK_WRITE_HIGH_WATER,
    CloseReason,
    HandshakeRefused,
    Heartbeat,
    LinkClosed,
    QuietReceive,
    Requests,
    open_handshake,
)
from net.credentials import PeerCert
from net.transport import Transport
from overlay.protocol import (
    ControlFrame,
    Frame,
    FrameDecoder,
    Hello,
    HelloOk,
    LocalProtocolError,
    Message,
    NodeInfo,
    Ping,
    Pong,
    Refuse,
    RemoteProtocolError,
    RoutedFrame,
    Unlink,
    UnlinkReason,
    encode_control,
)

__all__ = ["CloseReason", "HandshakeRefused", "LinkClosed", "LinkHandler", "LinkState", "PeerLink", "next_state"]


class LinkState(enum.Enum):
    """Where a connection is in its life."""

    CONNECTING = "connecting"
    HELLO_SENT = "hello_sent"
    ESTABLISHED = "established"
    DRAINING = "draining"
    CLOSED = "closed"
    ERROR = "error"


_TRANSITIONS: Final[dict[LinkState, frozenset[LinkState]]] = {
    LinkState.CONNECTING: frozenset(
        {LinkState.HELLO_SENT, LinkState.ESTABLISHED, LinkState.DRAINING, LinkState.CLOSED, LinkState.ERROR}
    ),
    LinkState.HELLO_SENT: frozenset({LinkState.ESTABLISHED, LinkState.DRAINING, LinkState.CLOSED, LinkState.ERROR}),
    LinkState.ESTABLISHED: frozenset({LinkState.DRAINING, LinkState.CLOSED, LinkState.ERROR}),
    LinkState.DRAINING: frozenset({LinkState.CLOSED, LinkState.ERROR}),
    # CLOSED and ERROR are final; ERROR is sticky so a broken link is never mistaken for a clean close.
    LinkState.CLOSED: frozenset(),
    LinkState.ERROR: frozenset(),
}


def next_state(current: LinkState, new: LinkState) -> LinkState:
    """Check a transition against the table; an illegal one is our bug (LocalProtocolError)."""
    if new not in _TRANSITIONS[current]:
        raise LocalProtocolError(f"illegal link transition {current.value} -> {new.value}")
    return new


class LinkHandler(Protocol):
    """What a link needs from its owner (the broker)."""

    def on_hello(self, link: PeerLink, hello: Hello) -> HelloOk | Refuse:
        """Accept or refuse an inbound HELLO."""

    def on_established(self, link: PeerLink) -> None:
        """The handshake completed (either direction)."""

    def on_message(self, link: PeerLink, msg: Message) -> None:
        """A control message on an established link (PING/PONG and replies to requests excluded)."""

    def on_routed(self, link: PeerLink, frame: RoutedFrame) -> None:
        """A routed frame on an established link."""

    def needs_flush(self) -> bool:
        """True if a batch left next hops above their high-water mark (then `flush` is awaited)."""

    async def flush(self) -> None:
        """Drain the links the last batch wrote to (backpressure on the reader)."""

    def on_closed(self, link: PeerLink, reason: CloseReason, detail: str) -> None:
        """The link closed; called exactly once."""


# Close reasons worth a warning on any link: the peer misbehaved or was turned away.
NOISY_CLOSES: Final = frozenset(
    {
        CloseReason.PROTOCOL_ERROR,
        CloseReason.HELLO_TIMEOUT,
        CloseReason.HEARTBEAT_TIMEOUT,
        CloseReason.INTERNAL_ERROR,
        CloseReason.REFUSED,
        CloseReason.SLOW_CONSUMER,
    }
)

_link_ids = itertools.count(1)
_NEVER: Final = float("inf")
FRESH_WRITE: Final = 0.5
BEAT: Final = encode_control(Ping(0))  # a broker link's heartbeat, the same bytes every time
# A timer may fire a little early (uvloop's clock has millisecond steps): what is due within this counts as due.
TICK_SLACK: Final = 0.002
# What a link answers itself once established (PING, PONG) or refuses (a second handshake); all else is the handler's.
_LINK_LEVEL: Final = frozenset({Ping, Pong, Hello, HelloOk})

# Liveness costs wake-ups, and on an idle overlay they are nearly all a broker does: measured on this project's
# 2-core machine (docs/benchmarks-scale.md), one wake-up of an idle uvloop process costs ~100 us of CPU before
# any work, a frame read in a wake-up of its own ~150 us.  So every broker link carries one frame each way per
# heartbeat interval and no more, and a broker does all of a beat's liveness work in one wake-up:
#
# * Beats, not PING/PONG.  On a broker link each end sends a PING at every beat unless it wrote something else
#   lately (any frame proves liveness as well); PINGs on broker links are not answered.  A
#   PONG would be a second frame for the pinger to wake up for.
# * One tick per interval, on the wall clock.  The owner's ticker (Broker._ticker) ticks every link once per
#   heartbeat interval at whole multiples of it on the wall clock, so the brokers of a machine tick together
#   and a beat's PINGs mostly arrive while their receiver is awake for its own beat.  Between beats the ticker
#   wakes only for a deadline: the moment a silent peer's limit runs out (`tick` returns it), so silence is
#   declared exactly `misses` intervals after the peer was last heard, not up to a tick later.
#
# * Heartbeats that wake no one and are not read.  A PING arriving at a broker asleep between its beats would
#   wake it for that frame alone, and reading it costs Python work even in a wake-up made anyway.  While a
#   broker link carries nothing but PINGs they wait in the kernel (net.connection.QuietReceive: SO_RCVLOWAT
#   just above the PINGs waiting plus one, TCP_INFO for when data last arrived); every other frame, the end of
#   the stream and a reset wake the reader as before, and it takes the waiting PINGs with them.  A beat PING
#   is always the same BEAT bytes (seq 0), so the PINGs waiting are a whole number of them.
#
# A beat skips its PING when the link wrote something within the last FRESH_WRITE intervals, so each end
# hears from the other at least every 1.5 intervals (a frame just over half an interval before one beat, then
# the PING of the next), against a limit of `misses` intervals (3 by default; 2 still leaves half an
# interval).  Client and tool links keep PING and PONG: the broker pings, the client answers, and clients have
# a wider window (`client_timeout`), so the broker pings an idle client `misses` times per that window, not per beat.


def _beats(frames: list[ControlFrame | RoutedFrame]) -> bool:
    """True if frames are heartbeats alone (PING, or a PONG from a broker of an older version)."""
    return bool(frames) and all(type(f) is ControlFrame and type(f.message) in (Ping, Pong) for f in frames)


class PeerLink:
    """One connection: its streams, read loop, heartbeat, pending requests and state."""

    def __init__(
        self,
        transport: Transport,
        handler: LinkHandler,
        tasks: TaskSet,
        log: logging.Logger,
        *,
        outbound: bool,
        heartbeat_interval: float,
        heartbeat_misses: int,
        hello_timeout: float,
        drain_timeout: float,
        client_timeout: float = 5.0,
        local_id: str = "",
        ticked: bool = False,
    ) -> None:
        """local_id: this end's node id (it decides which end of a broker link pings); ticked: the owner calls
        `tick` for this link on its own ticker (a broker, for all its links), so the link runs no timer task."""
        self.number = next(_link_ids)
        self.outbound = outbound
        self.state = LinkState.CONNECTING
        self.role: str | None = None
        self.peer_id: str | None = None
        self.peer: NodeInfo | None = None
        self.close_reason: CloseReason | None = None
        self.close_detail = ""
        self._t = transport
        self._handler = handler
        self._tasks = tasks
        self._log = log
        self._decoder = FrameDecoder()
        # What the owner makes of one read's frames before they are dispatched (a broker: a client's consecutive
        # one-message PUBLISHes as one batch, overlay.pubsub.coalesce_publishes); None: dispatched as they are.
        self.coalesce: Callable[[list[Frame]], list[Frame]] | None = None
        self._heartbeat_interval = heartbeat_interval
        self._heartbeat_misses = heartbeat_misses
        self._client_timeout = client_timeout
        # A client is pinged so that it hears from us `misses` times within client_timeout, the window we give
        # it, not at the brokers' beat (see tick).
        self._client_ping_every = max(heartbeat_interval, client_timeout / heartbeat_misses)
        self._hello_timeout = hello_timeout
        self._drain_timeout = drain_timeout
        self._loop = asyncio.get_running_loop()
        self._beat = Heartbeat(heartbeat_interval, heartbeat_misses)
        self._local_id = local_id
        self._ticked = ticked
        now = self._loop.time()
        self._hello_deadline = now + hello_timeout
        self._wrote_at = now  # when this end last wrote (uvloop's clock is a cached read: cheap per write)
        self.pings_sent = 0
        self._requests = Requests()
        self._closed = asyncio.Event()
        self._reading = True  # the peer's bytes are taken (until the end of the stream, an error or the close)
        self._read_done = asyncio.Event()  # ... and no longer (`_read_ended`): what a farewell waits for in aclose
        self._farewell: type[Message] | None = None  # the kind of farewell this end wrote (aclose)
        self._flush_task: asyncio.Task[None] | None = None
        self._watchdog_task: asyncio.Task[None] | None = None
        self._ping_seq = 0
        self._quiet: QuietReceive | None = None
        self._intended: tuple[CloseReason, str] | None = None
        # Two-phase UNLINK (see retire): each side stops writing after its own UNLINK and closes only when it
        # has both sent one and received the peer's, so no frame in flight on the link is lost.
        self.unlink_sent = False
        self.unlink_received = False
        self._unlink_reason: UnlinkReason = "not_neighbour"
        self.remote = transport.remote
        transport.set_write_high_water(LINK_WRITE_HIGH_WATER)
        # Who the peer is, as far as it was proven: the verified TLS certificate (None on plain TCP), and the
        # identity the broker admitted it as at HELLO (broker/guard.py).
        self.cert: PeerCert | None = transport.peer_cert
        self.identity = ""
        self.token = ""  # the SHA-256 of the token it was admitted with, if any (a reload may withdraw it)
        self.may_route = False  # routed frames accepted from this link (brokers, and tools with a broker cert)
        # Bound on bytes queued for a peer that does not read (client links; 0 = none, for broker links,
        # whose backpressure is the reader pause in Broker.flush).
        self.send_limit = 0
        self.drop_when_full = False  # the "drop" slow-consumer policy; otherwise the link is closed
        self.overflow_drops = 0
        self.last_request = self._loop.time()

    def __repr__(self) -> str:
        who = self.peer_id or "?"
        return f"<link #{self.number} {'to' if self.outbound else 'from'} {who}@{self.remote} {self.state.value}>"

    @property
    def established(self) -> bool:
        """True while the link carries traffic."""
        return self.state is LinkState.ESTABLISHED

    def _set_state(self, new: LinkState) -> None:
        self.state = next_state(self.state, new)

    # ------------------------------------------------------------------------------------------ startup

    def start(self) -> None:
        """Start reading (the transport pushes to `received`), and the watchdog (hello timeout, then heartbeat)
        unless the owner ticks."""
        self._t.receive(self)
        if not self._ticked:
            self._watchdog_task = self._tasks.spawn(self._watchdog(), f"watchdog-{self.number}")

    async def open(self, hello: Hello) -> HelloOk:
        """Outbound handshake (net.connection.open_handshake), bounded by the hello timeout; then the link runs.

        Raises HandshakeRefused if the peer refuses, LinkClosed if the link dies first, TimeoutError.
        """
        if not self.outbound:
            raise LocalProtocolError("open() is for outbound links; inbound links wait for HELLO")
        self.role = hello.role
        self._set_state(LinkState.HELLO_SENT)
        try:
            ok, rest = await open_handshake(self._t, hello, self._decoder, self._hello_timeout)
        except HandshakeRefused as exc:
            self.close_soon(CloseReason.REFUSED, f"refused by peer: {exc.code}: {exc.text}")
            raise
        except TimeoutError:
            await self.aclose(CloseReason.HELLO_TIMEOUT, f"no HELLO_OK within {self._hello_timeout} s")
            raise
        except RemoteProtocolError as exc:
            await self.aclose(CloseReason.PROTOCOL_ERROR, str(exc))
            raise LinkClosed(CloseReason.PROTOCOL_ERROR, str(exc)) from exc
        except (ConnectionError, OSError) as exc:
            await self.aclose(CloseReason.CONNECTION_LOST, repr(exc))
            raise LinkClosed(CloseReason.CONNECTION_LOST, repr(exc)) from exc
        self.peer_id = ok.node.id
        self.peer = ok.node
        self._beat.received()
        self._set_state(LinkState.ESTABLISHED)
        self._watch_quietly()
        self._handler.on_established(self)
        self.start()
        for frame in rest:
            self._dispatch(frame)
        return ok

    # ---------------------------------------------------------------------------------------- read side

    def received(self, data: bytes) -> None:
        """Bytes from the peer, pushed by the transport as they arrive (b"": the end of the stream): decode,
        dispatch, and pause reading while the handler's next hops drain (backpressure)."""
        if not self._reading:
            return
        try:
            frames = self._decoder.feed(data)
            if not data:
                self._read_ended(CloseReason.PEER_CLOSED, "end of stream")
                return
            self._beat.received()
            if len(frames) > 1 and self.coalesce is not None:
                if self.state is LinkState.CONNECTING:
                    # A client that wrote its first PUBLISHes together with HELLO: once the HELLO has made the link,
                    # they are coalesced as any later ones.
                    self._dispatch(frames[0])
                    frames = frames[1:]
                if self.state is LinkState.ESTABLISHED and len(frames) > 1:
                    frames = self.coalesce(frames)
            for frame in frames:
                self._dispatch(frame)
                if self.state is LinkState.CLOSED or self.state is LinkState.ERROR:
                    self._reading = False
                    return
            if self._quiet is not None:
                self._quiet.after_read(not self._decoder.buffered and _beats(frames))
            if self._handler.needs_flush():
                # Paused on backpressure we read nothing from this peer, so its silence would be ours:
                # the watchdog ignores the pause and the clock restarts when reading resumes.
                self._beat.paused = True
                self._t.pause_reading()
                self._flush_task = self._tasks.spawn(self._flush(), f"flush-{self.number}")
        except Exception as exc:  # noqa: BLE001 - sorted by _read_failed; the link closes with the reason
            self._read_failed(exc)

    def lost(self, exc: Exception) -> None:
        """The transport's connection was reset or failed."""
        if self._reading:
            self._read_ended(CloseReason.CONNECTION_LOST, repr(exc))

    async def _flush(self) -> None:
        try:
            await self._handler.flush()
        except Exception as exc:  # noqa: BLE001 - as in received
            self._read_failed(exc)
        finally:
            self._flush_task = None
            self._beat.paused = False
            self._beat.received()
        if self._reading:
            self._t.resume_reading()  # what waited meanwhile is handed over now

    def _read_failed(self, exc: Exception) -> None:
        if isinstance(exc, RemoteProtocolError):
            self._read_ended(CloseReason.PROTOCOL_ERROR, str(exc))
        elif isinstance(exc, (ConnectionError, OSError)):
            self._read_ended(CloseReason.CONNECTION_LOST, repr(exc))
        elif isinstance(exc, LocalProtocolError):
            self._log.exception("bug while handling %r", self, exc_info=exc)
            self._read_ended(CloseReason.INTERNAL_ERROR, str(exc))
        else:  # a bug while handling one peer's input closes that link, visibly
            self._log.exception("bug while handling %r", self, exc_info=exc)
            self._read_ended(CloseReason.INTERNAL_ERROR, repr(exc))

    def _read_ended(self, reason: CloseReason, detail: str) -> None:
        """Nothing more is read: close with reason (always a failure: no drain, so at once), unless a close
        decided earlier is under way (its reason stands, as `_intended` makes it in aclose)."""
        self._reading = False
        self._read_done.set()
        if self.close_reason is None and self._intended is None:
            self._close_failed(reason, detail)

    def _dispatch(self, frame: ControlFrame | RoutedFrame) -> None:
        state = self.state
        if state is LinkState.ESTABLISHED:
            if isinstance(frame, RoutedFrame):
                self._handler.on_routed(self, frame)
                return
            msg = frame.message
            kind = type(msg)
            if kind not in _LINK_LEVEL:  # nearly every message: the handler's, past four tests to find it so
                self.last_request = self._loop.time()
                corr = getattr(msg, "corr", None)  # (a PUBLISH has none: no reply of ours to look for)
                if corr is None or not self._requests.complete(corr, msg):
                    self._handler.on_message(self, msg)
            elif isinstance(msg, Ping):
                if self.role != "broker":  # a broker link's PINGs are beats, answered by the peer's own
                    self._t.write(encode_control(Pong(msg.seq)))
                    self._wrote_at = self._loop.time()
            elif not isinstance(msg, Pong):
                raise RemoteProtocolError(f"{msg.op} after the handshake")  # HELLO or HELLO_OK
            return
        if state is LinkState.DRAINING:
            # We are closing; whatever the peer still sends is moot.  The same farewell from the peer (both
            # leaving at once, as when every broker stops) is its last frame: nothing more is waited for.
            if self._farewell is not None and isinstance(frame, ControlFrame) and type(frame.message) is self._farewell:
                self._read_done.set()
            return
        if isinstance(frame, RoutedFrame):
            raise RemoteProtocolError("routed frame before the handshake completed")
        msg = frame.message
        if state is LinkState.CONNECTING and not self.outbound:
            if not isinstance(msg, Hello):
                raise RemoteProtocolError(f"expected HELLO first, got {msg.op}")
            self._on_hello(msg)
        else:
            raise RemoteProtocolError(f"unexpected {msg.op} in state {state.value}")

    def _on_hello(self, hello: Hello) -> None:
        reply = self._handler.on_hello(self, hello)
        self._t.write(encode_control(reply))
        if isinstance(reply, Refuse):
            self.close_soon(CloseReason.REFUSED, f"refused {hello.node}: {reply.code}: {reply.text}")
            return
        self.role = hello.role
        self.peer_id = hello.node
        if hello.role == "broker" and hello.coord is not None:
            self.peer = NodeInfo(hello.node, hello.coord, hello.listen)
        self._set_state(LinkState.ESTABLISHED)
        self._watch_quietly()
        self._handler.on_established(self)

    # ---------------------------------------------------------------------------------------- heartbeat

    def tick(self, now: float, late: float = 0.0, beat: bool = True) -> float:
        """The link's timers, once per heartbeat interval (beat) or at a deadline it returned: the hello
        deadline, then silence and the keep-alive PING.  Returns when the peer's silence would run out (the
        owner wakes then if that is before the next beat; inf while nothing is watched).

        now: the loop's clock; late: how much later than planned this tick runs (the process was busy, so
        the peer's silence over that stretch is not the peer's fault: it could not have been read either).
        """
        state = self.state
        if state is LinkState.CONNECTING or state is LinkState.HELLO_SENT:
            # An outbound link's handshake is bounded by open() itself.
            if not self.outbound:
                if now + TICK_SLACK >= self._hello_deadline:
                    self.close_soon(CloseReason.HELLO_TIMEOUT, f"no handshake within {self._hello_timeout} s")
                    return _NEVER
                return self._hello_deadline
            return _NEVER
        if not self._watched() or self._intended is not None:
            return _NEVER
        hb = self._beat
        if late > 0:
            hb.last_rx += late
        quiet = self._heard_by_kernel(now)
        if quiet is not None and beat:
            quiet.at_beat()  # a beat: room below the mark for the next PING, or drain what waits
        if self.role != "broker":
            # A client's liveness decides no failover, and a client process may be busy for a while (a burst
            # of publishes, a slow consumer): give it a wider window than a neighbour broker.
            hb.limit = max(hb.limit, self._client_timeout)
        silent = hb.silent_for()
        if silent + TICK_SLACK > hb.limit:
            self.close_soon(
                CloseReason.HEARTBEAT_TIMEOUT,
                f"silent for {silent:.2f} s ({self._heartbeat_misses} heartbeats missed)",
            )
            return _NEVER
        if beat:
            # How long a write stands in for this end's PING.  A neighbour broker's window is `misses` beats, so
            # a beat's PING is skipped only for a write within FRESH_WRITE beats.  A client pings on its own
            # (net.connection.Heartbeat) and hears our PONGs; our PINGs only keep its silence within the window we
            # give it: a PING at every beat to a thousand idle devices was half of a fan-in broker's writes (and
            # as many PONGs to read).
            fresh = FRESH_WRITE * self._heartbeat_interval if self.role == "broker" else self._client_ping_every
            if now - self._wrote_at < fresh:
                pass  # written lately: that frame is this beat's proof of life
            elif self.pinger:
                self._ping()
        return hb.deadline()

    def heard_within(self, fraction: float) -> bool:
        """True if the peer was heard within `fraction` of the silence this link tolerates (WITNESS answers)."""
        if not self._watched():
            return False
        self._heard_by_kernel(self._loop.time())
        return self._beat.silent_for() < fraction * self._beat.limit

    def _heard_by_kernel(self, now: float) -> QuietReceive | None:
        """While PINGs may wait unread below the receive mark, take when the peer was last heard from the kernel
        (it knows when data last arrived); returns the QuietReceive that did, None if none is raised."""
        quiet = self._quiet
        if quiet is None or not quiet.raised:
            return None
        self._beat.last_rx = max(self._beat.last_rx, quiet.arrived(now))
        return quiet

    def _watch_quietly(self) -> None:
        # Only where the owner's ticker reads waiting PINGs at its beats, and only where a PING's size on the
        # wire is known (plain TCP, TLS 1.3).
        if self.role != "broker" or not self._ticked:
            return
        found = self._t.tcp_socket()
        if found is not None:
            sock, overhead = found
            self._quiet = QuietReceive(sock, len(BEAT) + overhead)

    @property
    def pinger(self) -> bool:
        """True if this end sends PINGs on an idle link: both ends of a broker link (beats); on a client or tool
        link the broker, and the client answers (see the comment above PeerLink)."""
        return self.role == "broker" or not self.outbound

    async def _watchdog(self) -> None:
        # A link without an owner's ticker (a tool's link in tests) ticks by itself.
        loop = self._loop
        period = self._heartbeat_interval
        wake = loop.time()
        while self.state not in (LinkState.CLOSED, LinkState.ERROR) and self._intended is None:
            wake += period
            await asyncio.sleep(max(0.0, wake - loop.time()))
            now = loop.time()
            late = now - wake
            if late > 0:
                wake = now
            self.tick(now, max(0.0, late))

    def _watched(self) -> bool:
        # The read loop is closing the link once the transport is: nothing left to watch then.  Nor once this end
        # sent UNLINK: nothing may follow it (no beat either; the drain time-out bounds the link).  The peer
        # closes once both UNLINKs are in, and a beat that reached it after that made its kernel reset the
        # connection, discarding what it had not yet sent of what it wrote before its UNLINK: a broker that
        # joined next to 30,000 topics lost the batches of ~1,800 topics that way, each re-sent after a time-out.
        return self.state is LinkState.ESTABLISHED and not self.unlink_sent and not self._t.is_closing()

    def _ping(self) -> None:
        self.pings_sent += 1
        if self.role == "broker":
            self._t.write(BEAT)
        else:
            self._ping_seq += 1
            self._t.write(encode_control(Ping(self._ping_seq)))

    # ---------------------------------------------------------------------------------------- send side

    def write(self, data: bytes) -> None:
        """Queue bytes (one or many encoded frames) for the peer; pair with `drain()` for backpressure.

        On a link with a send limit, a peer that lets more than the limit pile up is a slow consumer: its
        frames are dropped (drop policy) or the link is closed; either way the write returns at once.
        """
        if self.state is not LinkState.ESTABLISHED:
            raise LinkClosed(self.close_reason or CloseReason.CONNECTION_LOST, f"link is {self.state.value}")
        t = self._t
        if t.is_closing():
            # The connection broke and the read loop has not closed the link yet: same as closed.
            raise LinkClosed(CloseReason.CONNECTION_LOST, "transport is closing")
        if self.send_limit and t.write_buffered() > self.send_limit:
            self._overflow()
            return
        t.write(data)
        self._wrote_at = self._loop.time()  # heartbeat: no PING needed at the next beat

    def limit_frames(self, size: int) -> None:
        """Refuse frames larger than size from now on (a protocol error that closes the link)."""
        self._decoder.max_frame_size = size

    def _overflow(self) -> None:
        self.overflow_drops += 1
        if self.drop_when_full or self._intended is not None:
            return
        self.close_soon(
            CloseReason.SLOW_CONSUMER,
            f"over {self.send_limit} bytes queued for a peer that does not read (--client-send-buffer)",
        )

    def send_nowait(self, msg: Message) -> None:
        """Queue one control message (small control traffic from synchronous code)."""
        self.write(encode_control(msg))

    async def drain(self) -> None:
        """Wait until the peer has taken our queued bytes down to the high-water mark."""
        try:
            await self._t.drain()
        except (ConnectionError, OSError) as exc:
            await self.aclose(CloseReason.CONNECTION_LOST, repr(exc))

    @property
    def write_buffered(self) -> int:
        """Bytes queued in the transport and not yet sent."""
        return self._t.write_buffered()

    async def send(self, msg: Message) -> None:
        """Write one control message, then wait for the transport to drain."""
        self.send_nowait(msg)
        await self.drain()

    async def request(self, msg: Message) -> Message:
        """Send msg (which has a `corr` field) and wait for the message carrying the same corr back.

        Unbounded by itself: callers wrap it in `asyncio.timeout(...)`; closing the link fails the wait.
        """
        corr = getattr(msg, "corr", None)
        if type(corr) is not int:
            raise LocalProtocolError(f"{msg.op} has no correlation id")
        try:
            fut = self._requests.add(corr)
        except ValueError as exc:
            raise LocalProtocolError(str(exc)) from None
        try:
            await self.send(msg)
            return await fut
        finally:
            self._requests.discard(corr)

    # ------------------------------------------------------------------------------------------- close

    async def aclose(self, reason: CloseReason, detail: str = "", farewell: Message | None = None) -> None:
        """Close the link once: optional farewell message, drain (unless failed), fail pending requests.

        Safe to call from any task, any number of times; later calls wait for the first to finish.
        """
        if self.state in (LinkState.CLOSED, LinkState.ERROR) or self.close_reason is not None:
            await self._closed.wait()
            return
        if self._intended is not None:
            # close_soon() decided first (e.g. after UNLINK); the EOF that follows must not turn it into a failure.
            reason, detail = self._intended
        if reason.is_failure:
            self._close_failed(reason, detail)
            return
        self.close_reason, self.close_detail = reason, detail
        if self.state is not LinkState.DRAINING:
            if farewell is not None and self.state is LinkState.ESTABLISHED:
                self._t.write(encode_control(farewell))
                self._farewell = type(farewell)
            self._set_state(LinkState.DRAINING)
        try:
            async with asyncio.timeout(self._drain_timeout):
                await self._t.drain()
                if self._farewell is not None:
                    # The peer closes its end once it has read the farewell (a LEAVE); until then what it
                    # still sends is read here and dropped (DRAINING).  Closed at once, a socket with bytes
                    # unread is reset, and a neighbour writing to it at that moment met a broken pipe before
                    # it read the LEAVE: it took this broker for failed (one leave in 3-4 of bench_join.py's).
                    await self._read_done.wait()
        except (TimeoutError, ConnectionError, OSError):
            pass
        self._closed_with(reason, detail, failed=False)

    def _close_failed(self, reason: CloseReason, detail: str) -> None:
        """aclose for a failure: no farewell and no drain, so it completes at once (from the read path too)."""
        self.close_reason, self.close_detail = reason, detail
        self._closed_with(reason, detail, failed=True)

    def _closed_with(self, reason: CloseReason, detail: str, *, failed: bool) -> None:
        self._set_state(LinkState.ERROR if failed else LinkState.CLOSED)
        self._reading = False
        self._requests.fail_all(LinkClosed(reason, detail))
        if failed:
            self._t.abort()
        else:
            self._t.close()
        if self._quiet is not None:
            self._quiet.close()
            self._quiet = None
        current = asyncio.current_task()
        for task in (self._flush_task, self._watchdog_task):
            if task is not None and task is not current and not task.done():
                task.cancel(f"link closed: {reason.value}")
        if self.role == "broker":
            # Client, admin and never-introduced connections are logged by the handler, summarised
            # (broker/guard.py CloseLog): a line each would let a connection flood fill the disk.
            level = logging.WARNING if reason in NOISY_CLOSES or failed else logging.INFO
            self._log.log(level, "closed %r: reason=%s%s", self, reason.value, f" ({detail})" if detail else "")
        try:
            self._handler.on_closed(self, reason, detail)
        finally:
            self._closed.set()

    def close_soon(self, reason: CloseReason, detail: str = "", farewell: Message | None = None) -> None:
        """Decide to close now (from synchronous code); the closing itself runs as an owned task.

        The decision is recorded at once: frames still arriving are ignored and a following EOF does not
        change the reason.
        """
        if self.close_reason is not None or self._intended is not None:
            return
        self._intended = (reason, detail)
        if self.state in (LinkState.CONNECTING, LinkState.HELLO_SENT, LinkState.ESTABLISHED):
            if farewell is not None and self.state is LinkState.ESTABLISHED:
                self._t.write(encode_control(farewell))
            if not reason.is_failure:
                self._set_state(LinkState.DRAINING)
        self._tasks.spawn(self.aclose(reason, detail), f"close-{self.number}")

    def retire(self, reason: UnlinkReason) -> None:
        """Stop using this link for a live peer: send UNLINK once; close when the peer's UNLINK is in.

        The caller stops writing to the link.  Reading continues, so frames the peer sent before its own
        UNLINK are still forwarded.  A peer that never answers is closed after the drain timeout.
        """
        if not self.unlink_sent and self.state is LinkState.ESTABLISHED:
            self._t.write(encode_control(Unlink(reason)))
            self.unlink_sent = True
            self._unlink_reason = reason
            self._loop.call_later(self._drain_timeout, self._retire_expired, reason)
        if self.unlink_received:
            self._close_retired(reason)

    def unlink_arrived(self) -> bool:
        """Record the peer's UNLINK; True if ours was sent too and the link is now closing."""
        self.unlink_received = True
        if self.unlink_sent:
            self._close_retired(self._unlink_reason)
            return True
        return False

    def _close_retired(self, reason: UnlinkReason) -> None:
        close = CloseReason.DUPLICATE if reason == "duplicate_link" else CloseReason.UNLINKED
        self.close_soon(close, "both ends sent UNLINK")

    def _retire_expired(self, reason: UnlinkReason) -> None:
        if self.close_reason is None and self._intended is None:
            close = CloseReason.DUPLICATE if reason == "duplicate_link" else CloseReason.UNLINKED
            self.close_soon(close, f"peer did not answer UNLINK within {self._drain_timeout} s")

    async def wait_closed(self) -> None:
        """Wait until the link is closed."""
        await self._closed.wait()
