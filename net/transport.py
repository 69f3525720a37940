"""The byte stream under every SeDAX connection: one interface, over asyncio sockets or in memory.

`Transport` is what broker links (broker/link.py), clients (client/client.py) and admin tools (client/admin.py)
need from a connection: read a chunk (pull) or have every chunk pushed to a receiver as it arrives (push), pause
that for backpressure, write, see how much is queued, wait for it to drain, close or abort, and know who is at
the other end.  `StreamTransport` runs it over an asyncio socket transport (TCP, TLS; `connect_broker` dials
one, broker/tls.py accepts them); `memory_pair()` gives two connected in-memory ends, so the connection code is
tested without sockets as well as over loopback.
"""

from __future__ import annotations

import asyncio
import os
import socket
import ssl
import sys
from collections import deque
from typing import Protocol, cast

from net import trace
from net.credentials import ROLE_BROKER, NotABroker, PeerCert, peer_cert


class Receiver(Protocol):
    """Where a transport in push mode (`Transport.receive`) hands what it reads."""

    def received(self, data: bytes) -> None:
        """Bytes from the peer, as they arrived; b"" is the end of the stream (nothing follows)."""
        ...

    def lost(self, exc: Exception) -> None:
        """The connection was reset or failed (nothing follows)."""
        ...


class Transport(Protocol):
    """A byte stream to one peer (see the module docstring).

    Reading is pull (`read`, for a handshake and for the clients' and tools' read loops) until `receive`
    switches the transport to push: from then on every chunk goes to the receiver as it arrives, with no
    buffer and no task in between (a broker's links, the per-message path).
    """

    @property
    def remote(self) -> str:
        """The peer's address, for logs."""
        ...

    @property
    def peer_cert(self) -> PeerCert | None:
        """The peer's verified TLS certificate (None on plain TCP or in memory)."""
        ...

    async def read(self, n: int) -> bytes:
        """Up to n bytes; b"" at the end of the stream.  ConnectionError if the connection was reset."""
        ...

    def receive(self, receiver: Receiver) -> None:
        """Push from now on: every chunk read goes to receiver (what `read` left buffered first, in a call
        scheduled on the loop); `read` is not called again."""
        ...

    def pause_reading(self) -> None:
        """Stop handing chunks to the receiver (backpressure) until `resume_reading`; the peer's bytes wait."""
        ...

    def resume_reading(self) -> None:
        """Hand chunks to the receiver again, the ones that waited first."""
        ...

    def write(self, data: bytes) -> None:
        """Queue bytes; never blocks (see drain)."""
        ...

    def write_buffered(self) -> int:
        """Bytes written and not yet taken by the peer's side."""
        ...

    def set_write_high_water(self, high: int) -> None:
        """drain() waits while more than this many bytes are queued."""
        ...

    async def drain(self) -> None:
        """Wait until the queue is at or below the high-water mark."""
        ...

    def is_closing(self) -> bool:
        """True once closed or aborted (by either side, as far as this side knows)."""
        ...

    def close(self) -> None:
        """Close after the queued bytes (the peer reads them, then the end of the stream)."""
        ...

    def abort(self) -> None:
        """Close at once, dropping what is queued (the peer sees a reset)."""
        ...

    async def wait_closed(self) -> None:
        """Wait until the close finished."""
        ...

    def tcp_socket(self) -> tuple[socket.socket, int] | None:
        """A duplicate of the connection's TCP socket, for socket options (the caller closes it), and the bytes
        each write adds on the wire (0 on plain TCP, 22 for a TLS 1.3 record); None if either is unknown."""
        ...


# Bytes a TLS 1.3 record adds to what is written: 5 header, 1 inner content type, 16 AEAD tag (every cipher
# suite Python's ssl enables).  TLS 1.2's depend on the cipher: no fixed figure.
TLS13_RECORD_OVERHEAD = 22
# In push mode, once this many bytes went to the receiver the socket is paused until the next turn of the event
# loop.  uvloop (libuv's uv__read) reads a ready socket up to 32 times per turn, 256 KB each, while data keeps
# coming, and each chunk is decoded and handled at once: a broker that fell behind a flood (a joining broker
# given the history of 10,000 topics) spent 1.3 s in one socket's reads, its timers waited, its heartbeats went
# out that late, and its neighbours took it for dead (bench_join.py, docs/benchmarks-scale.md).  Now a turn hands
# the receiver at most this much of a socket, a longer chunk the rest in the next turns, and timers and the
# other sockets get their turn in between.  (One 256 KB chunk of small messages - a join's batches and offers,
# ~80 us each to handle - was still 0.1-0.2 s a socket, three neighbours' 0.4-0.7 s a turn, at 30,000 topics.)
READ_TURN_BUDGET = 64 * 1024
# In pull mode, the socket is not read while this much waits unread (asyncio's StreamReader pauses at twice
# its 64 KiB limit): a peer cannot fill our memory faster than `read` takes it.
PULL_BUFFER_LIMIT = 256 * 1024


