"""What every SeDAX connection shares: named limits, close reasons, the HELLO handshake, request correlation,
and the heartbeat.  Broker links (broker/link.py), clients (client/client.py) and admin tools
(client/admin.py) are each one connection object over a `Transport` (net/transport.py) built from these parts.
"""

from __future__ import annotations

import asyncio
import enum
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
    async with asyncio.timeout(timeout):
        await transport.drain()
        while True:
            data = await transport.read(READ_CHUNK)
            frames = decoder.feed(data)
            if frames:
                break
            if not data:
                raise ConnectionResetError("the peer closed the connection during the handshake")
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

    __slots__ = ("interval", "last_rx", "limit", "paused")

    def __init__(self, interval: float, misses: int, limit: float | None = None) -> None:
        self.interval = interval
        self.limit = limit if limit is not None else interval * misses  # seconds of silence tolerated
        self.last_rx = asyncio.get_running_loop().time()
        self.paused = False  # the owner reads nothing on purpose (backpressure): silence is not the peer's

    def received(self) -> None:
        """Something arrived from the peer."""
        self.last_rx = asyncio.get_running_loop().time()

    def silent_for(self) -> float:
        """Seconds since the peer was last heard (0 while paused)."""
        return 0.0 if self.paused else asyncio.get_running_loop().time() - self.last_rx

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
