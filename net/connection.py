"""What every SeDAX connection shares: named limits, close reasons, the HELLO handshake, request correlation,
and the heartbeat.  Broker links (broker/link.py), clients (client/client.py) and admin tools
(client/admin.py) are each one connection object over a `Transport` (net/transport.py) built from these parts.
"""

from __future__ import annotations

import array
import asyncio
import enum
import fcntl
import socket
import struct
import termios
from collections.abc import Awaitable, Callable
from typing import Final

from net.transport import Transport
from overlay.protocol import (
    ControlFrame,
    FrameDecoder,
    Hello,
    HelloOk,
    Message,
    Refuse,
    RemoteProtocolError,
    RoutedFrame,
    encode_control,
)

# ---- limits (one value per name; where two kinds of connection differ, two names and the reason) ------------

# Bytes asked of the transport per read: large enough to batch many small frames into one decode pass.
READ_CHUNK: Final = 256 * 1024
# A broker link blocks its writer (and, through it, the reader that forwards to it) above this much unsent
# data: backpressure instead of an unbounded buffer; 1 MiB absorbs bursts of routed frames without stalling.
LINK_WRITE_HIGH_WATER: Final = 1 << 20
# A client waits for its socket above this much unsent data: a client is one publisher, and a smaller
# queue keeps its acknowledgement latency short.
CLIENT_WRITE_HIGH_WATER: Final = 256 * 1024


class CloseReason(enum.Enum):
    """Why a connection closed.  The first group means the peer may be dead; the second that it is alive."""

    PEER_CLOSED = "peer_closed"
    CONNECTION_LOST = "connection_lost"
    PROTOCOL_ERROR = "protocol_error"
    HELLO_TIMEOUT = "hello_timeout"
    HEARTBEAT_TIMEOUT = "heartbeat_timeout"
    INTERNAL_ERROR = "internal_error"
    REFUSED = "refused"
    UNLINKED = "unlinked"
    DUPLICATE = "duplicate"
    PEER_LEFT = "peer_left"
    SHUTDOWN = "shutdown"
    DONE = "done"
    SLOW_CONSUMER = "slow_consumer"
    IDLE_TIMEOUT = "idle_timeout"

    @property
    def is_failure(self) -> bool:
        """True if the peer must be presumed dead or broken (the overlay heals around it)."""
        return self in _FAILURES


_FAILURES: Final = frozenset(
    {
        CloseReason.PEER_CLOSED,
        CloseReason.CONNECTION_LOST,
        CloseReason.PROTOCOL_ERROR,
        CloseReason.HELLO_TIMEOUT,
        CloseReason.HEARTBEAT_TIMEOUT,
        CloseReason.INTERNAL_ERROR,
        # Not dead, but a client that does not read cannot be drained: its connection is aborted.
        CloseReason.SLOW_CONSUMER,
    }
)


class LinkClosed(ConnectionError):
    """The connection closed while something was waiting on it; `reason` says why."""

    def __init__(self, reason: CloseReason, detail: str = "") -> None:
        super().__init__(f"link closed: {reason.value}" + (f" ({detail})" if detail else ""))
        self.reason = reason
        self.detail = detail


# What a handshake that times out or reads something else than SeDAX frames most likely means.
NOT_A_BROKER: Final = "is this the --listen port of a SeDAX broker (not its --metrics endpoint, nor another service)?"


class HandshakeRefused(ConnectionError):
    """The peer answered our HELLO with REFUSE; `code` and `text` say why and what to change."""

    def __init__(self, code: str, text: str) -> None:
        super().__init__(f"refused: {code}: {text}")
        self.code = code
        self.text = text


