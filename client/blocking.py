"""The client for code without an event loop: `BlockingClient`, each call returning when its answer came.

    with BlockingClient(["127.0.0.1:7001", "127.0.0.1:7002"]) as c:
        c.publish("grid/f1/voltage", b"230.1")             # returns once stored (and copied at level >= 2)
        with c.subscribe("grid/f1/voltage", since=0) as sub:
            for msg in sub:                                 # blocks for the next message
                ...

A gateway script, a SCADA poller or a notebook is often not asyncio code, and paho-mqtt, kafka-python and
pika's BlockingConnection serve it as it is.  Here the one client (client/client.py, with its reconnects,
re-sends, re-subscriptions and catch-up) runs on an event loop of its own, on a thread of its own; each method
hands its call to that loop and waits for the result, so what the async client guarantees holds unchanged, and
its errors (RequestFailed, ConnectError, TimeoutError, ...) are raised in the caller's thread.

A subscription is read from the caller's thread: `get(timeout)` or iteration takes the messages the client
has queued for it, up to READ_BATCH per crossing between the threads, so a reader that keeps up pays one crossing
per burst, not per message; one that falls behind leaves them in the client's queue, where the async
client's rules apply (a catch-up from `since` waits for room; a live stream past the queue drops and counts in
`dropped`).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import functools
import threading
from collections import deque
from collections.abc import Callable, Coroutine, Iterator, Sequence
from types import TracebackType
from typing import Any, Final, Self, TypeVar

import uvloop

from client.client import Client, PublishAck, ReceivedMessage, Subscription, payload_bytes
from client.errors import ClientClosed, ClientError
from overlay.pubsub import Located, Record
from overlay.topics import validate_topic

T = TypeVar("T")

# Messages a subscription's reader takes in one crossing between the threads.
READ_BATCH: Final = 256
# Publishes handed to the client's thread and not yet taken by it: beyond, publish_nowait waits (memory stays
# bounded when a caller publishes faster than the client's window lets messages out).
HANDOFF_LIMIT: Final = 4096
# How long a caller waiting for room sleeps before it looks again (the drain wakes it sooner).
ROOM_POLL: Final = 0.05
# Topic names remembered as valid (a publisher of made-up names validates each from then on).
MAX_VALIDATED: Final = 10_000
# How long close() waits for the client's thread to end after the client closed.
THREAD_JOIN_TIMEOUT: Final = 10.0


class BlockingClient:
    """The asyncio `Client` behind blocking calls; `close()` (or `with`) ends it and its thread.

    brokers and every keyword are the `Client`'s (client/client.py).  Connects at once: ConnectError if no
    broker of the list answers within connect_timeout."""

    def __init__(self, brokers: Sequence[str] | str, **options: Any) -> None:
        self._loop = uvloop.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="sedax-client", daemon=True)
        self._thread.start()
        self._closed = False
        self._subscriptions: list[BlockingSubscription] = []
        # Publishes handed from callers' threads to the client's, in call order (publish_nowait, _drain).
        self._handoff: deque[tuple[str, bytes, concurrent.futures.Future[PublishAck]]] = deque()
        self._lock = threading.Lock()
        # Set while fewer than HANDOFF_LIMIT wait to be taken (an Event: a test of a flag per publish, where a
        # Semaphore took a Condition's lock twice).
        self._room = threading.Event()
        self._room.set()
        self._topics: set[str] = set()  # names validated already (the async client keeps the same shortcut)
        self._draining = False
        self._drainer: asyncio.Task[None] | None = None
        self._taking: concurrent.futures.Future[PublishAck] | None = None  # the one _drain hands over now
        try:
            self._client: Client
            self._client, self._drained = self._call(_made(brokers, options))
            self._call(self._client.connect())
        except BaseException:
            self._stop_loop()
            raise

    # ---- lifecycle -----------------------------------------------------------------------------------

    def __enter__(self) -> Self:
        return self

    def __exit__(self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None) -> None:
        self.close(None if et is None else 0)

    def close(self, flush_timeout: float | None = None) -> None:
        """Wait for the publishes handed over and in flight (up to request_timeout each by default, as
        Client.aclose; 0: not at all), close the connection and end the client's thread.  A second call does
        nothing; publishes never sent fail with ClientClosed."""
        if self._closed:
            return
        self._closed = True  # (publish_nowait refuses from now on)
        try:
            self._call(self._close(flush_timeout))
        finally:
            self._stop_loop()

    async def _close(self, flush_timeout: float | None) -> None:
        # The publishes still handed off go to the client first (within the same time the client gives its own
        # in flight), so that its close waits for them as for the others.
        wait = self._client.request_timeout if flush_timeout is None else flush_timeout
        if wait > 0:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(wait):
                    await self._drained.wait()
        await self._client.aclose(flush_timeout)

    def _stop_loop(self) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(THREAD_JOIN_TIMEOUT)
        if not self._thread.is_alive():
            self._loop.close()
        for sub in self._subscriptions:  # a reader still waiting on the stopped loop gets None, not a hang
            sub._end_reading()
        with self._lock:  # publishes never handed over: their futures fail, no caller waits forever
            left = [acked for _, _, acked in self._handoff]
            self._handoff.clear()
        if self._taking is not None:
            left.append(self._taking)
        for acked in left:
            with contextlib.suppress(concurrent.futures.InvalidStateError):
                acked.set_exception(ClientClosed("the client was closed before this publish was sent"))

    def _call(self, coro: Coroutine[Any, Any, T]) -> T:
        """Run coro on the client's loop and wait for its result (its exception is raised here)."""
        if not self._thread.is_alive():
            coro.close()
            raise ClientClosed("the client was closed")
        try:
            self._not_on_own_thread()
        except RuntimeError:
            coro.close()
            raise
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result()

    def _not_on_own_thread(self) -> None:
        if threading.get_ident() == self._thread.ident:
            raise RuntimeError(
                "a BlockingClient call from its own thread (an on_message function) would wait for itself forever: "
                "hand the message to a thread of yours (a queue.Queue) and call the client there"
            )

    @property
    def address(self) -> str | None:
        """The access broker currently connected, if any."""
        return self._client.address

    # ---- publishing ----------------------------------------------------------------------------------

    def publish(self, topic: str, payload: bytes | str) -> PublishAck:
        """Publish and return the acknowledgement: RequestFailed if refused, TimeoutError if none comes within the
        client's request_timeout (the publish stays pending and is re-sent, as with the async client)."""
        acked = self.publish_nowait(topic, payload)
        limit = self._client.request_timeout
        try:
            return acked.result(limit)
        except concurrent.futures.TimeoutError:
            why = self._client.reconnect_error
            offline = f"; not connected: {why}" if why else ""
            raise TimeoutError(f"no acknowledgement within {limit:g} s (request_timeout){offline}") from None

    def publish_nowait(self, topic: str, payload: bytes | str) -> concurrent.futures.Future[PublishAck]:
        """Hand a publish to the client and return a future of its acknowledgement (`.result(timeout)`).

        It does not wait for the client's thread: publishes queue up in call order (so those of one thread keep
        their order, `publish` included) and the client's thread takes them as fast as its window lets it.  It
        blocks only while HANDOFF_LIMIT publishes wait to be taken.  A bad topic name or payload raises here, as
        the async client's does."""
        if topic not in self._topics:
            validate_topic(topic)
            if len(self._topics) < MAX_VALIDATED:
                self._topics.add(topic)
        data = payload_bytes(payload)
        self._not_on_own_thread()
        if not self._thread.is_alive() or self._closed:
            raise ClientClosed("the client was closed")
        while len(self._handoff) >= HANDOFF_LIMIT:
            self._room.clear()
            if len(self._handoff) >= HANDOFF_LIMIT:  # (taken meanwhile: the drain sets it only when it finds it clear)
                self._room.wait(ROOM_POLL)
        acked: concurrent.futures.Future[PublishAck] = concurrent.futures.Future()
        with self._lock:
            self._handoff.append((topic, data, acked))
            start, self._draining = not self._draining, True
        if start:
            self._loop.call_soon_threadsafe(self._start_drain)
        return acked

    def _start_drain(self) -> None:
        self._drained.clear()
        self._drainer = self._loop.create_task(self._drain())  # (kept: the loop holds only a weak reference)

    async def _drain(self) -> None:
        """On the client's thread: pass the handed-off publishes to the client, in order."""
        while True:
            with self._lock:
                if not self._handoff:
                    self._draining = False
                    self._drained.set()
                    return
                topic, data, acked = self._handoff.popleft()
            if not self._room.is_set():
                self._room.set()
            self._taking = acked
            try:
                fut = await self._client.publish_nowait(topic, data)
            except (ClientError, ValueError) as exc:  # (the client closed meanwhile, or refused it at once)
                acked.set_exception(exc)
                continue
            finally:
                self._taking = None
            fut.add_done_callback(functools.partial(_copy_outcome, acked))

    def flush(self) -> None:
        """Wait until every publish handed to the client so far is acknowledged."""
        self._call(self._flushed())

    async def _flushed(self) -> None:
        await self._drained.wait()
        await self._client.flush()

    @property
    def unacknowledged(self) -> int:
        """Publishes handed over and not yet acknowledged: those the client's thread has not taken yet, and the
        client's own (counted on its thread, where they change)."""
        return self._call(self._unacknowledged())

    async def _unacknowledged(self) -> int:
        with self._lock:
            waiting = len(self._handoff) + (self._taking is not None)  # (_taking: waiting for the client's window)
        return waiting + self._client.unacknowledged

    # ---- subscribing and reading ---------------------------------------------------------------------

    def subscribe(
        self,
        topic: str,
        since: float | None = None,
        *,
        on_message: Callable[[ReceivedMessage], None] | None = None,
    ) -> BlockingSubscription:
        """Subscribe to topic; read the messages with `get()` or by iterating, or give `on_message`, which is then
        called on the client's thread as each message is read (it must return quickly, as paho-mqtt's does).
        since: as `Client.subscribe` (stored messages newer than this timestamp first)."""
        sub = BlockingSubscription(self, self._call(_subscribed(self._client, topic, since, on_message)))
        self._subscriptions = [s for s in self._subscriptions if not s._ended] + [sub]
        return sub

    def fetch(self, topic: str, since: float = 0.0, limit: int | None = None) -> list[Record]:
        """Stored messages of topic with ts > since, oldest first (Client.fetch)."""
        return self._call(self._client.fetch(topic, since, limit))

    def locate(self, topic: str) -> Located:
        """Where topic lives (Client.locate)."""
        return self._call(self._client.locate(topic))


