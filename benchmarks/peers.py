"""Minimal asyncio MQTT 3.1.1 and core-NATS clients for benchmarks/bench_pubsub.py (not a library).

Both follow the batching discipline of the SeDAX client (`client/client.py`), so the three systems are driven
by the same kind of Python client and the comparison is about the brokers, not the client code:

* frames queued in one turn of the event loop go out in one write (a buffer flushed by `call_soon`), a
  publisher lets the loop run after every 256 publishes and waits for the socket (`drain`) only above a
  write-buffer high-water mark (256 KiB), so a burst of publishes goes out in few system calls;
* at most `max_inflight` publishes are unconfirmed at once (4096 by default, the SeDAX default): MQTT counts
  QoS 1 publishes without their PUBACK; core NATS has no per-message acknowledgement, so the publisher sends a
  PING after every `ping_every` messages and a PONG confirms everything before it (the server handles a
  connection's input in order), which bounds the unconfirmed messages the same way;
* reading takes 256 KiB chunks and parses every complete frame in a chunk before the next read.

Only what the benchmark needs is implemented: MQTT CONNECT/SUBSCRIBE/PUBLISH (QoS 0 and 1)/PUBACK/PINGREQ
and NATS CONNECT/SUB/PUB/MSG/PING/PONG.  No TLS, no auth, no reconnect, no wildcard routing on our side.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections import deque
from collections.abc import Callable
from typing import Final

READ_CHUNK: Final = 256 * 1024  # as client.client.READ_CHUNK
WRITE_HIGH_WATER: Final = 256 * 1024  # as client.client.WRITE_HIGH_WATER
DEFAULT_MAX_INFLIGHT: Final = 4096  # as client.client.DEFAULT_MAX_INFLIGHT
YIELD_EVERY: Final = 256  # as client.client.YIELD_EVERY
# A NATS PONG confirms this many publishes at once: the granularity of the NATS publisher's flow control.
# 4 PINGs per window keep the pipe full while the oldest PONG is on its way.
DEFAULT_PING_EVERY: Final = 1024
CONNECT_TIMEOUT: Final = 5.0

OnMessage = Callable[[bytes], None]


class PeerError(Exception):
    """The peer broker refused something or closed the connection."""


class _Out:
    """The sending side of a connection, as client.client._Connection: one write per event-loop turn."""

    def __init__(self, writer: asyncio.StreamWriter) -> None:
        self.writer = writer
        self._buf = bytearray()
        self._scheduled = False
        self._unyielded = 0

    def send(self, data: bytes) -> None:
        self._buf += data
        if not self._scheduled:
            self._scheduled = True
            asyncio.get_running_loop().call_soon(self.flush)

    def flush(self) -> None:
        self._scheduled = False
        if self._buf and not self.writer.is_closing():
            self.writer.write(bytes(self._buf))
        self._buf.clear()

    async def after_publish(self) -> None:
        """Backpressure and fairness after each publish, as client.client.Client.publish_nowait."""
        if len(self._buf) + self.writer.transport.get_write_buffer_size() > WRITE_HIGH_WATER:
            await self.drain()
        self._unyielded += 1
        if self._unyielded >= YIELD_EVERY:
            self._unyielded = 0
            await asyncio.sleep(0)

    async def drain(self) -> None:
        self.flush()
        await self.writer.drain()

    async def close(self) -> None:
        with contextlib.suppress(ConnectionError, RuntimeError):
            await self.drain()
        self.writer.close()


# --------------------------------------------------------------------------------------------------- MQTT

_CONNECT: Final = 0x10
_CONNACK: Final = 0x20
_PUBLISH: Final = 0x30
_PUBACK: Final = 0x40
_SUBSCRIBE: Final = 0x82  # type 8 with the reserved flags 0b0010
_SUBACK: Final = 0x90
_PINGREQ: Final = 0xC0
_PINGRESP: Final = 0xD0
_DISCONNECT: Final = 0xE0
MAX_PACKET_ID: Final = 0xFFFF


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        b = n & 0x7F
        n >>= 7
        out.append(b | 0x80 if n else b)
        if not n:
            return bytes(out)


def _mqtt_str(s: str) -> bytes:
    b = s.encode()
    return len(b).to_bytes(2, "big") + b


def _packet(first: int, body: bytes) -> bytes:
    return bytes([first]) + _varint(len(body)) + body


class MqttClient:
    """One MQTT 3.1.1 connection (clean session): QoS 1 publishing with a window, QoS 0/1 subscribing."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, max_inflight: int) -> None:
        if not 0 < max_inflight < MAX_PACKET_ID:
            raise ValueError("max_inflight must be between 1 and 65534 (packet ids are 16 bits)")
        self._reader = reader
        self._out = _Out(writer)
        self._max_inflight = max_inflight
        self._buf = bytearray()
        self._next_id = 0
        self._unacked: set[int] = set()
        self._window = asyncio.Event()
        self._window.set()
        self._all_acked = asyncio.Event()
        self._all_acked.set()
        self._handlers: dict[str, tuple[int, OnMessage]] = {}
        self._replies: deque[tuple[int, asyncio.Future[bytes]]] = deque()
        self._task: asyncio.Task[None] | None = None
        self._error: BaseException | None = None
        self.received = 0

    @classmethod
    async def connect(
        cls, host: str, port: int, client_id: str, *, max_inflight: int = DEFAULT_MAX_INFLIGHT, keepalive: int = 60
    ) -> MqttClient:
        """Connect and wait for CONNACK (PeerError if the broker refuses)."""
        async with asyncio.timeout(CONNECT_TIMEOUT):
            reader, writer = await asyncio.open_connection(host, port)
        self = cls(reader, writer, max_inflight)
        self._task = asyncio.get_running_loop().create_task(self._read_loop())
        body = _mqtt_str("MQTT") + bytes([4, 0x02]) + keepalive.to_bytes(2, "big") + _mqtt_str(client_id)
        reply = await self._request(_CONNACK, _packet(_CONNECT, body))
        if len(reply) < 2 or reply[1] != 0:
            await self.close()
            raise PeerError(f"CONNACK refused: {reply.hex()}")
        return self

    async def _request(self, kind: int, packet: bytes) -> bytes:
        fut: asyncio.Future[bytes] = asyncio.get_running_loop().create_future()
        self._replies.append((kind, fut))
        self._out.send(packet)
        async with asyncio.timeout(CONNECT_TIMEOUT):
            return await fut

    async def subscribe(self, topic: str, qos: int, on_message: OnMessage) -> None:
        """SUBSCRIBE with the requested QoS and wait for SUBACK; on_message gets each payload."""
        self._handlers[topic] = (qos, on_message)
        pid = self._packet_id()
        reply = await self._request(
            _SUBACK, _packet(_SUBSCRIBE, pid.to_bytes(2, "big") + _mqtt_str(topic) + bytes([qos]))
        )
        if reply[-1] == 0x80:
            raise PeerError(f"SUBSCRIBE {topic} refused")

    def _packet_id(self) -> int:
        self._next_id = self._next_id % MAX_PACKET_ID + 1
        return self._next_id

    async def publish(self, topic_field: bytes, payload: bytes) -> None:
        """Send one QoS 1 PUBLISH; waits only while max_inflight publishes lack their PUBACK.

        topic_field is `mqtt_topic(topic)`, encoded once by the caller.
        """
        while len(self._unacked) >= self._max_inflight:
            self._check()
            self._window.clear()
            await self._window.wait()
        pid = self._packet_id()
        self._unacked.add(pid)
        self._all_acked.clear()
        body_len = len(topic_field) + 2 + len(payload)
        self._out.send(
            b"".join((bytes([_PUBLISH | 0x02]), _varint(body_len), topic_field, pid.to_bytes(2, "big"), payload))
        )
        await self._out.after_publish()

    async def flush(self) -> None:
        """Wait until every publish is acknowledged."""
        await self._out.drain()
        while self._unacked:
            self._check()
            await self._all_acked.wait()

    def _check(self) -> None:
        if self._error is not None:
            raise PeerError("connection lost") from self._error

    async def _read_loop(self) -> None:
        try:
            while True:
                data = await self._reader.read(READ_CHUNK)
                if not data:
                    raise PeerError("the broker closed the connection")
                self._buf += data
                self._parse()
        except BaseException as exc:
            self._error = exc
            self._window.set()
            self._all_acked.set()
            for _, fut in self._replies:
                if not fut.done():
                    fut.set_exception(PeerError("connection lost"))
            if not isinstance(exc, asyncio.CancelledError | PeerError | ConnectionError):
                raise

    def _parse(self) -> None:
        buf = self._buf
        n = len(buf)
        pos = 0
        acks: list[bytes] = []
        while pos < n:
            first = buf[pos]
            # remaining length: 1..4 bytes, 7 bits each
            length = 0
            shift = 0
            i = pos + 1
            while True:
                if i >= n:
                    self._finish(pos, acks)
                    return
                b = buf[i]
                length |= (b & 0x7F) << shift
                i += 1
                if not b & 0x80:
                    break
                shift += 7
            end = i + length
            if end > n:
                break
            kind = first & 0xF0
            if kind == _PUBLISH:
                tlen = (buf[i] << 8) | buf[i + 1]
                start = i + 2 + tlen
                qos = (first >> 1) & 3
                if qos:
                    acks.append(bytes([_PUBACK, 2]) + bytes(buf[start : start + 2]))
                    start += 2
                self.received += 1
                handler = self._handlers.get(buf[i + 2 : i + 2 + tlen].decode())
                if handler is not None:
                    handler[1](bytes(buf[start:end]))
            elif kind == _PUBACK:
                self._unacked.discard((buf[i] << 8) | buf[i + 1])
                if len(self._unacked) < self._max_inflight:
                    self._window.set()
                if not self._unacked:
                    self._all_acked.set()
            elif kind in (_CONNACK, _SUBACK, _PINGRESP):
                if self._replies and self._replies[0][0] == kind:
                    _, fut = self._replies.popleft()
                    if not fut.done():
                        fut.set_result(bytes(buf[i:end]))
            else:
                raise PeerError(f"unexpected MQTT packet type {first:#x}")
            pos = end
        self._finish(pos, acks)

    def _finish(self, pos: int, acks: list[bytes]) -> None:
        del self._buf[:pos]
        if acks:
            self._out.send(b"".join(acks))

    async def close(self) -> None:
        """DISCONNECT and close."""
        self._out.send(bytes([_DISCONNECT, 0]))
        await self._out.close()
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError, PeerError, ConnectionError):
                await self._task
        with contextlib.suppress(ConnectionError):
            await self._out.writer.wait_closed()


