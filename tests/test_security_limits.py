"""Backpressure and per-client limits on real broker processes: a bad client must not hurt anyone else.

These limits do not depend on TLS, so the brokers here run on plain TCP (faster to set up).
"""

from __future__ import annotations

import asyncio
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from cluster import connects, log_has, log_size, raw_connect, read_until_eof, wait_for
from conftest import FAST_ARGS

from cli.cluster import BrokerProcess, LocalCluster
from client.client import Client, ConnectError, RequestFailed
from net.credentials import Credentials
from overlay.geometry import geohash
from overlay.protocol import (
    PROTOCOL_VERSION,
    ControlFrame,
    Frame,
    FrameDecoder,
    Hello,
    HelloOk,
    Pong,
    encode_control,
    parse_address,
)
from overlay.pubsub import Ack, Nack, Publish, Subscribe, Subscribed

pytestmark = pytest.mark.slow

CENTRE = [(0.5, 0.5)]


async def counters(cluster: LocalCluster) -> dict[str, int]:
    return dict((await cluster.statuses())[cluster.nodes[0].node_id].counters)


@pytest.fixture(scope="module")
def limited(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    """One broker with small limits on payloads, frames, publish rate and idleness."""
    args = (
        *FAST_ARGS,
        "--max-payload", "1000", "--max-frame-size", "8192", "--publish-rate", "200", "--publish-burst", "20",
        "--idle-timeout", "1.0",
    )  # fmt: skip
    cluster = LocalCluster(
        1, coords=CENTRE, resilience=1, tls=False, state_dir=tmp_path_factory.mktemp("limited"), broker_args=args
    )
    try:
        asyncio.run(cluster.start())
        yield cluster
    finally:
        asyncio.run(cluster.close())


async def test_payload_over_the_limit_is_refused(limited: LocalCluster) -> None:
    async with Client(limited.nodes[0].listen) as c:
        with pytest.raises(RequestFailed, match="too_large: payload of 1001 bytes is over this broker's limit of 1000"):
            await c.publish("grid/big/voltage", b"x" * 1001)
        assert (await c.publish("grid/big/voltage", b"x" * 1000)).seq == 1


async def test_one_message_publishes_sent_together_are_each_stored_and_an_oversized_one_refused_alone(
    limited: LocalCluster,
) -> None:
    # The access broker handles consecutive one-message PUBLISHes that arrive in one read as one batch
    # (overlay.pubsub.coalesce_publishes).  Every message is still stored and delivered in order, and a payload
    # over --max-payload is never joined to a batch: it alone is refused (too_large), not the ones before it.
    bp = limited.nodes[0]
    topic = "grid/together/voltage"
    before = (await counters(limited))["coalesced"]
    async with Client(bp.listen) as sub_c:
        sub = await sub_c.subscribe(topic)
        reader, writer = await raw_connect(bp)
        writer.write(encode_control(Hello(PROTOCOL_VERSION, "together", "client")))
        dec, acked, nacks = FrameDecoder(), -1, []
        async with asyncio.timeout(10):
            hello: list[Frame] = []
            while not hello:
                hello = dec.feed(await reader.read(65536))
        assert isinstance(hello[0], ControlFrame) and isinstance(hello[0].message, HelloOk)
        frames = [encode_control(Publish(topic, "together", i, b"m%d" % i, 0)) for i in range(12)]
        frames.append(encode_control(Publish(topic, "together", 12, b"x" * 1001, 0)))
        writer.write(b"".join(frames))  # one write: the broker reads them together
        await writer.drain()
        async with asyncio.timeout(10):
            while acked < 11 or not nacks:
                for f in dec.feed(await reader.read(65536)):
                    if isinstance(f, ControlFrame) and isinstance(f.message, Ack):
                        acked = max(acked, f.message.seq)
                    elif isinstance(f, ControlFrame) and isinstance(f.message, Nack):
                        nacks.append((f.message.code, f.message.seq))
            got = [(await anext(sub)).payload for _ in range(12)]
        writer.close()
    assert acked == 11 and nacks == [("too_large", 12)]
    assert got == [b"m%d" % i for i in range(12)]
    # 11 when the 12 arrive in one read (the loopback's usual), fewer if the kernel split the write.
    assert 1 <= (await counters(limited))["coalesced"] - before <= 11
    # PUBLISHes written together with the HELLO are coalesced too, once the HELLO has made the link.
    before = (await counters(limited))["coalesced"]
    reader, writer = await raw_connect(bp)
    hello_and_publishes = [encode_control(Hello(PROTOCOL_VERSION, "eager", "client"))]
    hello_and_publishes += [encode_control(Publish(topic, "eager", i, b"e%d" % i, 0)) for i in range(5)]
    writer.write(b"".join(hello_and_publishes))
    dec, acked = FrameDecoder(), -1
    async with asyncio.timeout(10):
        while acked < 4:
            for f in dec.feed(await reader.read(65536)):
                if isinstance(f, ControlFrame) and isinstance(f.message, Ack):
                    acked = max(acked, f.message.seq)
    writer.close()
    assert 1 <= (await counters(limited))["coalesced"] - before <= 4


async def test_frame_over_the_limit_closes_the_connection(limited: LocalCluster) -> None:
    bp = limited.nodes[0]
    since = log_size(bp)
    reader, writer = await raw_connect(bp)
    writer.write(encode_control(Hello(PROTOCOL_VERSION, "big", "client")))
    writer.write(encode_control(Publish("grid/big/voltage", "big", 0, b"x" * 20_000)))
    await read_until_eof(reader, 5.0)
    writer.close()
    await wait_for(lambda: log_has(bp, "exceeds the limit of 8192 bytes", since), 5.0, "frame limit logged")


async def test_publish_rate_limit_throttles_without_losing_anything(limited: LocalCluster) -> None:
    addr = limited.nodes[0].listen
    before = await counters(limited)
    async with Client(addr) as sub_c, Client(addr, ack_timeout=0.2) as pub:
        sub = await sub_c.subscribe("grid/rate/voltage")
        # One batch, however large, passes a full bucket and leaves it in debt: sent back to back, the messages
        # could reach the broker in one read, be taken as one batch (coalesce_publishes) and all pass.  So the
        # first 100 are acknowledged first; the next 200 then come into their debt (100 - 20 tokens at 200/s:
        # refused unless the acknowledgements took 0.4 s).
        acks = [await pub.publish_nowait("grid/rate/voltage", f"{i}") for i in range(100)]
        async with asyncio.timeout(60):
            await asyncio.gather(*acks)
        acks += [await pub.publish_nowait("grid/rate/voltage", f"{i}") for i in range(100, 300)]
        async with asyncio.timeout(60):
            await asyncio.gather(*acks)
            got = [(await anext(sub)).seq for _ in range(300)]
        assert got == list(range(300))  # NACK rate_limited made the client wait and re-send, in order
        assert pub.rate_limited > 0
    after = await counters(limited)
    assert after["rate_limited"] - before["rate_limited"] == pub.rate_limited


async def test_idle_clients_are_closed_unless_subscribed(limited: LocalCluster) -> None:
    bp = limited.nodes[0]
    since = log_size(bp)
    before = await counters(limited)
    events: list[str] = []
    async with (
        Client(bp.listen, reconnect=False, on_event=lambda kind, _: events.append(kind)) as idle,
        Client(bp.listen) as subscriber,
        Client(bp.listen) as pub,
    ):
        sub = await subscriber.subscribe("grid/idle/voltage")
        await wait_for(lambda: log_has(bp, "reason=idle_timeout", since), 10.0, "idle client closed")
        await wait_for(lambda: idle.address is None, 5.0, "idle client saw the close")
        # The subscriber sent nothing since its SUBSCRIBE either, but it holds a subscription.
        assert subscriber.address == bp.listen
        await pub.publish("grid/idle/voltage", b"still here")
        async with asyncio.timeout(10):
            assert (await anext(sub)).payload == b"still here"
    after = await counters(limited)
    assert after["idle_closed"] - before["idle_closed"] >= 1


async def test_max_connections_refused_with_a_reason(tmp_path: Path) -> None:
    args = (*FAST_ARGS, "--max-connections", "2")
    async with LocalCluster(1, coords=CENTRE, tls=False, state_dir=tmp_path, broker_args=args) as cluster:
        addr = cluster.nodes[0].listen
        async with Client(addr) as c1:
            async with Client(addr):
                third = Client(addr, reconnect=False)
                with pytest.raises(ConnectError, match="too_many_connections: this broker serves at most 2"):
                    await third.connect()
                await third.aclose()
            assert c1.address == addr
            await wait_for(lambda: connects(addr), 10.0, "a slot freed by the closed client")


# ------------------------------------------------------------------------------------ slow subscribers

MESSAGES = 2000
# 16 MB in all.  The slow subscriber's backlog overflows the broker's 2 MiB bound after at most ~6 MB (the
# bound, plus a socket send buffer of at most 4 MiB, plus its 8 KiB receive window); a subscriber that reads
# has a receive window of megabytes on top, so only a stall of many MB would drop it.
PAYLOAD = b"v" * 8192
SEND_BUFFER = 2 << 20
WINDOW = 128  # messages (1 MiB) the good subscriber may lag behind the publisher


async def _slow_subscriber(bp: BrokerProcess, topic: str) -> tuple[asyncio.StreamWriter, asyncio.Task[None]]:
    """A client that subscribes and then never reads again (but stays alive: it keeps sending PONGs)."""
    host, port = parse_address(bp.listen)
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # small, so its backlog lands on the broker
    sock.setblocking(False)
    await asyncio.get_running_loop().sock_connect(sock, (host, port))
    reader, writer = await asyncio.open_connection(sock=sock)
    writer.write(encode_control(Hello(PROTOCOL_VERSION, "slow", "client")))
    writer.write(encode_control(Subscribe(1, topic)))
    decoder = FrameDecoder()
    seen: list[object] = []
    async with asyncio.timeout(10):
        while not any(isinstance(m, Subscribed) for m in seen):
            data = await reader.read(65536)
            assert data, "broker closed the connection"
            seen += [f.message for f in decoder.feed(data) if isinstance(f, ControlFrame)]
    assert isinstance(seen[0], HelloOk)

    async def alive() -> None:
        while True:
            writer.write(encode_control(Pong(0)))
            await asyncio.sleep(0.1)

    return writer, asyncio.create_task(alive())


async def _stream(addr: str, topic: str) -> float:
    """Publish MESSAGES to topic and wait until a well-behaved subscriber has them all; returns msg/s.

    The publisher stays within WINDOW messages of what the subscriber consumed, so the subscriber is one
    that keeps up (the publisher shares this process and could otherwise outrun its reading).
    """
    async with Client(addr) as sub_c, Client(addr, max_inflight=256) as pub:
        sub = await sub_c.subscribe(topic)
        got: list[int] = []
        progress = asyncio.Event()

        async def consume() -> None:
            async for m in sub:
                got.append(m.seq)
                progress.set()
                if len(got) == MESSAGES:
                    return

        start = time.monotonic()
        consumer = asyncio.create_task(consume())
        acks = []
        async with asyncio.timeout(120):
            for i in range(MESSAGES):
                acks.append(await pub.publish_nowait(topic, PAYLOAD))
                while i - len(got) > WINDOW:
                    progress.clear()
                    await progress.wait()
            await consumer
            await asyncio.gather(*acks)
        rate = MESSAGES / (time.monotonic() - start)
        assert got == list(range(MESSAGES)) and sub.dropped == 0
        assert sub_c.reconnects == 0  # it was never dropped itself
    return rate


@pytest.mark.parametrize("policy", ["disconnect", "drop"])
async def test_slow_subscriber_does_not_slow_delivery_to_others(tmp_path: Path, policy: str) -> None:
    args = (*FAST_ARGS, "--client-send-buffer", str(SEND_BUFFER), "--slow-consumer-policy", policy)
    async with LocalCluster(1, coords=CENTRE, resilience=1, tls=False, state_dir=tmp_path, broker_args=args) as c:
        bp = c.nodes[0]
        since = log_size(bp)
        await _stream(bp.listen, "grid/warm-up/voltage")  # the first stream of a fresh broker is slower
        alone = await _stream(bp.listen, "grid/alone/voltage")
        writer, alive = await _slow_subscriber(bp, "grid/slow/voltage")
        try:
            beside = await _stream(bp.listen, "grid/slow/voltage")
            st = await counters(c)
            if policy == "disconnect":
                await wait_for(lambda: log_has(bp, "reason=slow_consumer", since), 10.0, "slow consumer dropped")
                assert st["slow_consumers"] == 1
                assert log_has(bp, "queued for a peer that does not read (--client-send-buffer)", since)
            else:
                assert st["slow_consumers"] == 0 and st["slow_consumer_drops"] > 0
                assert st["sessions"] == 1  # the slow one, still connected; its frames were dropped
        finally:
            alive.cancel()
            writer.transport.abort()
        print(
            f"\nslow consumer ({policy}): good subscriber {alone:,.0f} msg/s alone, {beside:,.0f} msg/s beside a "
            f"subscriber that stopped reading ({beside / alone:.2f}x); {MESSAGES} x {len(PAYLOAD)} B, all delivered"
        )


# ---- memory: --max-memory ------------------------------------------------------------------------------------


async def _fill_until_refused(c: Client, topics: list[str], payload: bytes) -> RequestFailed:
    """Publish payload round the topics until a publish is refused; bounded (the refusal is what is tested)."""
    async with asyncio.timeout(90.0):
        k = 0
        while True:
            try:
                await c.publish(topics[k % len(topics)], payload)
            except TimeoutError:
                pass  # stored at a primary whose copy refused it: acknowledged once the copy has room
            except RequestFailed as exc:
                return exc
            k += 1


async def _taken_again(c: Client, topic: str) -> bool:
    try:
        await c.publish(topic, b"room again")
    except RequestFailed as exc:
        assert exc.code == "storage_full", exc
        return False
    return True


async def test_a_broker_over_its_memory_limit_refuses_new_messages_until_retention_frees_room(tmp_path: Path) -> None:
    # Retention bounds each topic, not how many topics a broker holds: publishers filling topics grew a broker's
    # memory until the kernel killed it (and a restart read its data directory back into memory, to be killed
    # again).  Over --max-memory (estimated: payload, publisher id and 240 B per message) the broker refuses new
    # publishes with storage_full naming the setting, serves what it holds, and takes publishes again once
    # retention freed room.
    args = (*FAST_ARGS, "--max-memory", "2000000", "--retention-seconds", "3")
    async with LocalCluster(1, coords=CENTRE, resilience=1, tls=False, state_dir=tmp_path, broker_args=args) as cl:
        async with Client(cl.nodes[0].listen, credentials=Credentials(insecure=True)) as c:
            topics = [f"grid/mem/{i}" for i in range(8)]
            refused = await _fill_until_refused(c, topics, bytes(10_000))
            assert refused.code == "storage_full", refused
            assert "not stored: this broker's stored messages take" in str(refused), str(refused)
            assert "more than its --max-memory (1.9 MiB)" in str(refused), str(refused)  # (2,000,000 B)
            assert len(await c.fetch(topics[0])) > 0  # what it holds is served
            await wait_for(lambda: _taken_again(c, topics[1]), 30.0, "publishes taken again once retention freed room")
        assert (await counters(cl))["lost"] == 0
        assert log_has(cl.nodes[0], "within --max-memory again: publishes are taken")


async def test_a_copy_over_its_memory_limit_makes_its_primary_refuse_until_it_has_room(tmp_path: Path) -> None:
    # Level 2: the secondary is over its --max-memory.  It refuses the primary's batches of new messages by name
    # (as a copy on a full disk does), the primary refuses new publishes with that text, and once the copy's
    # retention freed room the publishes are taken again.
    topic = "grid/mem/copy"
    home = geohash(topic)
    near = (home[0] + (-0.05 if home[0] > 0.5 else 0.05), home[1])
    args = (*FAST_ARGS, "--retention-seconds", "3")
    async with LocalCluster(
        2, coords=[home, near], resilience=2, tls=False, state_dir=tmp_path, broker_args=args
    ) as cl:
        await cl.stop(1)
        await cl.restart(1, "--max-memory", "2000000")
        await cl.wait_converged(30.0)
        async with Client(cl.nodes[0].listen, credentials=Credentials(insecure=True), request_timeout=3.0) as c:
            refused = await _fill_until_refused(c, [topic], bytes(10_000))
            assert refused.code == "storage_full", refused
            text = str(refused)
            assert f"a broker that must hold a copy of '{topic}' has no room for it (n1: this broker's" in text, text
            assert "--max-memory" in text, text
            await wait_for(lambda: _taken_again(c, topic), 30.0, "publishes taken again once the copy has room")
        statuses = await cl.statuses()
        assert statuses["n0"].counters["lost"] == 0
        assert statuses["n1"].counters["copies_refused"] >= 1
