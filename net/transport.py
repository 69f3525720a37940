"""The byte stream under every SeDAX connection: one interface, over asyncio streams or in memory.

`Transport` is what broker links (broker/link.py), clients (client/client.py) and admin tools (client/admin.py)
need from a connection: read a chunk, write, see how much is queued, wait for it to drain, close or abort, and
know who is at the other end.  `StreamTransport` runs it over an asyncio stream pair (TCP, TLS); `memory_pair()`
gives two connected in-memory ends, so the connection code is tested without sockets as well as over loopback.
"""

from __future__ import annotations

import asyncio
import os
import socket
import sys
from collections import deque
from typing import Protocol

from net import trace
from net.credentials import PeerCert, peer_cert


class Transport(Protocol):
    """A byte stream to one peer (see the module docstring)."""

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


class StreamTransport:
    """A Transport over an asyncio StreamReader/StreamWriter pair.

    Writes go to the stream at once.  Holding a loop turn's writes back to send them in one system call was
    measured (docs/benchmarks-latency.md) and taken out again: in a broker, pub/sub's acknowledgements are
    written in a deferred call already, and one more deferral put them behind the next batch of reads; in the
    1,000-publisher fan-in the publishers (each waiting for its ACK) offered 30-45 % fewer messages.  The
    callers batch where it pays: the client per loop turn, pub/sub per topic and turn.
    """

    __slots__ = ("_reader", "_tr", "_writer", "remote", "writes")

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._reader = reader
        self._writer = writer
        # The writer's transport, called directly on the per-message paths (write, its buffer size, its state):
        # StreamWriter only passes these calls on, one Python frame each per message.
        self._tr = writer.transport
        peername = writer.get_extra_info("peername")
        self.remote = f"{peername[0]}:{peername[1]}" if isinstance(peername, tuple) else str(peername)
        self.writes = 0  # writes handed to the stream (tests count them)

    @property
    def peer_cert(self) -> PeerCert | None:
        return peer_cert(self._writer.get_extra_info("peercert"))

    async def read(self, n: int) -> bytes:
        data = await self._reader.read(n)
        if trace.ENABLED:
            trace.mark("read", data)
        return data

    def write(self, data: bytes) -> None:
        self.writes += 1
        if trace.ENABLED:
            trace.mark("write", data)
        self._tr.write(data)

    def write_buffered(self) -> int:
        return self._tr.get_write_buffer_size()

    def set_write_high_water(self, high: int) -> None:
        self._tr.set_write_buffer_limits(high=high)

    async def drain(self) -> None:
        await self._writer.drain()

    def is_closing(self) -> bool:
        return self._tr.is_closing()

    def close(self) -> None:
        self._writer.close()

    def abort(self) -> None:
        # No TLS close_notify exchange: for a refused handshake or a dead peer there is nothing to flush.
        self._tr.abort()

    async def wait_closed(self) -> None:
        await self._writer.wait_closed()

    def tcp_socket(self) -> tuple[socket.socket, int] | None:
        if sys.platform != "linux":
            return None  # its users read Linux's struct tcp_info and rely on Linux's SO_RCVLOWAT under epoll
        sock = self._writer.get_extra_info("socket")
        ssl_object = self._writer.get_extra_info("ssl_object")
        if sock is None or sock.type != socket.SOCK_STREAM:
            return None
        if ssl_object is None:
            overhead = 0
        elif ssl_object.version() == "TLSv1.3":
            overhead = TLS13_RECORD_OVERHEAD
        else:
            return None
        return socket.socket(fileno=os.dup(sock.fileno())), overhead


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
            peer._readable.set()
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
            self._peer._readable.set()
        self._closed.set()

    def abort(self) -> None:
        self._closing = True
        self._inbox.clear()
        self._inbox_bytes = 0
        if self._peer is not None:
            self._peer._reset = True
            self._peer._inbox.clear()
            self._peer._inbox_bytes = 0
            self._peer._readable.set()
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
