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
import threading
from collections import deque
from collections.abc import Callable, Coroutine, Iterator, Sequence
from types import TracebackType
from typing import Any, Final, Self, TypeVar

import uvloop

from client.client import Client, PublishAck, ReceivedMessage, Subscription
from client.errors import ClientClosed
from overlay.pubsub import Located, Record

T = TypeVar("T")

# Messages a subscription's reader takes in one crossing between the threads.
READ_BATCH: Final = 256
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
        try:
            self._client: Client = self._call(_made(brokers, options))
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
        """Wait for the publishes in flight (Client.aclose: up to request_timeout by default, 0: not at all), close
        the connection and end the client's thread.  A second call does nothing."""
        if self._closed:
            return
        self._closed = True
        try:
            self._call(self._client.aclose(flush_timeout))
        finally:
            self._stop_loop()

    def _stop_loop(self) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(THREAD_JOIN_TIMEOUT)
        if not self._thread.is_alive():
            self._loop.close()
        for sub in self._subscriptions:  # a reader still waiting on the stopped loop gets None, not a hang
            sub._end_reading()

    def _call(self, coro: Coroutine[Any, Any, T]) -> T:
        """Run coro on the client's loop and wait for its result (its exception is raised here)."""
        if not self._thread.is_alive():
            coro.close()
            raise ClientClosed("the client was closed")
        if threading.get_ident() == self._thread.ident:
            coro.close()
            raise RuntimeError(
                "a BlockingClient call from its own thread (an on_message function) would wait for itself forever: "
                "hand the message to a thread of yours (a queue.Queue) and call the client there"
            )
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result()

    @property
    def address(self) -> str | None:
        """The access broker currently connected, if any."""
        return self._client.address

    # ---- publishing ----------------------------------------------------------------------------------

    def publish(self, topic: str, payload: bytes | str) -> PublishAck:
        """Publish and return the acknowledgement (RequestFailed if refused, TimeoutError if none comes)."""
        return self._call(self._client.publish(topic, payload))

    def publish_nowait(self, topic: str, payload: bytes | str) -> concurrent.futures.Future[PublishAck]:
        """Send a publish and return a future of its acknowledgement (`.result(timeout)`); blocks only while too
        many publishes are in flight.  Publishes of one thread keep their order."""
        return self._call(_queued(self._client, topic, payload))

    def flush(self) -> None:
        """Wait until every publish sent so far is acknowledged."""
        self._call(self._client.flush())

    @property
    def unacknowledged(self) -> int:
        """Publishes sent and not yet acknowledged (counted on the client's thread, where they change)."""
        return self._call(_unacknowledged(self._client))

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
        except concurrent.futures.CancelledError:  # the client was closed under the read
            self._reading = None
            self._ended = True
            return None
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


async def _made(brokers: Sequence[str] | str, options: dict[str, Any]) -> Client:
    # Made on its loop's thread: what the client creates (events, futures, its connection) belongs to that loop.
    return Client(brokers, **options)


async def _unacknowledged(client: Client) -> int:
    return client.unacknowledged


async def _subscribed(
    client: Client, topic: str, since: float | None, on_message: Callable[[ReceivedMessage], None] | None
) -> Subscription:
    return await client.subscribe(topic, since, on_message=on_message)


async def _queued(client: Client, topic: str, payload: bytes | str) -> concurrent.futures.Future[PublishAck]:
    acked = await client.publish_nowait(topic, payload)
    out: concurrent.futures.Future[PublishAck] = concurrent.futures.Future()

    def copy(fut: asyncio.Future[PublishAck]) -> None:
        if fut.cancelled():
            out.cancel()
        elif (exc := fut.exception()) is not None:
            out.set_exception(exc)
        else:
            out.set_result(fut.result())

    acked.add_done_callback(copy)
    return out


async def _read(sub: Subscription) -> list[ReceivedMessage]:
    """The next message and those queued behind it (up to READ_BATCH); [] once the subscription ended."""
    try:
        first = await anext(sub)
    except StopAsyncIteration:
        return []
    return [first, *sub.take_queued(READ_BATCH - 1)]
