"""The SeDAX asyncio client: publish, subscribe, fetch and locate through any broker of the overlay.

    async with Client(["127.0.0.1:7001", "127.0.0.1:7002"]) as c:
        await c.publish("grid/f1/voltage", b"230.1")
        async with c.subscribe("grid/f1/voltage") as sub:
            async for msg in sub:
                ...

One `Client` owns one connection to its access broker at a time, its read loop and its heartbeat.  When
that broker dies the client reconnects to another known broker (exponential backoff with jitter),
re-subscribes every subscription from the timestamp of the last message it delivered (so nothing is missed)
and re-sends every unacknowledged publish in order; the brokers drop what they already had.

Why one module of ~950 lines: like nats.py's and asyncpg's connection classes, one object owns the connection
and everything whose correctness depends on it surviving a reconnect together — the publish window with its
per-topic sequence numbers and re-sends, the subscriptions with their catch-up marks, the pending requests.
The transport, handshake, heartbeat and request table it runs on are net/'s; the error types client/errors.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import itertools
import json
import logging
import math
import os
import random
import secrets
import ssl
import time
from collections import deque
from collections.abc import Callable, Generator, Iterable, Mapping, Sequence
from dataclasses import dataclass
from types import TracebackType
from typing import Any, Final, Self

from client.admin import HANDSHAKE_HINT
from client.errors import ClientClosed, ClientError, ConnectError, RequestFailed, describe
from net.connection import CLIENT_WRITE_HIGH_WATER, HandshakeRefused, Heartbeat, Requests, open_handshake
from net.credentials import Credentials, CredentialsError
from net.transport import Transport, connect_broker
from overlay.delegation import BalancePlan, BalancePlanned, MoveTopic
from overlay.protocol import (
    MAX_ID_LEN,
    PROTOCOL_VERSION,
    ControlFrame,
    FrameDecoder,
    Hello,
    Message,
    Ping,
    Pong,
    ProtocolError,
    encode_control,
    fast_init,
    parse_address,
)
from overlay.pubsub import (
    MAX_BATCH,
    MAX_PAYLOAD_SIZE,
    Ack,
    Deliver,
    Done,
    Failed,
    Fetch,
    Fetched,
    Heads,
    Locate,
    Located,
    Nack,
    Publish,
    PublishFrames,
    Record,
    Redirect,
    Subscribe,
    Subscribed,
    Unsubscribe,
)
from overlay.topics import validate_topic

__all__ = [
    "Client",
    "ClientClosed",
    "ClientError",
    "ConnectError",
    "PublishAck",
    "ReceivedMessage",
    "RequestFailed",
    "Subscription",
]

log = logging.getLogger("sedax.client")

# How many publishes may wait for their acknowledgement at once; publish() blocks beyond it, which is the
# client's share of backpressure (the broker's is its bounded per-connection queue).
DEFAULT_MAX_INFLIGHT: Final = 4096
# A subscription buffers this many undelivered messages; beyond it the oldest are dropped and counted, so a
# consumer that stopped iterating cannot grow the client's memory without bound.
DEFAULT_SUB_QUEUE: Final = 65536
# Records per FETCH page when a subscription catches up on stored messages before (re-)subscribing.
CATCH_UP_PAGE: Final = 512
# The topic's primary sends each subscriber something every anti-entropy round (5 s): DELIVERs, or a HEADS (empty
# for an idle topic).  A subscription that heard nothing from it for this long is registered nowhere that serves
# it (a primary restarted at level 1 comes back without its subscribers: they are not on disk; a registration
# at a broker that served for a moment while the overlay formed), while its own connection is fine, so nothing
# else would make the client subscribe again: it does (UNSUBSCRIBE, then catch-up and SUBSCRIBE from where it
# was), and the HEADS of the primary it reaches name what merges left behind.
SUBSCRIPTION_LEASE: Final = 20.0
# A gap the first repair FETCH does not fill is asked for again, REPAIR_RETRY apart at first and doubling up to
# REPAIR_RETRY_MAX, until REPAIR_PATIENCE has passed; only then does it count as lost.  After a healed
# partition the holder merges the other side's records a moment after the other side's old primary delivered
# newer ones (docs/storage.md), and on a loaded machine that moment is seconds: the merge waits for the overlay
# to heal and for its pulls.  A message handed out behind the gap cannot be taken back, so the gap is held.
# A repair FETCH can go unanswered while the overlay heals (a routed request dropped on the way): it is asked
# again after REPAIR_FETCH_TIMEOUT, not after the request timeout, and asked at least REPAIR_MIN_ATTEMPTS times.
# At resilience 2 and 3 (the holder says which in its FETCHED) no single change loses an acknowledged message,
# so a gap there is messages on their way: the other side of a partition, merged once the overlay has healed,
# however long the cut lasted.  The client then holds the gap for REPAIR_PATIENCE_REPLICATED, or until as many
# messages wait behind it as the subscription's queue holds.
REPAIR_RETRY: Final = 0.2
REPAIR_RETRY_MAX: Final = 1.6
REPAIR_PATIENCE: Final = 8.0
REPAIR_PATIENCE_REPLICATED: Final = 60.0
REPAIR_FETCH_TIMEOUT: Final = 2.0
REPAIR_MIN_ATTEMPTS: Final = 3
# A publisher's first message past the seq its SUBSCRIBED table says the subscription is owed (`Subscription.
# _expect`) is a gap like any other, but one that may be nobody's loss: a publisher the primary had lost track of
# (a restart without its data) resumes past 0 and the broker accepts the gap.  So it is held for REPAIR_PATIENCE
# at every level, not counted lost if nothing fills it, and fetched from FIRST_GAP_MARGIN before the
# subscription began (a merge keeps another holder's stamps, which may be that much earlier).
FIRST_GAP_MARGIN: Final = 5.0
# The longest wait between two re-sends of unacknowledged publishes.
MAX_RESEND_DELAY: Final = 8.0
# A subscription restored after a reconnect whose SUBSCRIBE (or catch-up FETCH) goes unanswered or is refused for
# a while (RESUBSCRIBE_TRANSIENT: the overlay heals around the failure that cost the connection) is asked again,
# RESUBSCRIBE_RETRY apart at first and doubling up to RESUBSCRIBE_RETRY_MAX, for as long as it is open (across
# later reconnects too: its requests are sent again on the new connection).  A refusal that will not change
# ends its iteration.
RESUBSCRIBE_RETRY: Final = 0.2
RESUBSCRIBE_RETRY_MAX: Final = 2.0
RESUBSCRIBE_TRANSIENT: Final = frozenset({"unreachable", "timeout", "shutting_down", "unknown_topic"})
# Publishes sent back to back before publish_nowait lets the event loop run once.
YIELD_EVERY: Final = 256
# Payload bytes in one batched PUBLISH (Publish.more), well under the frame limit.
BATCH_BYTES: Final = 256 * 1024
# How long aclose() waits for the connection to close cleanly (TLS close_notify) before cutting it off.
CLOSE_TIMEOUT: Final = 2.0
# A client id leaves room in the protocol's id length (MAX_ID_LEN) for the "#<start time>" of its publisher id.
MAX_CLIENT_ID_LEN: Final = MAX_ID_LEN - 16


def _base36(n: int) -> str:
    digits = "0123456789abcdefghijklmnopqrstuvwxyz"
    out = ""
    while True:
        n, d = divmod(n, 36)
        out = digits[d] + out
        if not n:
            return out


def payload_bytes(payload: object) -> bytes:
    """A publish's payload as bytes (str as UTF-8); TypeError for anything else, ValueError over the size limit."""
    if isinstance(payload, str):
        data = payload.encode()
    elif isinstance(payload, bytes | bytearray | memoryview):
        data = bytes(payload)
    else:
        # bytes(230) is 230 zero bytes, and bytes(10**10) ten gigabytes: a number is not a payload.
        raise TypeError(
            f"payload must be bytes or str, got {type(payload).__name__}: encode it first "
            "(str(value), json.dumps(value), struct.pack)"
        )
    if len(data) > MAX_PAYLOAD_SIZE:
        raise ValueError(f"payload of {len(data)} bytes is over the limit of {MAX_PAYLOAD_SIZE}")
    return data


def _expire(fut: asyncio.Future[PublishAck], seconds: float, client: Client) -> None:
    """publish()'s time-out: no acknowledgement came in time (the publish stays pending and is re-sent)."""
    if not fut.done():
        why = client.reconnect_error
        offline = f"; not connected: {why}" if why else ""
        fut.set_exception(TimeoutError(f"no acknowledgement within {seconds:g} s (request_timeout){offline}"))