async def open_handshake(
    transport: Transport,
    hello: Hello,
    decoder: FrameDecoder,
    timeout: float,  # noqa: ASYNC109 - the hello time-out is part of the handshake, the same for every caller
) -> tuple[HelloOk, list[ControlFrame | RoutedFrame]]:
    """The initiator's side of the handshake, the same for links, clients and admin tools: send HELLO and read
    until the peer's first frame.  Returns HELLO_OK and the frames that arrived behind it in the same read.

    Raises HandshakeRefused (REFUSE), RemoteProtocolError (anything else first), ConnectionError (the peer
    closed the connection first) and TimeoutError (no answer within timeout seconds).
    """
    transport.write(encode_control(hello))
    try:
        async with asyncio.timeout(timeout):
            await transport.drain()
            while True:
                data = await transport.read(READ_CHUNK)
                try:
                    frames = decoder.feed(data)
                except RemoteProtocolError as exc:
                    # A web server, the broker's metrics port, a TLS server spoken to in plain TCP: name what
                    # came back, not only the frame length its first bytes make.
                    raise RemoteProtocolError(f"{exc}; it sent {bytes(data[:24])!r}: {NOT_A_BROKER}") from None
                if frames:
                    break
                if not data:
                    raise ConnectionResetError("the peer closed the connection during the handshake")
    except TimeoutError:
        raise TimeoutError(f"no answer to HELLO within {timeout:g} s: {NOT_A_BROKER}") from None
    first, rest = frames[0], frames[1:]
    if isinstance(first, ControlFrame) and isinstance(first.message, HelloOk):
        return first.message, rest
    if isinstance(first, ControlFrame) and isinstance(first.message, Refuse):
        raise HandshakeRefused(first.message.code, first.message.text)
    what = first.message.op if isinstance(first, ControlFrame) else "a routed frame"
    raise RemoteProtocolError(f"expected HELLO_OK or REFUSE, got {what}")


class Requests:
    """Requests in flight on one connection, by correlation id; the matching reply completes each."""

    __slots__ = ("_pending",)

    def __init__(self) -> None:
        self._pending: dict[int, asyncio.Future[Message]] = {}

    def __len__(self) -> int:
        return len(self._pending)

    def __contains__(self, corr: object) -> bool:
        return corr in self._pending

    def add(self, corr: int) -> asyncio.Future[Message]:
        """A future for the reply carrying corr (ValueError if corr is already waiting)."""
        if corr in self._pending:
            raise ValueError(f"correlation id {corr} already pending")
        fut: asyncio.Future[Message] = asyncio.get_running_loop().create_future()
        self._pending[corr] = fut
        return fut

    def discard(self, corr: int) -> None:
        self._pending.pop(corr, None)

    def complete(self, corr: object, msg: Message) -> bool:
        """Hand msg to the request waiting for corr; False if none waits (the message is not a reply)."""
        fut = self._pending.pop(corr, None) if type(corr) is int else None
        if fut is None:
            return False
        if not fut.done():
            fut.set_result(msg)
        return True

    def fail_all(self, exc: BaseException) -> None:
        """The connection closed: every waiting request fails with exc."""
        for fut in self._pending.values():
            if not fut.done():
                fut.set_exception(exc)
        self._pending.clear()


class Heartbeat:
    """Liveness of one connection: a PING per interval, the peer presumed gone after `misses` silent ones.

    A stretch in which this process itself was too busy to run the heartbeat on time does not count as the
    peer's silence (it could not have been read either).
    """

    __slots__ = ("_loop", "interval", "last_rx", "limit", "paused")

    def __init__(self, interval: float, misses: int, limit: float | None = None) -> None:
        # The loop is looked up once: `received` runs on every read, and under Python 3.11 each
        # asyncio.get_running_loop() is a getpid() system call (its fork check).
        self._loop = asyncio.get_running_loop()
        self.interval = interval
        self.limit = limit if limit is not None else interval * misses  # seconds of silence tolerated
        self.last_rx = self._loop.time()
        self.paused = False  # the owner reads nothing on purpose (backpressure): silence is not the peer's

    def received(self) -> None:
        """Something arrived from the peer."""
        self.last_rx = self._loop.time()

    def silent_for(self) -> float:
        """Seconds since the peer was last heard (0 while paused)."""
        return 0.0 if self.paused else self._loop.time() - self.last_rx

    def deadline(self) -> float:
        """When the peer's silence runs over the limit, on the loop's clock (inf while paused)."""
        return float("inf") if self.paused else self.last_rx + self.limit

    async def run(
        self, alive: Callable[[], bool], ping: Callable[[], None], on_silent: Callable[[float], Awaitable[None]]
    ) -> None:
        """While alive(): ping every interval; on_silent(seconds) once the peer has been silent too long."""
        loop = asyncio.get_running_loop()
        while alive():
            silent = self.silent_for()
            if silent > self.limit:
                await on_silent(silent)
                return
            ping()
            wake = loop.time() + self.interval
            await asyncio.sleep(self.interval)
            late = loop.time() - wake
            if late > 0:
                self.last_rx += late