class BlockingSubscription:
    """One topic's messages, read from one thread of the caller's (its buffer is that thread's); `close()` (or
    `with`) unsubscribes, from any thread."""

    def __init__(self, owner: BlockingClient, sub: Subscription) -> None:
        self._owner = owner
        self._sub = sub
        self.topic = sub.topic
        self._ready: deque[ReceivedMessage] = deque()
        # A read handed to the client's loop that has not answered yet.  It is not cancelled when get() times out
        # (a cancelled read could take messages and then lose them); the next get() waits on it again.
        self._reading: concurrent.futures.Future[list[ReceivedMessage]] | None = None
        self._ended = False

    def get(self, timeout: float | None = None) -> ReceivedMessage | None:
        """The next message, waiting up to timeout seconds (None: as long as it takes); None if none came in
        time or the subscription ended.  Raises what ended it, if the overlay refused it (RequestFailed)."""
        if self._ready:
            return self._ready.popleft()
        if self._ended:
            return None
        if self._reading is None:
            self._reading = asyncio.run_coroutine_threadsafe(_read(self._sub), self._owner._loop)
        try:
            batch = self._reading.result(timeout)
        except concurrent.futures.TimeoutError:
            return None
        except concurrent.futures.CancelledError:  # the client was closed under the read: the end, as below
            batch = []
        except BaseException:
            self._reading = None
            self._ended = True
            raise
        self._reading = None
        if not batch:
            self._ended = True
            return None
        self._ready.extend(batch)
        return self._ready.popleft()

    def _end_reading(self) -> None:
        self._ended = True
        if self._reading is not None:
            self._reading.cancel()

    def __iter__(self) -> Iterator[ReceivedMessage]:
        while (msg := self.get()) is not None:
            yield msg

    @property
    def dropped(self) -> int:
        """Messages of the live stream dropped because the reader fell behind the client's queue."""
        return self._sub.dropped

    def close(self) -> None:
        """Unsubscribe; a reader waiting in get() gets None."""
        if self._owner._thread.is_alive():
            self._owner._call(self._sub.aclose())
        self._ended = True

    def __enter__(self) -> Self:
        return self

    def __exit__(self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None) -> None:
        self.close()


async def _made(brokers: Sequence[str] | str, options: dict[str, Any]) -> tuple[Client, asyncio.Event]:
    # Made on its loop's thread: what the client creates (events, futures, its connection) belongs to that loop.
    drained = asyncio.Event()
    drained.set()  # (nothing handed off yet)
    return Client(brokers, **options), drained


async def _subscribed(
    client: Client, topic: str, since: float | None, on_message: Callable[[ReceivedMessage], None] | None
) -> Subscription:
    return await client.subscribe(topic, since, on_message=on_message)


def _copy_outcome(to: concurrent.futures.Future[PublishAck], fut: asyncio.Future[PublishAck]) -> None:
    """An acknowledgement's future on the client's loop, copied to the caller's concurrent future."""
    if fut.cancelled():
        to.cancel()
    elif (exc := fut.exception()) is not None:
        to.set_exception(exc)
    else:
        to.set_result(fut.result())


async def _read(sub: Subscription) -> list[ReceivedMessage]:
    """The next message and those queued behind it (up to READ_BATCH); [] once the subscription ended."""
    try:
        first = await anext(sub)
    except StopAsyncIteration:
        return []
    return [first, *sub.take_queued(READ_BATCH - 1)]