@fast_init  # one per message received
@dataclass(frozen=True, slots=True)
class ReceivedMessage:
    """A delivered message: its topic, publisher and sequence number, the primary's timestamp, the payload."""

    topic: str
    publisher: str
    seq: int
    ts: float
    payload: bytes


@fast_init  # one per message acknowledged
@dataclass(frozen=True, slots=True)
class PublishAck:
    """The acknowledgement of one publish: its sequence number and the primary's storage timestamp."""

    topic: str
    seq: int
    ts: float


@dataclass(slots=True)
class _Pending:
    """An unacknowledged publish; the PUBLISH itself is built when it is sent (batched with its neighbours)."""

    topic: str
    seq: int
    payload: bytes
    base: int  # the lowest unacknowledged sequence number of its topic when last sent
    future: asyncio.Future[PublishAck]
    sent_at: float


class Subscription:
    """An async iterator of the messages of one topic, or, subscribed with `on_message`, the handle of a
    subscription whose messages go to that function; `aclose()` (or `async with`) unsubscribes."""

    def __init__(
        self,
        client: Client,
        topic: str,
        since: float | None,
        maxsize: int,
        on_message: Callable[[ReceivedMessage], None] | None = None,
    ) -> None:
        self._client = client
        self.topic = topic
        self._on_message = on_message
        self.since = since  # resume point: the ts of the last message handed out
        self._queue: deque[ReceivedMessage] = deque()
        self._maxsize = maxsize
        self._wakeup = asyncio.Event()
        self._last_seq: dict[str, int] = {}
        self._last_ts: dict[str, float] = {}  # publisher -> ts of its last message handed out
        # From the first SUBSCRIBED of a subscription from now, if it carried the topic's publisher table: each
        # publisher's last seq when the subscription began (one not in it owes every message from seq 0), and
        # where the subscription began (`Client._fetch_gaps`).  None: no table, a publisher's first message is taken as
        # it comes (a subscription with `since`, or a broker that sends no table).
        self._expect: dict[str, int] | None = None
        self._began = 0.0
        self._from_now = since is None
        self._answered = False  # a SUBSCRIBED came (only the first one's table counts)
        # Messages held back behind a gap in their publisher's sequence while the client fetches what is
        # missing (a DELIVER lost with a dying link or access broker): publisher -> seq -> record.
        self._behind: dict[str, dict[int, Record]] = {}
        # Publishers a HEADS said the topic holds later messages of than this subscription got, none held back
        # (a lost tail): publisher -> the newest seq the HEADS named, while `Client._repair` fetches up to it.
        self._owed: dict[str, int] = {}
        self._repairing = False
        self.dropped = 0  # messages dropped because the consumer was too slow
        self.duplicates = 0  # re-deliveries after a failover, suppressed by (publisher, seq)
        self.repaired = 0  # messages missing from the live stream that a FETCH filled in
        self.gaps = 0  # missing sequence numbers: messages lost with a failed broker (resilience level 1)
        self.closed = False
        self._warned = False
        # While catching up with FETCH pages the client waits for the consumer to make room (pull, not push).
        self._room = asyncio.Event()
        self._want_room = False
        self.catching_up = False
        self.restoring = False  # a task catches it up and subscribes it again (Client._resubscribe)
        # A DELIVER or HEADS came since the client's last look (`Client._check_leases`), and when that look found
        # it silent first.
        self._heard = True
        self._silent_since = 0.0
        self._error: Exception | None = None

    def _fail(self, exc: Exception) -> None:
        """The overlay refused the subscription after subscribe() returned: iteration ends with exc."""
        self._error = exc
        self.closed = True
        self._wakeup.set()
        self._room.set()

    def _began_with(self, reply: Subscribed) -> None:
        """The subscription's first SUBSCRIBED: what it is owed of each publisher, if the primary said."""
        first, self._answered = not self._answered, True
        if first and self._from_now and reply.publishers_known:
            self._expect = dict(reply.publishers)
            self._began = reply.last_ts if reply.last_ts is not None else 0.0

    def _known_floor(self, publisher: str) -> int | None:
        """The seq of publisher after which the subscription is owed everything: the last handed out, else the
        one its table had when the subscription began (-1: every message); None when neither says (no table)."""
        last = self._last_seq.get(publisher)
        if last is None and self._expect is not None:
            return self._expect.get(publisher, -1)
        return last

    def _floor(self, publisher: str) -> int:
        """`_known_floor`, with -1 (every message) when nothing is known."""
        floor = self._known_floor(publisher)
        return -1 if floor is None else floor

    def _first_gap(self, publisher: str) -> bool:
        """A gap before the first message of publisher handed out (known from the SUBSCRIBED table)."""
        return publisher not in self._last_seq

    def _deliver(self, d: Record) -> None:
        # `_known_floor`, inlined (this runs per message): None when nothing is known, and then a publisher's first
        # message is taken as it comes.
        last = self._last_seq.get(d.publisher)
        if last is None and self._expect is not None:
            last = self._expect.get(d.publisher, -1)
        if last is not None and d.seq <= last:
            self.duplicates += 1
            return
        behind = self._behind.get(d.publisher)
        if behind is not None or (last is not None and d.seq > last + 1):
            # A gap: hold this publisher's messages back and fetch what is missing; the publisher's order
            # holds, and a message the live stream lost on the way still arrives (`_repair`).
            if behind is None:
                behind = self._behind[d.publisher] = {}
            if d.seq not in behind:
                behind[d.seq] = d
            self._start_repair()
            return
        self._hand_out(d)

    def _deliver_run(self, records: Sequence[Record]) -> None:
        """`_deliver` for each of a DELIVER's records, with the common case inlined: the next message of a
        publisher already seen, nothing held back, handed to on_message or queued.  Everything else (a first
        message, a duplicate, a gap, a publisher being repaired, a full queue) takes `_deliver`.  This saves two
        calls per message and the lookups they repeat."""
        last_seq = self._last_seq
        last_ts = self._last_ts
        on_message = self._on_message
        queue = self._queue
        topic = self.topic
        queued = False
        for d in records:
            publisher, seq = d.publisher, d.seq
            last = last_seq.get(publisher)
            if last is None or seq != last + 1 or self._behind or (on_message is None and len(queue) >= self._maxsize):
                self._deliver(d)
                continue
            last_seq[publisher] = seq
            ts = last_ts[publisher] = d.ts
            since = self.since
            if since is None or ts > since:
                self.since = ts
            msg = ReceivedMessage(topic, publisher, seq, ts, d.payload)
            if on_message is not None:
                try:
                    on_message(msg)
                except Exception:
                    log.exception("subscription %s: on_message raised; the subscription goes on", topic)
            else:
                queue.append(msg)
                queued = True
        if queued:
            self._wakeup.set()

    def _start_repair(self) -> None:
        """Fetch what the held-back publishers miss (`Client._repair`), unless that runs already."""
        if not self._repairing:
            self._repairing = True
            self._client._spawn(self._client._repair(self))

    def _heads(self, heads: Mapping[str, int]) -> None:
        """HEADS: the newest seq of publishers that went quiet, as the topic's primary holds them.  A publisher
        whose last messages this subscription lacks is repaired like a gap (`Client._repair`); before, it stayed
        short of them until that publisher's next message showed the gap, and for good if none came (a DELIVER
        lost on the way, records merged from another holder without a push).  A publisher never seen by a
        subscription without a table is left alone: what it is owed of it is not known."""
        for publisher, seq in heads.items():
            floor = self._known_floor(publisher)
            if floor is None or seq <= floor:
                continue
            self._owed[publisher] = max(seq, self._owed.get(publisher, seq))
            self._behind.setdefault(publisher, {})
        if self._behind:
            self._start_repair()

    def _release(self, publisher: str, fetched: Iterable[Record]) -> None:
        """After a repair FETCH: hand out the held-back messages of publisher with what the fetch found, in
        order; what is still missing was lost with a failed broker (counted and logged once)."""
        behind = self._behind.pop(publisher, {})
        self._owed.pop(publisher, None)
        last = self._floor(publisher)
        for rec in fetched:
            if rec.publisher == publisher and rec.seq > last and rec.seq not in behind:
                behind[rec.seq] = rec
                self.repaired += 1
        for seq in sorted(behind):
            self._hand_out(behind[seq])

    def _hand_out(self, d: Record) -> None:
        last = self._last_seq.get(d.publisher)
        if last is None:
            # Not owed if its table had it (`_floor`); a gap before a publisher's first message that nothing
            # filled is not counted lost: the subscription cannot tell it from a publisher the primary had lost
            # track of, which resumed past its table's seq.
            if self._expect is not None and d.seq <= self._expect.get(d.publisher, -1):
                return
        elif d.seq <= last:
            return
        elif d.seq > last + 1:
            self.gaps += d.seq - last - 1
            log.warning(
                "topic %s: %d message(s) of publisher %s missing before seq %d (lost with a failed broker)",
                self.topic,
                d.seq - last - 1,
                d.publisher,
                d.seq,
            )
        self._last_seq[d.publisher] = d.seq
        self._last_ts[d.publisher] = d.ts
        if self.since is None or d.ts > self.since:
            self.since = d.ts
        msg = ReceivedMessage(self.topic, d.publisher, d.seq, d.ts, d.payload)
        on_message = self._on_message
        if on_message is not None:
            # Handed over as it is read: no queue, no task to wake per message.
            try:
                on_message(msg)
            except Exception:
                log.exception("subscription %s: on_message raised; the subscription goes on", self.topic)
            return
        if len(self._queue) >= self._maxsize:
            self._queue.popleft()
            self.dropped += 1
            if not self._warned:
                self._warned = True
                log.warning("subscription %s: consumer too slow, dropping oldest messages", self.topic)
        self._queue.append(msg)
        self._wakeup.set()

    def __aiter__(self) -> Self:
        if self._on_message is not None:
            raise TypeError(
                f"the subscription to {self.topic!r} hands its messages to on_message: "
                "subscribe without on_message to iterate over them"
            )
        return self

    async def __anext__(self) -> ReceivedMessage:
        while not self._queue:
            if self._error is not None:
                raise self._error
            if self.closed:
                raise StopAsyncIteration
            self._wakeup.clear()
            await self._wakeup.wait()
        if self._want_room:
            self._room.set()
        return self._queue.popleft()

    def take_queued(self, limit: int) -> list[ReceivedMessage]:
        """Up to limit messages already queued, without waiting: what a reader on another thread takes in one
        crossing (client/blocking.py) after `__anext__` gave it the first."""
        queue = self._queue
        out = [queue.popleft() for _ in range(min(limit, len(queue)))]
        if out and self._want_room:
            self._room.set()
        return out

    async def _until_room(self, n: int) -> None:
        """Wait until the queue can take n more messages without dropping any."""
        while len(self._queue) + n > self._maxsize and not self.closed:
            self._want_room = True
            self._room.clear()
            await self._room.wait()
        self._want_room = False

    async def aclose(self) -> None:
        """Unsubscribe and end the iteration."""
        if self.closed:
            return
        self.closed = True
        self._wakeup.set()
        self._room.set()
        await self._client._unsubscribe(self)

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.aclose()