# struct tcp_info (linux/tcp.h): tcpi_last_data_recv, the milliseconds since data last arrived, at byte 52.
_TCPI_LAST_DATA_RECV: Final = struct.Struct("=I")
_TCPI_LAST_DATA_RECV_AT: Final = 52
_TCP_INFO_LEN: Final = 56
# Heartbeats left waiting in the kernel are read once they fill this much of the receive buffer (100 PINGs over
# TLS: 20 s of an idle link at the default interval), in a beat's wake-up.
QUIET_DRAIN: Final = 4096


class QuietReceive:
    """Lets a peer's heartbeats arrive without waking this process, and still know when they arrived.

    A heartbeat read in a wake-up of its own costs an idle broker ~150 us of CPU, and even one read in a
    wake-up made anyway costs tens of microseconds of Python (docs/benchmarks-scale.md), many times what the
    frame costs the kernel.  So while a link carries nothing but heartbeats they are left unread: the socket's
    SO_RCVLOWAT is kept one byte above the heartbeats already waiting plus one more, so one more heartbeat
    waits without waking the reader while anything else (every other frame is larger than a heartbeat; the end
    of the stream and a reset always wake) wakes it as before, and the reader then takes the heartbeats too.
    When data last arrived the kernel says (TCP_INFO), so silence is measured exactly as if every heartbeat
    had been read at once.  The owner calls `at_beat` once per heartbeat interval: it moves the mark past the
    heartbeat that came since, and lets the reader drain them when QUIET_DRAIN bytes wait.
    """

    __slots__ = ("_beat", "_inq", "_mark", "_sock")

    def __init__(self, sock: socket.socket, beat_on_wire: int) -> None:
        self._sock = sock
        self._beat = beat_on_wire
        self._inq = array.array("i", [0])
        self._mark = 1  # the socket's SO_RCVLOWAT (1, the default: every byte wakes the reader)

    @property
    def raised(self) -> bool:
        """True while heartbeats may wait unread."""
        return self._mark > 1

    def _set(self, mark: int) -> None:
        if mark != self._mark:
            self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT, mark)
            self._mark = mark

    def after_read(self, beats_only: bool) -> None:
        """The reader took everything there was; beats_only: it was heartbeats alone, no partial frame left."""
        self._set(self._beat + 1 if beats_only else 1)

    def arrived(self, now: float) -> float:
        """When data last arrived from the peer, on the loop's clock (now: the loop's time)."""
        info = self._sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, _TCP_INFO_LEN)
        (ms,) = _TCPI_LAST_DATA_RECV.unpack_from(info, _TCPI_LAST_DATA_RECV_AT)
        return now - int(ms) / 1000.0

    def at_beat(self) -> None:
        """Once per interval: room for one more heartbeat below the mark, or the reader drains what waits."""
        if self._mark > 1:
            fcntl.ioctl(self._sock.fileno(), termios.FIONREAD, self._inq)
            waiting = self._inq[0]
            if waiting % self._beat == 0 and waiting < QUIET_DRAIN:
                self._set(waiting + self._beat + 1)
            else:
                self._set(1)  # drained in this wake-up; the reader raises the mark again after

    def close(self) -> None:
        """Close the duplicate socket (the connection itself closes with its transport)."""
        self._sock.close()
