"""The connection layer (net/): transports, the shared handshake, requests and heartbeat, and the broker's
links, the client and the admin client over the in-memory transport (over loopback: the other test files)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator

import pytest

from broker.config import BrokerConfig
from broker.link import PeerLink
from broker.node import Broker
from broker.tasks import TaskSet
from client.admin import AdminClient, BrokerUnavailable
from client.client import Client
from net.connection import CloseReason, Heartbeat, LinkClosed, Requests, open_handshake
from net.transport import memory_pair
from overlay.protocol import (
    PROTOCOL_VERSION,
    ControlFrame,
    FrameDecoder,
    Hello,
    Refuse,
    Status,
    StatusReq,
    encode_control,
)

# ---- the in-memory transport --------------------------------------------------------------------------------


async def test_memory_pair_carries_bytes_both_ways_and_ends_with_eof() -> None:
    a, b = memory_pair()
    a.write(b"hello ")
    a.write(b"world")
    assert await b.read(100) == b"hello "
    assert await b.read(3) == b"wor"
    assert await b.read(100) == b"ld"
    b.write(b"back")
    assert await a.read(10) == b"back"
    a.close()
    assert await b.read(10) == b""
    assert a.is_closing() and not b.is_closing()


async def test_memory_pair_backpressure_and_reset() -> None:
    a, b = memory_pair()
    a.set_write_high_water(10)
    a.write(b"x" * 25)
    assert a.write_buffered() == 25
    drained = asyncio.ensure_future(a.drain())
    await asyncio.sleep(0)
    assert not drained.done()  # over the high-water mark until the peer reads
    await b.read(20)
    async with asyncio.timeout(1):
        await drained
    a.abort()
    with pytest.raises(ConnectionResetError):
        await b.read(10)


# ---- shared pieces --------------------------------------------------------------------------------------------


async def test_requests_complete_by_corr_and_fail_on_close() -> None:
    r = Requests()
    one, two = r.add(1), r.add(2)
    with pytest.raises(ValueError, match="already pending"):
        r.add(1)
    assert r.complete(1, StatusReq(1)) and one.result() == StatusReq(1)
    assert not r.complete(7, StatusReq(7)) and not r.complete("x", StatusReq(1))
    r.fail_all(LinkClosed(CloseReason.PEER_CLOSED))
    with pytest.raises(LinkClosed):
        two.result()
    assert len(r) == 0


async def test_heartbeat_declares_a_silent_peer_gone_and_not_a_talking_one() -> None:
    beat = Heartbeat(0.02, 3)
    pings: list[int] = []
    silent: list[float] = []

    async def gone(seconds: float) -> None:
        silent.append(seconds)

    async with asyncio.timeout(5):
        await beat.run(lambda: True, lambda: pings.append(1), gone)
    assert silent and silent[0] > 0.06 and len(pings) >= 3
    talking = Heartbeat(0.02, 3)
    stop = asyncio.get_running_loop().time() + 0.3

    def alive() -> bool:
        talking.received()  # the peer answers every time
        return asyncio.get_running_loop().time() < stop

    await talking.run(alive, lambda: None, gone)
    assert len(silent) == 1


async def test_open_handshake_times_out_and_sees_a_close() -> None:
    a, _silent_peer = memory_pair()
    hello = Hello(PROTOCOL_VERSION, "t", "client")
    with pytest.raises(TimeoutError):
        await open_handshake(a, hello, FrameDecoder(), 0.05)  # nobody answers
    c, d = memory_pair()
    d.close()
    with pytest.raises(ConnectionResetError):
        await open_handshake(c, hello, FrameDecoder(), 1.0)


# ---- a real broker, reached over memory -----------------------------------------------------------------------


@pytest.fixture
async def broker() -> AsyncIterator[Broker]:
    b = Broker(BrokerConfig(coord=(0.5, 0.5), insecure=True, log_level="WARNING"))
    await b.start()
    b.pubsub.resume()
    try:
        yield b
    finally:
        await b.shutdown()


async def test_admin_client_over_memory(broker: Broker) -> None:
    near, far = memory_pair("admin", "broker")
    broker.accept(far)
    admin = await AdminClient.over(near, "memory", timeout=2.0)
    try:
        st = await admin.status()
        assert isinstance(st, Status) and st.node.id == broker.node_id
    finally:
        await admin.aclose()


async def test_client_publishes_and_subscribes_over_memory(broker: Broker) -> None:
    pub_near, pub_far = memory_pair("publisher", "broker")
    sub_near, sub_far = memory_pair("subscriber", "broker")
    broker.accept(pub_far)
    broker.accept(sub_far)
    pub, sub = Client("memory:1", reconnect=False), Client("memory:2", reconnect=False)
    try:
        await pub.attach(pub_near, "memory")
        await sub.attach(sub_near, "memory")
        async with sub.subscribe("grid/mem/v") as s:
            acks = [await pub.publish("grid/mem/v", f"v{i}") for i in range(5)]
            got = [(await anext(s)).payload for _ in range(5)]
    finally:
        await pub.aclose()
        await sub.aclose()
    assert [a.seq for a in acks] == list(range(5))
    assert got == [f"v{i}".encode() for i in range(5)]


async def test_a_peer_link_over_memory_handshakes_requests_and_closes(broker: Broker) -> None:
    near, far = memory_pair("tool", "broker")
    broker.accept(far)
    closed: list[CloseReason] = []
    link = PeerLink(near, _Handler(closed), TaskSet(logging.getLogger("t")), logging.getLogger("t"), outbound=True,
                    heartbeat_interval=0.2, heartbeat_misses=3, hello_timeout=2.0, drain_timeout=1.0)  # fmt: skip
    ok = await link.open(Hello(PROTOCOL_VERSION, "tool-1", "admin"))
    assert ok.node.id == broker.node_id and link.established
    async with asyncio.timeout(2):
        st = await link.request(StatusReq(41))
    assert isinstance(st, Status) and st.corr == 41
    await link.aclose(CloseReason.DONE)
    assert closed == [CloseReason.DONE]
    with pytest.raises(LinkClosed):
        await link.request(StatusReq(42))


async def test_a_refused_handshake_over_memory(broker: Broker) -> None:
    near, far = memory_pair("old", "broker")
    broker.accept(far)
    with pytest.raises(BrokerUnavailable, match="version_mismatch"):
        await AdminClient.over(_Versioned(near, 999), "memory", timeout=2.0)


class _Versioned:
    """A transport that rewrites nothing but the HELLO's protocol version on the way out (an old tool)."""

    def __init__(self, inner: object, version: int) -> None:
        self._inner = inner
        self._version = version

    def __getattr__(self, name: str) -> object:
        return getattr(self._inner, name)

    def write(self, data: bytes) -> None:
        frames = FrameDecoder().feed(data)
        if frames and isinstance(frames[0], ControlFrame) and isinstance(frames[0].message, Hello):
            h = frames[0].message
            data = encode_control(Hello(self._version, h.node, h.role, token=h.token))
        self._inner.write(data)  # type: ignore[attr-defined]


class _Handler:
    """The LinkHandler of an admin tool's outbound link: nothing to decide, closes are recorded."""

    def __init__(self, closed: list[CloseReason]) -> None:
        self.closed = closed

    def on_hello(self, link: PeerLink, hello: Hello) -> Refuse:
        return Refuse("not_accepting", "an outbound link is never asked to accept a HELLO")

    def on_established(self, link: PeerLink) -> None:
        pass

    def on_message(self, link: PeerLink, msg: object) -> None:
        pass

    def on_routed(self, link: PeerLink, frame: object) -> None:
        pass

    def needs_flush(self) -> bool:
        return False

    async def flush(self) -> None:
        pass

    def on_closed(self, link: PeerLink, reason: CloseReason, detail: str) -> None:
        self.closed.append(reason)