class _Reader:
    """Where one connection's transport pushes what it reads (net.transport.Receiver)."""

    __slots__ = ("_client", "_conn", "received")

    def __init__(self, client: Client, conn: _Connection) -> None:
        self._client = client
        self._conn = conn
        # Called per read: a partial goes straight to the client's handler, with no Python frame of its own.
        self.received: Callable[[bytes], None] = functools.partial(client._received, conn)

    def lost(self, exc: Exception) -> None:
        self._client._read_ended(self._conn, exc)


class _Connection:
    """One connection to an access broker: its transport, frame decoder and heartbeat, with writes batched."""

    def __init__(self, transport: Transport, address: str, heartbeat: Heartbeat) -> None:
        self.transport = transport
        self.address = address
        self.decoder = FrameDecoder()
        self.heartbeat = heartbeat
        self.closed = asyncio.Event()
        # Looked up once: the publish path needs the loop per message, and under Python 3.11 each
        # asyncio.get_running_loop() is a getpid() system call (its fork check).
        self.loop = asyncio.get_running_loop()
        # Frames queued in one turn of the event loop go out in one write (one system call, not one each).
        self._wbuf = bytearray()
        self._flush_scheduled = False
        self.read_done = False  # the end of the stream, a reset or a protocol error was read
        # Something other than the heartbeat's own PING was queued since the heartbeat's last turn (keep_alive).
        self.sent_since_beat = False

    def send(self, data: bytes) -> None:
        self._wbuf += data
        self.sent_since_beat = True
        if not self._flush_scheduled:
            self._flush_scheduled = True
            self.loop.call_soon(self.flush)

    def flush(self) -> None:
        self._flush_scheduled = False
        if self._wbuf and not self.transport.is_closing():
            self.transport.write(bytes(self._wbuf))
        self._wbuf.clear()

    def keep_alive(self, ping: Callable[[], bytes]) -> None:
        """The heartbeat's turn: send a PING, unless the last interval already had frames both ways.

        A PING tells the broker this client is alive and draws a PONG that tells the client the broker is; a
        publisher's PUBLISHes and their ACKs within the interval have told both already (MQTT's keep-alive
        rule, "only if no other packet was sent", with the answer direction added).  A thousand devices at
        10 Hz each pinging twice a second were 2,000 PINGs and PONGs a second through the brokers.  The
        silence limit is unchanged: it counts from the last frame heard, PONG or not.

        What this end sent counts only if it was not the last turn's PING: judged by the clock ("wrote within
        an interval"), an idle client's PING and its PONG were the traffic of the interval whenever the timer
        fired a little early, and it skipped every other PING (the broker then pinged it instead).
        """
        hb = self.heartbeat
        busy = self.sent_since_beat and self.loop.time() - hb.last_rx < hb.interval
        if not busy:
            self.send(ping())
        self.sent_since_beat = False

    def send_now(self, data: bytes) -> None:
        """Write data, and whatever this turn queued before it, to the connection at once."""
        self.sent_since_beat = True
        if self._wbuf:
            self._wbuf += data
            self.flush()
        elif not self.transport.is_closing():
            self.transport.write(data)  # a lone frame: written as it is, not copied through the buffer twice

    @property
    def buffered(self) -> int:
        return len(self._wbuf) + self.transport.write_buffered()

    async def drain(self) -> None:
        self.flush()
        with contextlib.suppress(ConnectionError):
            await self.transport.drain()

    def close(self) -> None:
        self.transport.close()
        self.closed.set()

    def abort(self) -> None:
        self.transport.abort()
        self.closed.set()