def mqtt_topic(topic: str) -> bytes:
    """The length-prefixed topic field of a PUBLISH, to encode once per topic."""
    return _mqtt_str(topic)


# --------------------------------------------------------------------------------------------------- NATS

_CRLF: Final = b"\r\n"


class NatsClient:
    """One core-NATS connection: PUB with PING/PONG flow control, SUB with a callback per message."""

    def __init__(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, max_inflight: int, ping_every: int
    ) -> None:
        if ping_every <= 0 or max_inflight < ping_every:
            raise ValueError("need 0 < ping_every <= max_inflight")
        self._reader = reader
        self._out = _Out(writer)
        self._ping_every = ping_every
        # Unanswered PINGs allowed while publishing: together with the messages since the last PING this
        # keeps the unconfirmed publishes at or below max_inflight.
        self._max_pings = max(1, max_inflight // ping_every - 1)
        self._since_ping = 0
        self._pongs: deque[asyncio.Future[None]] = deque()
        self._buf = bytearray()
        self._subs: dict[bytes, OnMessage] = {}
        self._next_sid = 0
        self._task: asyncio.Task[None] | None = None
        self._error: BaseException | None = None
        self.info: dict[str, object] = {}
        self.received = 0

    @classmethod
    async def connect(
        cls,
        host: str,
        port: int,
        name: str,
        *,
        max_inflight: int = DEFAULT_MAX_INFLIGHT,
        ping_every: int = DEFAULT_PING_EVERY,
    ) -> NatsClient:
        """Read INFO, send CONNECT (verbose off, echo off) and PING, wait for PONG."""
        async with asyncio.timeout(CONNECT_TIMEOUT):
            reader, writer = await asyncio.open_connection(host, port)
            line = await reader.readuntil(_CRLF)
        if not line.startswith(b"INFO "):
            writer.close()
            raise PeerError(f"expected INFO, got {line[:80]!r}")
        self = cls(reader, writer, max_inflight, ping_every)
        self.info = json.loads(line[5:])
        opts = {
            "verbose": False,
            "pedantic": False,
            "echo": False,
            "name": name,
            "lang": "python-bench",
            "version": "0",
            "protocol": 1,
            "headers": False,
        }
        writer.write(b"CONNECT " + json.dumps(opts).encode() + _CRLF)
        self._task = asyncio.get_running_loop().create_task(self._read_loop())
        async with asyncio.timeout(CONNECT_TIMEOUT):
            await self._ping()
        return self

    def _ping(self) -> asyncio.Future[None]:
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._pongs.append(fut)
        self._out.send(b"PING\r\n")
        return fut

    async def subscribe(self, subject: str, on_message: OnMessage) -> None:
        """SUB, then a PING round trip so the server has registered it before anyone publishes."""
        self._next_sid += 1
        sid = str(self._next_sid).encode()
        self._subs[sid] = on_message
        self._out.send(b"SUB " + subject.encode() + b" " + sid + _CRLF)
        async with asyncio.timeout(CONNECT_TIMEOUT):
            await self._ping()

    async def publish(self, head: bytes, payload: bytes) -> None:
        """Send one PUB; head is `nats_pub_head(subject, len(payload))`, encoded once by the caller."""
        self._out.send(b"".join((head, payload, _CRLF)))
        self._since_ping += 1
        if self._since_ping >= self._ping_every:
            self._since_ping = 0
            self._ping()
            while len(self._pongs) > self._max_pings:
                self._check()
                await self._pongs[0]
        await self._out.after_publish()

    async def flush(self) -> None:
        """PING and wait for its PONG: every publish before it has been processed by the server."""
        self._check()
        self._since_ping = 0
        await self._ping()

    def _check(self) -> None:
        if self._error is not None:
            raise PeerError("connection lost") from self._error

    async def _read_loop(self) -> None:
        try:
            while True:
                data = await self._reader.read(READ_CHUNK)
                if not data:
                    raise PeerError("the server closed the connection")
                self._buf += data
                self._parse()
        except BaseException as exc:
            self._error = exc
            for fut in self._pongs:
                if not fut.done():
                    fut.set_exception(PeerError(f"connection lost: {exc!r}"))
            if not isinstance(exc, asyncio.CancelledError | PeerError | ConnectionError):
                raise

    def _parse(self) -> None:
        buf = self._buf
        n = len(buf)
        pos = 0
        out: list[bytes] = []
        while pos < n:
            eol = buf.find(_CRLF, pos)
            if eol < 0:
                break
            if buf.startswith(b"MSG ", pos):
                # MSG <subject> <sid> [reply-to] <#bytes>
                parts = bytes(buf[pos + 4 : eol]).split()
                size = int(parts[-1])
                start = eol + 2
                end = start + size
                if end + 2 > n:
                    break
                self.received += 1
                handler = self._subs.get(parts[1])
                if handler is not None:
                    handler(bytes(buf[start:end]))
                pos = end + 2
                continue
            line = bytes(buf[pos:eol])
            pos = eol + 2
            if line == b"PONG":
                if self._pongs:
                    fut = self._pongs.popleft()
                    if not fut.done():
                        fut.set_result(None)
            elif line == b"PING":
                out.append(b"PONG\r\n")
            elif line.startswith(b"-ERR"):
                raise PeerError(f"server error: {line.decode(errors='replace')}")
            # +OK (verbose is off, so none) and INFO (cluster updates) need nothing
        del buf[:pos]
        if out:
            self._out.send(b"".join(out))

    async def close(self) -> None:
        """Flush what is buffered and close."""
        await self._out.close()
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError, PeerError, ConnectionError):
                await self._task
        with contextlib.suppress(ConnectionError):
            await self._out.writer.wait_closed()


def nats_pub_head(subject: str, size: int) -> bytes:
    """`PUB <subject> <size>\\r\\n`, to encode once per subject and payload size."""
    return b"PUB " + subject.encode() + b" " + str(size).encode() + _CRLF