class StreamTransport(asyncio.Protocol):
    """A Transport over an asyncio socket transport (TCP, TLS): it is the connection's asyncio Protocol.

    It is made by the protocol factory of `loop.create_connection` / `loop.connect_accepted_socket` (see
    `connect` and broker/tls.py), which hand it the connection only once a TLS handshake has completed.
    Received chunks are pushed to the receiver straight from `data_received`: the StreamReader this replaced
    cost a buffer copy, a future's wake-up and a task step per chunk (about 5 % of a broker's CPU in the
    9-broker fan-in, docs/benchmarks-latency.md).

    Writes go to the socket transport at once.  Holding a loop turn's writes back to send them in one system
    call was measured (docs/benchmarks-latency.md) and taken out again: in a broker, pub/sub's acknowledgements
    are written in a deferred call already, and one more deferral put them behind the next batch of reads; in
    the 1,000-publisher fan-in the publishers (each waiting for its ACK) offered 30-45 % fewer messages.  The
    callers batch where it pays: the client per loop turn, pub/sub per topic and turn.
    """

    def __init__(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._tr: asyncio.Transport | None = None
        self.remote = "?"
        self.writes = 0  # writes handed to the socket transport (tests count them)
        self._receiver: Receiver | None = None
        self._paused = False  # the owner paused reading (push mode)
        self._tr_paused = False  # the socket transport is paused (owner's pause, a full pull buffer, a turn's budget)
        self._turn_bytes = 0  # pushed to the receiver since the last yield (READ_TURN_BUDGET)
        self._yielding = False  # paused for the rest of the turn (READ_TURN_BUDGET)
        self._chunks: deque[bytes] = deque()  # read and not yet taken (pull mode; or waiting out a pause)
        self._buffered = 0
        self._eof = False  # the end of the stream came in (after the chunks)
        self._exc: Exception | None = None  # the connection failed (after the chunks)
        self._told = False  # the receiver was told of the end
        self._waiter: asyncio.Future[None] | None = None  # a `read` waiting for data
        self._write_paused = False
        self._drain_waiters: list[asyncio.Future[None]] = []
        self._lost = False
        self._closed: asyncio.Future[None] = self._loop.create_future()
        self._over_ssl = False

    # ---- asyncio.Protocol (called by the socket transport) ----------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # An asyncio.Transport in all but class: uvloop's TCP and TLS transports do not subclass it.
        self._tr = cast(asyncio.Transport, transport)
        self._over_ssl = transport.get_extra_info("sslcontext") is not None
        peername = transport.get_extra_info("peername")
        self.remote = f"{peername[0]}:{peername[1]}" if isinstance(peername, tuple) else str(peername)

    def data_received(self, data: bytes) -> None:
        if trace.ENABLED:
            trace.mark("read", data)
        receiver = self._receiver
        if receiver is not None and not self._paused and not self._chunks:
            if len(data) > READ_TURN_BUDGET:  # (a flood: the rest waits for the next turns)
                self._chunks.append(data)
                self._buffered += len(data)
                data = self._take(READ_TURN_BUDGET)
            receiver.received(data)  # the push path: straight to the decoder
            self._turn_bytes += len(data)
            if (self._turn_bytes >= READ_TURN_BUDGET or self._chunks) and not self._yielding:
                self._yield_turn()
            return
        self._chunks.append(data)
        self._buffered += len(data)
        if receiver is None:
            self._wake_reader()
            if self._buffered > PULL_BUFFER_LIMIT:
                self._pause_transport()

    def eof_received(self) -> bool:
        self._eof = True
        self._deliver_end()
        # Plain TCP stays open for writing (a closing peer still reads our farewell, as StreamReader kept it);
        # TLS has no half-close.
        return not self._over_ssl

    def connection_lost(self, exc: Exception | None) -> None:
        self._lost = True
        if exc is None:
            self._eof = True
        elif self._exc is None and not self._eof:
            self._exc = exc
        self._deliver_end()
        for fut in self._drain_waiters:
            if not fut.done():
                fut.set_exception(ConnectionResetError("connection lost"))
        self._drain_waiters.clear()
        if not self._closed.done():
            self._closed.set_result(None)

    def pause_writing(self) -> None:
        self._write_paused = True

    def resume_writing(self) -> None:
        self._write_paused = False
        for fut in self._drain_waiters:
            if not fut.done():
                fut.set_result(None)
        self._drain_waiters.clear()

    # ---- reading --------------------------------------------------------------------------------------------

    def _wake_reader(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def _pause_transport(self) -> None:
        if not self._tr_paused and self._tr is not None and not self._lost:
            self._tr_paused = True
            self._tr.pause_reading()

    def _resume_transport(self) -> None:
        if self._tr_paused and self._tr is not None:
            self._tr_paused = False
            if not self._lost:
                self._tr.resume_reading()

    def _yield_turn(self) -> None:
        """Read no more of this socket in this turn of the loop (READ_TURN_BUDGET); what waits read goes on in the
        next turn (`_end_yield`)."""
        tr = self._tr
        if tr is None or (tr.is_closing() and not self._chunks):
            return  # (closed: nothing more is read, and nothing read waits)
        self._yielding = True
        if not tr.is_closing():
            self._pause_transport()
        self._loop.call_soon(self._end_yield)

    def _end_yield(self) -> None:
        self._yielding = False
        self._turn_bytes = 0
        if self._paused or self._receiver is None:
            return
        if self._chunks:
            self._deliver_waiting()  # (one budget's worth, yielding again if more waits)
        if not (self._chunks or self._yielding or self._paused) and self._tr is not None and not self._tr.is_closing():
            self._resume_transport()

    def _deliver_end(self) -> None:
        receiver = self._receiver
        if receiver is None:
            self._wake_reader()
        elif (self._eof or self._exc is not None) and not self._paused and not self._chunks and not self._told:
            self._told = True
            # Told of the end, the receiver is told nothing more: let go of it.  It holds this transport, and the
            # two were a reference cycle, which only the cyclic collector freed, and which a broker that froze
            # them (broker/memory.py `freeze_survivors`) never would.
            self._receiver = None
            if self._exc is not None:
                receiver.lost(self._exc)
            else:
                receiver.received(b"")

    async def read(self, n: int) -> bytes:
        while not self._chunks:
            if self._exc is not None:
                raise self._exc
            if self._eof:
                return b""
            self._waiter = self._loop.create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        data = self._take(n)
        if self._buffered <= PULL_BUFFER_LIMIT:
            self._resume_transport()
        return data

    def _take(self, n: int) -> bytes:
        """Up to n bytes of what waits read (at least one chunk waits)."""
        chunks = self._chunks
        data = chunks.popleft()
        while chunks and len(data) + len(chunks[0]) <= n:
            data += chunks.popleft()
        if len(data) > n:
            chunks.appendleft(data[n:])
            data = data[:n]
        self._buffered -= len(data)
        return data

    def receive(self, receiver: Receiver) -> None:
        self._receiver = receiver
        if self._chunks or self._eof or self._exc is not None:
            self._loop.call_soon(self._deliver_waiting)
        if not self._paused:
            self._resume_transport()

    def _deliver_waiting(self) -> None:
        receiver = self._receiver
        if receiver is None or self._paused:
            return
        if self._chunks:
            # At most READ_TURN_BUDGET per turn, as data_received; the rest in the next turns (`_end_yield`).
            receiver.received(self._take(READ_TURN_BUDGET))  # may pause again: what follows waits for the next resume
            if self._chunks:
                if not self._paused and not self._yielding:
                    self._yield_turn()
                return
        if not self._paused:
            self._deliver_end()

    def pause_reading(self) -> None:
        self._paused = True
        self._pause_transport()

    def resume_reading(self) -> None:
        if not self._paused:
            return
        self._paused = False
        if self._chunks or self._eof or self._exc is not None:
            self._deliver_waiting()
        if not self._paused:
            self._resume_transport()

    # ---- writing and closing ----------------------------------------------------------------------------

    @property
    def transport(self) -> asyncio.Transport:
        if self._tr is None:
            raise ConnectionResetError("not connected")
        return self._tr

    @property
    def peer_cert(self) -> PeerCert | None:
        return peer_cert(self.transport.get_extra_info("peercert"))

    # write and write_buffered run per frame sent: the transport is read directly, not through the property.
    def write(self, data: bytes) -> None:
        self.writes += 1
        if trace.ENABLED:
            trace.mark("write", data)
        tr = self._tr
        if tr is None:
            raise ConnectionResetError("not connected")
        if tr.is_closing():
            # As a closed socket (and MemoryTransport): the bytes go nowhere, and the read side learns of the
            # close.  uvloop raises RuntimeError for a write once the handle is closed: an UNLINK a link sent
            # after its connection broke, before its read side had closed it, failed the dial task that retired it.
            return
        tr.write(data)

    def write_buffered(self) -> int:
        tr = self._tr
        if tr is None:
            raise ConnectionResetError("not connected")
        return tr.get_write_buffer_size()

    def set_write_high_water(self, high: int) -> None:
        self.transport.set_write_buffer_limits(high=high)

    async def drain(self) -> None:
        if self._exc is not None:
            raise self._exc
        if self._lost:
            raise ConnectionResetError("connection lost")
        if self.transport.is_closing():
            # As StreamWriter.drain: let a pending connection_lost run, so a write to a closing connection
            # fails here rather than waiting on a pause that never ends.
            await asyncio.sleep(0)
            if self._lost:
                raise ConnectionResetError("connection lost")
        if not self._write_paused:
            return
        fut = self._loop.create_future()
        self._drain_waiters.append(fut)
        await fut

    def is_closing(self) -> bool:
        return self._tr is None or self._tr.is_closing()

    def close(self) -> None:
        if self._tr is not None:
            self._tr.close()

    def abort(self) -> None:
        # No TLS close_notify exchange: for a refused handshake or a dead peer there is nothing to flush.
        if self._tr is not None:
            self._tr.abort()

    async def wait_closed(self) -> None:
        await asyncio.shield(self._closed)

    def tcp_socket(self) -> tuple[socket.socket, int] | None:
        if sys.platform != "linux":
            return None  # its users read Linux's struct tcp_info and rely on Linux's SO_RCVLOWAT under epoll
        sock = self.transport.get_extra_info("socket")
        ssl_object = self.transport.get_extra_info("ssl_object")
        if sock is None or sock.type != socket.SOCK_STREAM:
            return None
        if ssl_object is None:
            overhead = 0
        elif ssl_object.version() == "TLSv1.3":
            overhead = TLS13_RECORD_OVERHEAD
        else:
            return None
        return socket.socket(fileno=os.dup(sock.fileno())), overhead


async def connect_broker(
    host: str, port: int, ctx: ssl.SSLContext | None, handshake_timeout: float, source: str | None = None
) -> StreamTransport:
    """Plain TCP (ctx None), or TLS verifying the broker's certificate: CA, address (SAN) and OU=broker; returns
    once the TLS handshake completed, so no frame flows before.

    source: the local address to connect from (a broker's own listen address, `source_address`).
    Raises OSError (ssl.SSLError for a failed handshake, NotABroker) or TimeoutError.
    """
    loop = asyncio.get_running_loop()
    local = (source, 0) if source is not None else None
    # Made here, not taken from the call's result: under TLS uvloop may return its own SSL protocol there.
    t = StreamTransport()
    if ctx is None:
        await loop.create_connection(lambda: t, host, port, local_addr=local)
        return t
    await loop.create_connection(
        lambda: t, host, port, ssl=ctx, server_hostname=host, ssl_handshake_timeout=handshake_timeout, local_addr=local
    )
    cert = t.peer_cert
    if cert is None or cert.role != ROLE_BROKER:
        t.abort()
        raise NotABroker(
            f"{host}:{port} presented a certificate for {cert.name if cert else '?'} with role "
            f"{cert.role if cert else '?'}, not a broker certificate (OU=broker) of the cluster CA"
        )
    return t


class MemoryTransport:
    """One end of an in-memory connection (made by `memory_pair`)."""

    def __init__(self, name: str) -> None:
        self.remote = name
        self.peer_cert: PeerCert | None = None
        self._peer: MemoryTransport | None = None
        self._inbox: deque[bytes] = deque()
        self._inbox_bytes = 0
        self._readable = asyncio.Event()
        self._drained = asyncio.Event()
        self._drained.set()
        self._high = 64 * 1024
        self._eof = False  # the peer closed: the end of the stream after what is in the inbox
        self._reset = False  # the peer aborted
        self._closing = False
        self._closed = asyncio.Event()
        self._loop = asyncio.get_running_loop()
        self._receiver: Receiver | None = None  # push mode (see Transport.receive)
        self._paused = False
        self._pump_due = False
        self._told = False  # the receiver was told of the end

    def _wake(self) -> None:
        """Bytes, the end or a reset came in: wake `read`, or push them in a call on the loop (as a socket's
        readiness would, never from inside the writer's call)."""
        self._readable.set()
        if self._receiver is not None and not self._paused and not self._pump_due and not self._told:
            self._pump_due = True
            self._loop.call_soon(self._pump)

    def _pump(self) -> None:
        self._pump_due = False
        receiver = self._receiver
        if receiver is None or self._paused or self._told:
            return
        if self._inbox:
            data = b"".join(self._inbox)
            self._inbox.clear()
            self._inbox_bytes = 0
            if self._peer is not None:
                self._peer._drained.set()
            receiver.received(data)
            if self._paused or self._inbox:
                return  # more came in meanwhile: its own pump is due
        if self._reset:
            self._told = True
            receiver.lost(ConnectionResetError(f"{self.remote}: connection reset by peer"))
        elif self._eof:
            self._told = True
            receiver.received(b"")

    def receive(self, receiver: Receiver) -> None:
        self._receiver = receiver
        if self._inbox or self._eof or self._reset:
            self._wake()

    def pause_reading(self) -> None:
        self._paused = True

    def resume_reading(self) -> None:
        if self._paused:
            self._paused = False
            if self._inbox or self._eof or self._reset:
                self._wake()

    async def read(self, n: int) -> bytes:
        while not self._inbox:
            if self._reset:
                raise ConnectionResetError(f"{self.remote}: connection reset by peer")
            if self._eof:
                return b""
            self._readable.clear()
            await self._readable.wait()
        data = self._inbox.popleft()
        if len(data) > n:
            self._inbox.appendleft(data[n:])
            data = data[:n]
        self._inbox_bytes -= len(data)
        peer = self._peer
        if peer is not None and peer.write_buffered() <= peer._high:
            peer._drained.set()
        return data

    def write(self, data: bytes) -> None:
        peer = self._peer
        if self._closing or peer is None or peer._reset or peer._closing:
            return  # as a closed socket: the bytes go nowhere, the read side learns of the close
        if data:
            peer._inbox.append(bytes(data))
            peer._inbox_bytes += len(data)
            peer._wake()
            if self.write_buffered() > self._high:
                self._drained.clear()

    def write_buffered(self) -> int:
        return self._peer._inbox_bytes if self._peer is not None else 0

    def set_write_high_water(self, high: int) -> None:
        self._high = high

    async def drain(self) -> None:
        if self._peer is not None and self._peer._reset:
            raise ConnectionResetError(f"{self.remote}: connection reset by peer")
        await self._drained.wait()

    def is_closing(self) -> bool:
        return self._closing or self._reset

    def close(self) -> None:
        if self._closing:
            return
        self._closing = True
        if self._peer is not None:
            self._peer._eof = True
            self._peer._wake()
        self._closed.set()

    def abort(self) -> None:
        self._closing = True
        self._inbox.clear()
        self._inbox_bytes = 0
        if self._peer is not None:
            self._peer._reset = True
            self._peer._inbox.clear()
            self._peer._inbox_bytes = 0
            self._peer._wake()
            self._peer._drained.set()
        self._drained.set()
        self._closed.set()

    async def wait_closed(self) -> None:
        await self._closed.wait()

    def tcp_socket(self) -> tuple[socket.socket, int] | None:
        return None


def memory_pair(a: str = "memory-a", b: str = "memory-b") -> tuple[MemoryTransport, MemoryTransport]:
    """Two connected in-memory transports (call inside a running event loop)."""
    left, right = MemoryTransport(b), MemoryTransport(a)  # each names its peer, as `remote` does
    left._peer, right._peer = right, left
    return left, right