class Client:
    """A connection to the SeDAX overlay through one access broker at a time (see module docstring)."""

    def __init__(
        self,
        brokers: Sequence[str] | str,
        *,
        client_id: str | None = None,
        connect_timeout: float = 5.0,
        request_timeout: float = 10.0,
        ack_timeout: float = 1.0,
        heartbeat_interval: float = 0.5,
        heartbeat_misses: int = 3,
        reconnect: bool = True,
        max_inflight: int = DEFAULT_MAX_INFLIGHT,
        subscription_queue: int = DEFAULT_SUB_QUEUE,
        batch_publishes: bool = True,
        on_event: Callable[[str, str], None] | None = None,
        credentials: Credentials | None = None,
        subscription_lease: float = SUBSCRIPTION_LEASE,
    ) -> None:
        """Raises ValueError for a bad address or lease and CredentialsError (a ValueError) for unusable
        credentials; credentials default to the environment (net/credentials.py: SEDAX_CA, ... SEDAX_INSECURE).

        `subscription_lease`: seconds of silence from a topic's primary after which a subscription subscribes
        again (SUBSCRIPTION_LEASE); keep it above two of the brokers' anti-entropy rounds (5 s each), in which
        an idle topic's primary sends each subscriber an empty HEADS."""
        addrs = [brokers] if isinstance(brokers, str) else list(brokers)
        if not addrs:
            raise ValueError("give at least one broker address HOST:PORT")
        for a in addrs:
            parse_address(a)  # ValueError with the reason
        lease_ok = isinstance(subscription_lease, int | float) and not isinstance(subscription_lease, bool)
        if not (lease_ok and 0 < subscription_lease < float("inf")):
            raise ValueError(f"subscription_lease must be a positive number of seconds, got {subscription_lease!r}")
        self.brokers = addrs
        self.subscription_lease = float(subscription_lease)
        self.credentials = credentials if credentials is not None else Credentials.from_env()
        self._ssl = self.credentials.ssl_context()
        if client_id is not None and not 0 < len(client_id) <= MAX_CLIENT_ID_LEN:
            raise ValueError(f"client id must be 1..{MAX_CLIENT_ID_LEN} characters, got {len(client_id)}")
        self.client_id = client_id or f"c-{os.getpid()}-{secrets.token_hex(4)}"
        # The publisher id of this client's messages.  Brokers recognise a re-send by (publisher, seq), and this
        # client numbers each topic's messages from 0: a process started again with the same client id must not
        # publish under the id of its previous life, or its new messages would be taken for re-sends of the old
        # ones (acknowledged, never stored).  So, like Kafka's producer id, it names one life of the client:
        # the client id and the start time (µs, base 36).  A default client id is already unique.
        self.publisher_id = self.client_id if client_id is None else f"{client_id}#{_base36(time.time_ns() // 1000)}"
        self.connect_timeout = connect_timeout
        self.request_timeout = request_timeout
        self.ack_timeout = ack_timeout
        self.heartbeat_interval = heartbeat_interval
        self.heartbeat_misses = heartbeat_misses
        self.reconnect = reconnect
        self.subscription_queue = subscription_queue
        # False sends one PUBLISH per message (a benchmark's like-for-like row against one-message protocols).
        self.batch_publishes = batch_publishes
        self._on_event = on_event
        self._conn: _Connection | None = None
        self._connected = asyncio.Event()
        self._up = False  # _connected.is_set(), read per publish without a call
        self._closing = False
        self._tasks: set[asyncio.Task[None]] = set()
        self._corr = itertools.count(1)
        self._requests = Requests()
        self._request_msgs: dict[int, Message] = {}  # the requests of _requests, to re-send after a reconnect
        self._seq: dict[str, int] = {}  # next sequence number per topic
        # Per topic, the encoder of this client's single-message PUBLISH frames (its envelope packed once).
        self._frames: dict[str, PublishFrames] = {}
        self._pending: dict[str, dict[int, _Pending]] = {}  # topic -> seq -> unacknowledged publish
        # Publishes of this turn of the event loop, per topic: they leave as one batched PUBLISH (Publish.more).
        self._outbox: dict[str, list[_Pending]] = {}
        self._outbox_bytes = 0
        self._outbox_scheduled = False
        self._low: dict[str, int] = {}  # topic -> lowest unacknowledged seq (or the next seq if none is)
        self._inflight = _Window(max_inflight)
        self._subs: dict[str, Subscription] = {}
        self._ping_seq = itertools.count()
        self._resending = False  # the re-send task runs (from the first connection on)
        self.reconnects = 0
        # Why the last attempt to reconnect failed, while the client is still reconnecting (None once connected):
        # a request that times out meanwhile says so, rather than only that no answer came.
        self.reconnect_error: str | None = None
        self.resent = 0
        self.rate_limited = 0  # publishes the broker asked to send again later (NACK rate_limited)
        self.renewals = 0  # subscriptions subscribed again after subscription_lease without a word (`_renew`)
        self.sent_at_once = 0  # publishes written as soon as they were made (the first of their loop turn)
        # Per-topic re-send delay: ack_timeout, doubling while acknowledgements stay away (a failover in
        # progress, a busy broker), so re-sends never become a storm that keeps the broker busy.
        self._resend_delay: dict[str, float] = {}
        # The last re-send per topic after an out_of_order NACK: (from seq, up to seq, when).  NACKs for messages
        # sent before it are answered by it; re-sending for each of them made a storm after every failover
        # (each of ~1,000 NACKs re-sent ~1,700 messages).
        self._resent: dict[str, tuple[int, int, float]] = {}
        # Topics the access broker rate-limited, until when: nothing new is sent for them meanwhile, and the
        # next re-send (from the first unacknowledged message, in order) happens after the back-off.
        self._throttled: dict[str, float] = {}
        self._unyielded = 0

    # ---- lifecycle -----------------------------------------------------------------------------------
    async def __aenter__(self) -> Self:
        await self.connect()
        return self

    async def __aexit__(
        self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.aclose(None if et is None else 0)

    @property
    def address(self) -> str | None:
        """The access broker currently connected, if any."""
        return self._conn.address if self._conn is not None and not self._conn.closed.is_set() else None

    async def connect(self) -> None:
        """Connect to the first reachable broker of the list (ConnectError if none answers)."""
        await self._connect_any(self.brokers)

    def _spawn(self, coro: object) -> None:
        task: asyncio.Task[None] = asyncio.get_running_loop().create_task(coro)  # type: ignore[arg-type]
        self._tasks.add(task)
        task.add_done_callback(self._task_done)

    def _task_done(self, task: asyncio.Task[None]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.error("client task failed", exc_info=task.exception())

    async def _connect_any(self, order: Sequence[str]) -> None:
        errors = []
        for addr in order:
            try:
                await self._connect_one(addr)
            except (OSError, TimeoutError, ProtocolError, ConnectError) as exc:
                errors.append(f"{addr}: {describe(exc)}")
            else:
                return
        raise ConnectError("no broker reachable: " + "; ".join(errors))

    async def _connect_one(self, addr: str) -> None:
        host, port = parse_address(addr)
        async with asyncio.timeout(self.connect_timeout):
            transport = await connect_broker(host, port, self._tls(), self.connect_timeout)
        await self.attach(transport, addr)

    def _tls(self) -> ssl.SSLContext | None:
        """The TLS context for a connection made now: renewed certificate files are read again (a cheap stat
        when they are not), so a long-running client follows a rotation; files that cannot be read now (one
        half-written) leave it with those it had."""
        try:
            self._ssl = self.credentials.ssl_context()
        except CredentialsError as exc:
            log.warning("keeping the TLS files loaded before: %s", exc)
        return self._ssl

    async def attach(self, transport: Transport, addr: str) -> None:
        """Make a connected transport this client's connection: the handshake (net.connection.open_handshake),
        then the read loop and the heartbeat.  `connect` does this over TCP/TLS; tests also over memory (then
        without `async with`, which connects: call `aclose()` at the end)."""
        conn = _Connection(transport, addr, Heartbeat(self.heartbeat_interval, self.heartbeat_misses))
        hello = Hello(PROTOCOL_VERSION, self.client_id, "client", token=self.credentials.token or "")
        try:
            _, rest = await open_handshake(transport, hello, conn.decoder, self.connect_timeout)
        except HandshakeRefused as exc:
            conn.abort()
            raise ConnectError(f"{addr} refused: {exc.code}: {exc.text}") from None
        except ConnectionResetError:
            conn.abort()
            raise ConnectError(f"{addr} closed the connection during the handshake ({HANDSHAKE_HINT})") from None
        except BaseException:
            conn.abort()
            raise
        self._conn = conn
        conn.heartbeat.received()
        self._connected.set()
        self._up = True
        transport.receive(_Reader(self, conn))  # after `rest` below: the transport hands over in a later call
        self._spawn(conn.heartbeat.run(lambda: self._conn is conn and not conn.closed.is_set(),
                                       lambda: conn.keep_alive(lambda: encode_control(Ping(next(self._ping_seq)))),
                                       lambda silent: self._silent(conn, silent)))  # fmt: skip
        if not self._resending:
            self._resending = True
            self._spawn(self._resender())
        for f in rest:
            self._on_frame(f)
        self._event("connected", addr)

    async def _silent(self, conn: _Connection, seconds: float) -> None:
        log.warning("access broker %s silent for %.2f s (%d heartbeats)", conn.address, seconds, self.heartbeat_misses)
        conn.abort()

    def _event(self, kind: str, detail: str) -> None:
        if self._on_event is not None:
            self._on_event(kind, detail)

    async def aclose(self, flush_timeout: float | None = None) -> None:
        """Wait for the publishes in flight to be acknowledged, then close the connection, fail what still waits
        and stop the client's tasks.

        As Kafka's producer does on close(), publishes already sent get up to `flush_timeout` seconds (default: the
        client's request_timeout; 0: close at once) to be acknowledged; meanwhile they are re-sent as usual, to
        another broker if the access broker failed.  Those still unacknowledged then fail with ClientClosed (the
        brokers may or may not have stored them); their number is logged in one warning of the "sedax.client"
        logger.  `async with` waits the default time on a normal exit, and not at all when its block raised.
        """
        if self._closing:
            return
        wait = self.request_timeout if flush_timeout is None else flush_timeout
        if not (self.reconnect or self._connected.is_set()):
            wait = 0  # nothing can acknowledge them on a connection that is gone and will not be made again
        if wait > 0 and self.unacknowledged:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(wait):
                    await self.flush()
            if self._closing:
                return  # closed by another task meanwhile
        self._closing = True
        for sub in list(self._subs.values()):
            sub.closed = True
            sub._wakeup.set()
        conn = self._conn
        if conn is not None:
            await conn.drain()
            conn.close()
        for t in list(self._tasks):
            t.cancel()
        for t in list(self._tasks):
            with contextlib.suppress(asyncio.CancelledError):
                await t
        if conn is not None:
            # A TLS close exchanges close_notify with the broker; wait for it (bounded) so the socket is
            # really closed when aclose returns, and cut it off if the broker does not answer.
            try:
                async with asyncio.timeout(CLOSE_TIMEOUT):
                    await conn.transport.wait_closed()
            except (OSError, TimeoutError):
                conn.abort()
        exc = ClientClosed("the client was closed")
        self._requests.fail_all(exc)
        unacknowledged = 0
        for per_topic in self._pending.values():
            for p in per_topic.values():
                if not p.future.done():
                    p.future.set_exception(exc)
                    # Whoever awaits the future still gets ClientClosed.  One a script dropped (publish_nowait
                    # without keeping what it returns) would otherwise print asyncio's "exception was never
                    # retrieved" at collection, one block per message: they are reported below in one line.
                    p.future.exception()
                    unacknowledged += 1
        if unacknowledged:
            log.warning(
                "closed with %d publish(es) not acknowledged within %g s: the brokers may not have stored them "
                "(await client.flush(), publish() or the futures publish_nowait() returns, before closing)",
                unacknowledged,
                wait,
            )

    # ---- reading -------------------------------------------------------------------------------------
    def _received(self, conn: _Connection, data: bytes) -> None:
        """Bytes from the broker, pushed by the transport as they arrive (b"": the end of the stream)."""
        if conn.read_done:
            return
        try:
            conn.heartbeat.received()
            for f in conn.decoder.feed(data):
                self._on_frame(f)
        except (ConnectionError, ProtocolError) as exc:
            self._read_ended(conn, exc)
        except Exception as exc:  # a bug handling the broker's input ends this connection, visibly
            log.exception("bug while handling input from %s", conn.address)
            self._read_ended(conn, exc)
        else:
            if not data:
                self._read_ended(conn, None)

    def _read_ended(self, conn: _Connection, exc: Exception | None) -> None:
        """Nothing more is read from conn (exc: why, None for the end of the stream): close it, and reconnect
        unless the client is closing."""
        if conn.read_done:
            return
        conn.read_done = True
        if exc is not None:
            # Closing, what the broker still sent after our TLS close_notify (an ACK or a PONG on the way) ends
            # the read with APPLICATION_DATA_AFTER_CLOSE_NOTIFY: the close this client asked for, not a loss.
            (log.debug if self._closing else log.warning)("connection to %s lost: %s", conn.address, exc)
        conn.close()
        if self._conn is conn:
            self._connected.clear()
            self._up = False
            if not self._closing:
                self._spawn(self._reconnect(conn.address))

    def _on_frame(self, frame: object) -> None:
        if not isinstance(frame, ControlFrame):
            return
        m = frame.message
        match m:
            case Deliver():
                sub = self._subs.get(m.topic)
                if sub is not None:
                    sub._heard = True
                    sub._deliver_run(m.records)
            case Ack():
                self._acked(m)
            case Nack():
                self._nacked(m)
            case Redirect():
                self._event("redirect", f"{m.topic} -> {m.coord}")
            case Subscribed():
                self._resolve(m.corr, m)
            case Heads():
                sub = self._subs.get(m.topic)
                if sub is not None:
                    sub._heard = True
                    sub._heads(m.publishers)
            case Failed(corr=0):
                self._subscription_refused(m)
            case Done() | Fetched() | Located() | Failed() | BalancePlanned():
                self._resolve(m.corr, m)
            case Ping():
                if self._conn is not None:
                    self._conn.send(encode_control(Pong(m.seq)))
            case _:
                pass  # PONG and anything newer: liveness is all they tell

    def _subscription_refused(self, m: Failed) -> None:
        """A FAILED no request asked for: the overlay ended a subscription that stood (the broker's ACL, read
        again, denies it now; the topic's primary refused a registration made again).  Its iteration ends with
        the reason, as a refused re-subscription does; a passing refusal is left to the next re-registration."""
        sub = self._subs.get(m.topic)
        if sub is None or m.code in RESUBSCRIBE_TRANSIENT:
            return
        log.warning("subscription to %s ended by the overlay: %s: %s", m.topic, m.code, m.text)
        del self._subs[m.topic]
        sub._fail(RequestFailed(m.code, m.text))

    def _resolve(self, corr: int, m: Message) -> None:
        self._requests.complete(corr, m)

    # ---- liveness and reconnect ----------------------------------------------------------------------
    async def _reconnect(self, failed: str) -> None:
        if not self.reconnect:
            self._fail_all(ConnectError(f"connection to {failed} lost and reconnect is off"))
            return
        self._event("disconnected", failed)
        delay = 0.05
        while not self._closing:
            # Try the other brokers first: the failed one is probably dead.
            others = [a for a in self.brokers if a != failed]
            random.shuffle(others)
            try:
                await self._connect_any([*others, failed])
            except ConnectError as exc:
                self.reconnect_error = str(exc)
                log.warning("reconnect failed, retrying in %.2fs: %s", delay, exc)
                await asyncio.sleep(delay * (1.0 + random.random()))
                delay = min(delay * 2, 2.0)
                continue
            self.reconnects += 1
            self.reconnect_error = None
            await self._restore()
            return

    async def _restore(self) -> None:
        """After a reconnect: re-subscribe from the last delivered timestamp, re-send unacknowledged publishes."""
        # Requests whose answer died with the old connection go out again (all are safe to repeat); their
        # callers are still waiting, within their own time-out.  A pending SUBSCRIBE re-subscribes its topic.
        pending = [m for corr, m in self._request_msgs.items() if corr in self._requests]
        subscribing = {m.topic for m in pending if isinstance(m, Subscribe)}
        for sub in list(self._subs.values()):
            if not sub.closed and sub.topic not in subscribing and not sub.catching_up and not sub.restoring:
                self._spawn(self._resubscribe(sub))
        self._resend_all()
        conn = self._conn
        if conn is not None:
            for msg in pending:
                conn.send(encode_control(msg))

    async def _resubscribe(self, sub: Subscription, what: str = "re-subscribing") -> None:
        """Catch sub up and SUBSCRIBE again (after a reconnect, or the rest of a catch-up begun by subscribe()).

        No answer in time, or a refusal of RESUBSCRIBE_TRANSIENT, is asked again with a growing pause while the
        subscription is open (it used to be given up after one time-out, and the subscription then stayed
        silent for good); a refusal that will not change (not_allowed, topic_full, ...) ends the subscription's
        iteration with it.  One such task per subscription (`restoring`): its requests outlive a reconnect
        (they are sent again), so a reconnect meanwhile leaves the subscription to it."""
        sub.restoring = True
        delay = RESUBSCRIBE_RETRY
        try:
            while not sub.closed and not self._closing:
                try:
                    await self._catch_up_and_subscribe(sub)
                except RequestFailed as exc:
                    if exc.code == "already_subscribed":
                        # The withdrawal of an attempt that timed out did not reach the access broker before this
                        # one (`_send_subscribe`): withdraw again and ask again, rather than take it for a success.
                        await self._withdraw_subscribe(sub.topic)
                    elif exc.code not in RESUBSCRIBE_TRANSIENT:
                        log.warning("%s %s failed: %s", what, sub.topic, exc)
                        if self._subs.get(sub.topic) is sub:
                            del self._subs[sub.topic]
                        sub._fail(exc)
                        return
                    why = describe(exc)
                except TimeoutError as exc:
                    why = describe(exc, f"no answer within {self.request_timeout:g} s")
                except ClientError as exc:  # the client closed
                    log.debug("%s %s stopped: %s", what, sub.topic, describe(exc))
                    return
                else:
                    return
                log.warning("%s %s failed (%s); asking again in %.1f s", what, sub.topic, why, delay)
                await asyncio.sleep(delay)  # a pause before asking again, not synchronisation
                delay = min(2 * delay, RESUBSCRIBE_RETRY_MAX)
        finally:
            sub.restoring = False

    async def _catch_up_and_subscribe(self, sub: Subscription) -> None:
        await self._catch_up(sub)
        if not sub.closed:
            await self._send_subscribe(sub)

    async def _send_subscribe(self, sub: Subscription) -> None:
        try:
            reply = await self._request(Subscribe(next(self._corr), sub.topic, sub.since))
        except TimeoutError:
            # The access broker took the SUBSCRIBE and may have lost it on the way to the holder (a broker that
            # failed with it, a route broken while the overlay healed).  Withdraw it: asked again on the same
            # connection, the access broker answered already_subscribed, which was taken for "the first one got
            # there after all", and the subscription stayed silent for good (benchmarks/chaos.py, level 3, after
            # a full restart).  If it did get there, the UNSUBSCRIBE follows it on the same path.
            await self._withdraw_subscribe(sub.topic)
            raise
        if isinstance(reply, Subscribed):
            sub._began_with(reply)
        if sub.since is None and isinstance(reply, Subscribed) and reply.last_ts is not None:
            # Nothing handed out yet: what a reconnect catches up with starts where the subscription began, so
            # messages lost on the way with a failed access broker before the first one arrived are fetched.
            sub.since = reply.last_ts

    async def _withdraw_subscribe(self, topic: str) -> None:
        """UNSUBSCRIBE without waiting for an answer (corr 0), on the connection in use, if any: a new connection
        is a new session, which holds no subscription to withdraw."""
        if self._connected.is_set():
            with contextlib.suppress(ClientError, TimeoutError):
                await self._send(Unsubscribe(0, topic))

    async def _repair(self, sub: Subscription) -> None:
        """Fetch what the live stream of sub lost before the messages it holds back (`Subscription._deliver`), and
        the last messages a HEADS says it lacks (`Subscription._heads`).

        Every publisher with a gap is repaired at once: the stored messages from the earliest of their last
        handed-out ones on are read with FETCH, asked again while some are still missing, and each publisher's
        are handed out as soon as its gap is filled or its patience ran out; whatever the holders do not have
        then was lost with a failed broker.  (One publisher at a time, a subscription whose every publisher had a
        gap nothing filled - registered at a primary that served without the history - waited up to K x 8 s.)"""
        loop = asyncio.get_running_loop()
        began: dict[str, float] = {}  # publisher -> when its repair began
        attempts: dict[str, int] = {}
        retry = REPAIR_RETRY
        replicated = False  # a holder said level 2 or 3: a gap there is messages on their way (REPAIR_PATIENCE_...)
        try:
            while sub._behind and not sub.closed:
                publishers = list(sub._behind)
                for publisher in publishers:
                    began.setdefault(publisher, loop.time())
                found, level = await self._fetch_gaps(sub, publishers)
                replicated = replicated or level >= 2
                now = loop.time()
                for publisher in publishers:
                    held = sub._behind.get(publisher)
                    if held is None:
                        continue
                    attempts[publisher] = attempt = attempts.get(publisher, 0) + 1
                    got = found.get(publisher, [])
                    # Every seq up to the highest held back (or the HEADS' seq): messages pushed while the fetch
                    # ran (a merge's) land among the held ones, and a gap can remain between them too.
                    last = sub._floor(publisher)
                    upto = max(max(held, default=last), sub._owed.get(publisher, -1) + 1)
                    missing = set(range(last + 1, upto)) - held.keys() - {r.seq for r in got}
                    # (FIRST_GAP_MARGIN says why a first gap waits REPAIR_PATIENCE at every level)
                    first = sub._first_gap(publisher)
                    patience = REPAIR_PATIENCE_REPLICATED if replicated and not first else REPAIR_PATIENCE
                    out_of_patience = attempt >= REPAIR_MIN_ATTEMPTS and now + retry > began[publisher] + patience
                    # (memory stays bounded: what waits behind a gap is at most a queue's worth)
                    if not missing or sub.closed or out_of_patience or len(held) >= sub._maxsize:
                        sub._release(publisher, got)
                        del began[publisher], attempts[publisher]
                if sub._behind and not sub.closed:
                    await asyncio.sleep(retry)  # a wait for the holders to merge, not synchronisation of ours
                    retry = min(2 * retry, REPAIR_RETRY_MAX)
        finally:
            sub._repairing = False

    async def _fetch_gaps(self, sub: Subscription, publishers: list[str]) -> tuple[dict[str, list[Record]], int]:
        """The stored messages of each publisher between its last handed-out one and its last held back (with
        none held back, the newest), by publisher, and the answering holder's resilience level (0 if none
        answered).  One FETCH pass from the earliest of them."""
        since: dict[str, float] = {}
        upto: dict[str, float] = {}
        for publisher in publishers:
            behind = sub._behind.get(publisher)
            if behind is None:
                continue
            # Nothing held back: the publisher's last messages (`Subscription._heads`), up to the newest stored.
            upto[publisher] = max((r.ts for r in behind.values()), default=math.inf)
            last_ts = sub._last_ts.get(publisher)
            # (a gap before the publisher's first message: from where the subscription began)
            since[publisher] = max(0.0, sub._began - FIRST_GAP_MARGIN) if last_ts is None else last_ts
        found: dict[str, list[Record]] = {}
        if not since:
            return found, 0
        at, end = min(since.values()), max(upto.values())
        level = 0
        try:
            while at < end:
                fetch = Fetch(next(self._corr), sub.topic, at, CATCH_UP_PAGE)
                reply = await self._request(fetch, min(self.request_timeout, REPAIR_FETCH_TIMEOUT))
                assert isinstance(reply, Fetched)
                level = reply.resilience
                for r in reply.records:
                    if (u := upto.get(r.publisher)) is not None and since[r.publisher] < r.ts < u:
                        found.setdefault(r.publisher, []).append(r)
                if not reply.more or not reply.records:
                    break
                at = reply.records[-1].ts
        except (RequestFailed, TimeoutError, ClientError) as exc:
            log.warning("topic %s: could not fetch the messages missing from the stream: %r", sub.topic, exc)
        return found, level

    async def _catch_up(self, sub: Subscription, wait: bool = True) -> bool:
        """Read what was stored since sub.since page by page, as fast as the consumer takes it.

        A SUBSCRIBE with `since` makes the holder push the whole backlog at once; after a long absence that
        can be more than the access broker queues for one client (it would drop the subscriber as a slow
        consumer, again and again) or than the subscription's queue holds.  Pulling it with FETCH first
        leaves SUBSCRIBE only the few messages published after the last page.  While this runs, a reconnect
        re-sends the pending FETCH instead of re-subscribing.  Returns False, when not to `wait`, as soon as
        the queue is too full for the next page (the caller goes on in the background).
        """
        since = sub.since
        if since is None:
            return True
        sub.catching_up = True
        try:
            while not sub.closed:
                page = max(1, min(CATCH_UP_PAGE, sub._maxsize // 2))
                if not wait and len(sub._queue) + page > sub._maxsize:
                    return False
                await sub._until_room(page)
                try:
                    reply = await self._request(Fetch(next(self._corr), sub.topic, since, page))
                except RequestFailed as exc:
                    if exc.code == "unknown_topic":
                        return True  # nothing stored yet: SUBSCRIBE is all there is to do
                    raise
                assert isinstance(reply, Fetched)
                for rec in reply.records:
                    sub._deliver(rec)
                if not reply.more or not reply.records:
                    return True
                since = reply.records[-1].ts
            return True
        finally:
            sub.catching_up = False

    def _fail_all(self, exc: Exception) -> None:
        self._requests.fail_all(exc)

    # ---- requests ------------------------------------------------------------------------------------
    async def _send(self, msg: Message) -> None:
        if self._closing:
            raise ClientClosed("the client is closed")
        if not self._connected.is_set():
            try:
                async with asyncio.timeout(self.request_timeout):
                    await self._connected.wait()
            except TimeoutError:
                if self.reconnect_error is None:
                    raise
                raise ConnectError(f"not connected: {self.reconnect_error}") from None
        conn = self._conn
        if conn is None:
            raise ConnectError("not connected")
        conn.send(encode_control(msg))
        # Drain only above the high-water mark: a burst of publishes goes out in few writes.
        if conn.buffered > CLIENT_WRITE_HIGH_WATER:
            await conn.drain()

    async def _request(
        self, msg: Subscribe | Unsubscribe | Fetch | Locate | MoveTopic | BalancePlan, wait: float | None = None
    ) -> Message:
        """Send msg and wait for its answer, at most `wait` seconds (default: request_timeout)."""
        fut = self._requests.add(msg.corr)
        self._request_msgs[msg.corr] = msg
        try:
            await self._send(msg)
            async with asyncio.timeout(self.request_timeout if wait is None else wait):
                reply = await fut
        finally:
            self._requests.discard(msg.corr)
            self._request_msgs.pop(msg.corr, None)
        if isinstance(reply, Failed):
            raise RequestFailed(reply.code, reply.text)
        return reply

    # ---- publishing ----------------------------------------------------------------------------------
    def _acked(self, m: Ack) -> None:
        # Cumulative: everything up to m.seq is stored (a primary accepts a publisher's messages in order).
        per_topic = self._pending.get(m.topic)
        if not per_topic or m.publisher != self.publisher_id:
            return
        # Walk up from the lowest unacknowledged number: `next(iter(dict))` after many pops from a dict's front
        # scans the deleted slots each time, which made long streams quadratic.
        low = self._low.get(m.topic, 0)
        while low <= m.seq:
            p = per_topic.pop(low, None)
            if p is not None:
                if not p.future.done():
                    p.future.set_result(PublishAck(m.topic, low, m.ts))
                self._inflight.release()
            low += 1
        self._low[m.topic] = self._first_pending(m.topic, low)
        self._resend_delay.pop(m.topic, None)  # progress: back to the normal delay

    def _first_pending(self, topic: str, low: int) -> int:
        """The lowest unacknowledged sequence number of topic at or above low (the next one if none is)."""
        per_topic = self._pending.get(topic)
        end = self._seq.get(topic, 0)
        if not per_topic:
            return max(low, end)  # nothing pending: the next one, without walking up to it
        while low < end and low not in per_topic:
            low += 1
        return low

    def _nacked(self, m: Nack) -> None:
        per_topic = self._pending.get(m.topic, {})
        now = asyncio.get_running_loop().time()
        if m.code == "rate_limited":
            # The access broker throttles us: keep the message and hold the topic back; the resender sends
            # everything unacknowledged again after the back-off, which doubles while refusals continue.
            self.rate_limited += 1
            self._throttled[m.topic] = now + self._resend_delay.get(m.topic, self.ack_timeout)
            return
        if m.code == "out_of_order":
            if self._throttled.get(m.topic, 0.0) > now:
                return  # a later message got through after an earlier one was refused: the re-send fixes it
            # The primary misses earlier messages that we still hold: send them again, in order, once.
            last = self._resent.get(m.topic)
            if last is not None and last[0] <= m.expected and m.seq <= last[1] and now - last[2] < self.ack_timeout:
                return  # a NACK of a message sent before the re-send that already covers it
            self._resend_topic(m.topic, from_seq=m.expected)
            return
        # A refusal of the topic as such (ACL, name) fails this and every later publish to it, and so does a full
        # disk at the holder or a topic that takes no new publisher (none of what followed was stored either);
        # one of a single message (size) fails that one, and the rest of its batch goes out again at once.
        whole_topic = m.code in ("not_allowed", "bad_topic", "storage_full", "topic_full")
        for seq in sorted(s for s in per_topic if s >= m.seq) if whole_topic else [m.seq]:
            p = per_topic.pop(seq, None)
            if p is not None:
                if not p.future.done():
                    p.future.set_exception(RequestFailed(m.code, m.text))
                self._inflight.release()
        self._low[m.topic] = self._first_pending(m.topic, self._low.get(m.topic, 0))
        if not whole_topic and per_topic:
            self._resend_topic(m.topic, from_seq=self._low[m.topic])

    async def publish(self, topic: str, payload: bytes | str) -> PublishAck:
        """Publish and wait for the acknowledgement (RequestFailed if refused, TimeoutError if none comes)."""
        fut = await self.publish_nowait(topic, payload)
        if fut.done():
            return fut.result()
        # One timer handle, not an asyncio.timeout() context (a Timeout object, a task lookup, a reschedule and
        # an exit check per publish: a quarter of a publishing device's client CPU by the fan-in profile).  The
        # timer fails the future itself, so a late ACK finds it done and is ignored as before.
        timer = fut.get_loop().call_later(self.request_timeout, _expire, fut, self.request_timeout, self)
        try:
            return await fut
        finally:
            timer.cancel()

    async def publish_nowait(self, topic: str, payload: bytes | str) -> asyncio.Future[PublishAck]:
        """Send a publish and return a future for its acknowledgement; waits only when too many are in flight.

        Raises ValueError at once for an invalid topic name or an oversized payload, TypeError for a payload that
        is neither bytes nor str.  The future fails with ClientClosed if the client is closed before the
        acknowledgement comes (`aclose`).
        """
        if topic not in self._seq:
            validate_topic(topic)
        # (the common case first: bytes within the limit, no conversion and no call)
        data = payload if type(payload) is bytes and len(payload) <= MAX_PAYLOAD_SIZE else payload_bytes(payload)
        inflight = self._inflight
        if not inflight.take():
            await inflight.wait()
        seq = self._seq.get(topic, 0)
        self._seq[topic] = seq + 1
        per_topic = self._pending.get(topic)
        if per_topic is None:  # (not setdefault: that builds an empty dict per publish to throw away)
            per_topic = self._pending[topic] = {}
        base = self._low.get(topic, 0) if per_topic else seq  # the lowest unacknowledged sequence number
        conn = self._conn
        loop = conn.loop if conn is not None else asyncio.get_running_loop()
        fut: asyncio.Future[PublishAck] = loop.create_future()
        now = loop.time()
        p = per_topic[seq] = _Pending(topic, seq, data, base, fut, now)
        if self._throttled and self._throttled.get(topic, 0.0) > now:
            pass  # rate-limited by the broker: the resender sends it after the back-off
        elif conn is not None and self._up and not self._closing:
            # The common case, without a coroutine per publish.  A lone message (a device publishing now and
            # then: nothing else of this client unacknowledged, nothing queued) leaves at once; it must not wait
            # for the turn of the event loop to end.  Otherwise, as Nagle's algorithm does for TCP segments, it
            # is queued and sent at the end of the turn with the others, one batched PUBLISH per topic: batches
            # form only under load, and a steady stream is not split into a lone frame plus a batch each turn.
            if not self._outbox_scheduled and inflight.free == inflight.size - 1:  # (`taken` == 1, inlined)
                conn.send_now(self._frame_of(topic, seq, data, base))
                self.sent_at_once += 1
            else:
                if not self._outbox_scheduled:
                    self._outbox_scheduled = True
                    loop.call_soon(self._send_outbox)
                out = self._outbox.get(topic)
                if out is None:
                    self._outbox[topic] = [p]
                else:
                    out.append(p)
                self._outbox_bytes += len(data)
        else:
            with contextlib.suppress(TimeoutError):  # not connected yet: the resender sends it once reconnected
                await self._send(self._publish_msg([p]))
        self._unyielded += 1
        if self._unyielded >= YIELD_EVERY or self._outbox_bytes > BATCH_BYTES:
            # A tight publish loop must not starve this client's own reading and heartbeats, nor outrun the
            # socket: send what is queued, and wait while the connection's buffer is over its high-water mark.
            self._unyielded = 0
            self._send_outbox()
            conn = self._conn
            if conn is not None and conn.buffered > CLIENT_WRITE_HIGH_WATER:
                await conn.drain()
            else:
                await asyncio.sleep(0)
        return fut

    def _send_outbox(self) -> None:
        self._outbox_scheduled = False
        if not self._outbox:
            return
        out, self._outbox = self._outbox, {}
        self._outbox_bytes = 0
        conn = self._conn
        if conn is None or conn.closed.is_set():
            return  # still pending: the reconnect or the resender sends them
        for pending in out.values():
            self._send_batched(conn, pending)
        conn.flush()  # already a deferred call: write now rather than one more turn of the loop later

    def _frame_of(self, topic: str, seq: int, payload: bytes, base: int) -> bytes:
        """The frame of a PUBLISH of one message (`PublishFrames`: no Publish built per message)."""
        frames = self._frames.get(topic)
        if frames is None:
            frames = self._frames[topic] = PublishFrames(topic, self.publisher_id)
        return frames.frame(seq, payload, base)

    def _publish_msg(self, batch: list[_Pending]) -> Publish:
        first = batch[0]
        more = tuple(p.payload for p in batch[1:]) if len(batch) > 1 else ()
        return Publish(first.topic, self.publisher_id, first.seq, first.payload, first.base, more)

    def _send_batched(self, conn: _Connection, msgs: list[_Pending]) -> None:
        """Send publishes of one topic, consecutive sequence numbers together as batches."""
        i, n = 0, len(msgs)
        while i < n:
            first = msgs[i]
            j, size = i + 1, len(first.payload)
            while (
                self.batch_publishes
                and j < n
                and j - i < MAX_BATCH
                and msgs[j].seq == first.seq + (j - i)
                and size + len(msgs[j].payload) <= BATCH_BYTES
            ):
                size += len(msgs[j].payload)
                j += 1
            if j - i == 1:
                conn.send(self._frame_of(first.topic, first.seq, first.payload, first.base))
            else:
                conn.send(encode_control(self._publish_msg(msgs[i:j])))
            i = j

    async def flush(self) -> None:
        """Wait until every publish sent so far is acknowledged or failed (bound it with asyncio.timeout)."""
        futs = [p.future for per in self._pending.values() for p in per.values()]
        if futs:
            # asyncio.wait, not gather: a time-out around flush() cancels this wait, and gather would cancel
            # the publishes' own futures with it (their ACKs, still on the way, would be lost to the caller).
            await asyncio.wait(futs)

    @property
    def unacknowledged(self) -> int:
        """Publishes still waiting for their acknowledgement."""
        return sum(len(v) for v in self._pending.values())

    def _resend_topic(self, topic: str, from_seq: int = 0) -> None:
        conn = self._conn
        if conn is None or conn.closed.is_set():
            return
        per_topic = self._pending.get(topic, {})
        now = asyncio.get_running_loop().time()
        base = self._low.get(topic, 0)
        again: list[_Pending] = []
        for seq in sorted(per_topic):
            if seq < from_seq:
                continue
            p = per_topic[seq]
            p.sent_at = now
            p.base = base
            again.append(p)
            self.resent += 1
        queued = self._outbox.pop(topic, None)  # the newest of them, not sent yet: they go out with the rest
        if queued:
            self._outbox_bytes -= sum(len(p.payload) for p in queued)
        if again:
            self._resent[topic] = (from_seq, again[-1].seq, now)
        self._send_batched(conn, again)

    def _resend_all(self) -> None:
        self._outbox.clear()  # all of it is pending and goes out again below
        self._outbox_bytes = 0
        for topic in list(self._pending):
            self._resend_topic(topic)

    async def _resender(self) -> None:
        # An acknowledgement that does not come in ack_timeout was lost with a broker on the way: send again.
        loop = asyncio.get_running_loop()
        while True:
            await asyncio.sleep(self.ack_timeout / 2)
            if not self._connected.is_set():
                continue
            now = loop.time()
            for topic, per_topic in list(self._pending.items()):
                delay = self._resend_delay.get(topic, self.ack_timeout)
                first = per_topic.get(self._low.get(topic, 0)) if per_topic else None
                if first is not None and first.sent_at < now - delay:
                    self._resend_delay[topic] = min(delay * 2, MAX_RESEND_DELAY)
                    self._resend_topic(topic)
            self._check_leases(now)
            conn = self._conn
            if conn is not None and conn.buffered:  # a thousand idle devices' ticks need not each await a drain
                await conn.drain()

    def _check_leases(self, now: float) -> None:
        """Subscribe again each subscription that heard nothing from its primary for the subscription lease."""
        lease = self.subscription_lease
        for sub in list(self._subs.values()):
            if sub._heard or sub.restoring or sub.catching_up or sub.closed:
                sub._heard = False
                sub._silent_since = now
            elif now - sub._silent_since >= lease:
                sub._silent_since = now
                self._spawn(self._renew(sub))

    async def _renew(self, sub: Subscription) -> None:
        """The lease passed without a word from the topic's primary: subscribe again, from where it was."""
        if sub.closed or sub.restoring or self._closing:
            return
        self.renewals += 1
        lease = self.subscription_lease
        log.warning("topic %s: nothing from its primary for %.0f s; subscribing again", sub.topic, lease)
        await self._withdraw_subscribe(sub.topic)
        await self._resubscribe(sub, "renewing the subscription to")

    # ---- subscribing, fetching, locating ---------------------------------------------------------------
    def subscribe(
        self,
        topic: str,
        since: float | None = None,
        *,
        on_message: Callable[[ReceivedMessage], None] | None = None,
    ) -> _SubscribeCall:
        """Subscribe to topic: `async with c.subscribe(t) as sub` or `sub = await c.subscribe(t)`.

        With `since` (a timestamp as in the messages' `ts`), stored messages newer than it come first, pulled
        page by page as the consumer takes them (a backlog larger than the queue is not dropped); if the
        overlay refuses the subscription after that catch-up, the iteration raises the refusal (and the
        client logs it).
        With `on_message`, each message goes to that function as soon as it is read, in order, instead of to
        a queue the subscription is iterated over (as paho-mqtt's on_message or nats.py's cb): no task is woken
        per message, which is what a consumer that keeps up wants.  It runs inside the client's read loop, so
        it must not block; if it raises, the error is logged and the subscription goes on.  Such a
        subscription cannot be iterated; `aclose()` unsubscribes as usual.
        Raises RequestFailed (already_subscribed, bad_topic, not_allowed, ...) when the overlay refuses.
        """
        return _SubscribeCall(self, topic, since, on_message)

    async def _subscribe(
        self, topic: str, since: float | None, on_message: Callable[[ReceivedMessage], None] | None = None
    ) -> Subscription:
        validate_topic(topic)
        if topic in self._subs:
            raise RequestFailed("already_subscribed", f"this client is already subscribed to {topic!r}")
        sub = Subscription(self, topic, since, self.subscription_queue, on_message)
        self._subs[topic] = sub
        try:
            if await self._catch_up(sub, wait=False):
                await self._send_subscribe(sub)
            else:
                # The rest of the catch-up, then the SUBSCRIBE, in the background; a reconnect leaves it alone.
                sub.restoring = True
                self._spawn(self._resubscribe(sub, "subscribing"))
        except BaseException:
            self._subs.pop(topic, None)
            raise
        return sub

    async def _unsubscribe(self, sub: Subscription) -> None:
        if self._subs.get(sub.topic) is sub:
            del self._subs[sub.topic]
        if self._closing or not self._connected.is_set():
            return
        with contextlib.suppress(RequestFailed, TimeoutError, ClientError):
            await self._request(Unsubscribe(next(self._corr), sub.topic))

    async def fetch(self, topic: str, since: float = 0.0, limit: int | None = None) -> list[Record]:
        """Stored messages of topic with ts > since, oldest first (all of them, paging as needed, or limit)."""
        validate_topic(topic)
        out: list[Record] = []
        while True:
            want = 512 if limit is None else min(512, limit - len(out))
            reply = await self._request(Fetch(next(self._corr), topic, since, want))
            assert isinstance(reply, Fetched)
            out.extend(reply.records)
            if not reply.more or not reply.records or (limit is not None and len(out) >= limit):
                return out
            since = reply.records[-1].ts

    async def locate(self, topic: str) -> Located:
        """Where topic lives: home, current coordinate, primary/secondary/tertiary and delegate list."""
        validate_topic(topic)
        reply = await self._request(Locate(next(self._corr), topic))
        assert isinstance(reply, Located)
        return reply

    async def move(self, topic: str, to: tuple[float, float]) -> None:
        """Move a topic to coordinate `to` now (an operator's delegation); RequestFailed says why not."""
        validate_topic(topic)
        reply = await self._request(MoveTopic(next(self._corr), topic, (float(to[0]), float(to[1]))))
        assert isinstance(reply, Done)

    async def balance_plan(self, all_topics: bool = False) -> list[dict[str, Any]]:
        """A dry run of the access broker's balancing round: what it would move, and why (nothing moves)."""
        reply = await self._request(BalancePlan(next(self._corr), all_topics))
        assert isinstance(reply, BalancePlanned)
        return [json.loads(p) for p in reply.plans]


class _Window:
    """At most `size` publishes unacknowledged.  Unlike asyncio.Semaphore, taking a free slot is a plain call,
    not a coroutine: on the publish path that difference is measurable."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.free = size
        self._waiters: deque[asyncio.Future[None]] = deque()

    @property
    def taken(self) -> int:
        """Slots taken: the publishes unacknowledged, the one being made included."""
        return self.size - self.free

    def take(self) -> bool:
        """Take a slot if one is free."""
        if self.free > 0 and not self._waiters:
            self.free -= 1
            return True
        return False

    async def wait(self) -> None:
        """Wait until a slot is handed over by release()."""
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiters.append(fut)
        try:
            await fut
        except asyncio.CancelledError:
            if fut.done() and not fut.cancelled():
                self.release()  # handed a slot we no longer want: pass it on
            raise

    def release(self) -> None:
        """Free a slot, handing it to the first waiter if any."""
        while self._waiters:
            fut = self._waiters.popleft()
            if not fut.done():
                fut.set_result(None)
                return
        self.free += 1


class _SubscribeCall:
    """Lets `subscribe()` be awaited or used as `async with`."""

    def __init__(
        self, client: Client, topic: str, since: float | None, on_message: Callable[[ReceivedMessage], None] | None
    ) -> None:
        self._client = client
        self._topic = topic
        self._since = since
        self._on_message = on_message
        self._sub: Subscription | None = None

    def __await__(self) -> Generator[object, None, Subscription]:
        return self._client._subscribe(self._topic, self._since, self._on_message).__await__()

    async def __aenter__(self) -> Subscription:
        self._sub = await self._client._subscribe(self._topic, self._since, self._on_message)
        return self._sub

    async def __aexit__(
        self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        if self._sub is not None:
            await self._sub.aclose()
