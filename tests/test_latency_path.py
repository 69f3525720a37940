"""The per-message path's latency rules, counted rather than timed: a lone publish leaves at once, a burst
is batched, the transport does not hold writes back, a broker freezes its start-up heap, and the trace mode
records stages only when on."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from cluster import log_has, wait_for

from broker.config import BrokerConfig
from broker.node import Broker
from cli.cluster import LocalCluster
from client.client import Client
from net import trace
from net.transport import StreamTransport, connect_broker
from overlay.protocol import ControlFrame, FrameDecoder, Ping, encode_control

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture
async def broker() -> AsyncIterator[Broker]:
    b = Broker(BrokerConfig(coord=(0.5, 0.5), listen="127.0.0.1:0", insecure=True, log_level="WARNING"))
    await b.start()
    b.pubsub.resume()
    try:
        yield b
    finally:
        await b.shutdown()


def _writes(c: Client) -> int:
    conn = c._conn
    assert conn is not None and isinstance(conn.transport, StreamTransport)
    return conn.transport.writes


async def test_a_lone_publish_leaves_at_once_and_a_burst_is_batched(broker: Broker) -> None:
    async with Client(broker.info.listen, reconnect=False) as c:
        before = _writes(c)
        fut = await c.publish_nowait("grid/lat/lone", b"one")
        # No turn of the event loop has passed: the PUBLISH is on the socket already.
        assert _writes(c) == before + 1 and c.sent_at_once == 1
        async with asyncio.timeout(5):
            assert (await fut).seq == 0
        before = _writes(c)
        futs = [await c.publish_nowait("grid/lat/burst", f"m{i}") for i in range(10)]
        # The first of the turn went at once; the other nine wait for the end of the turn ...
        assert _writes(c) == before + 1 and c.sent_at_once == 2
        async with asyncio.timeout(5):
            acks = await asyncio.gather(*futs)
        # ... and then leave together: one more write, one batched PUBLISH.
        assert _writes(c) == before + 2
        assert [a.seq for a in acks] == list(range(10))


async def test_one_publish_per_message_still_batches_writes(broker: Broker) -> None:
    async with Client(broker.info.listen, reconnect=False, batch_publishes=False) as c:
        sub = await c.subscribe("grid/lat/unbatched")
        before = _writes(c)
        futs = [await c.publish_nowait("grid/lat/unbatched", f"m{i}") for i in range(20)]
        async with asyncio.timeout(5):
            await asyncio.gather(*futs)
        assert _writes(c) == before + 2  # the lone first one, then 19 PUBLISH frames in one write
        got = []
        async with asyncio.timeout(5):
            while len(got) < 20:
                got.append((await anext(sub)).payload)
        assert got == [f"m{i}".encode() for i in range(20)]


async def test_a_stream_transport_writes_at_once_in_order() -> None:
    # No deferral to the end of the loop turn in the transport (measured to delay a broker's ACKs, see
    # docs/benchmarks-latency.md): each write reaches the stream before write() returns, in order.
    received: list[bytes] = []
    done = asyncio.Event()

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        dec = FrameDecoder()
        while not done.is_set() and (data := await reader.read(65536)):
            for f in dec.feed(data):
                assert isinstance(f, ControlFrame) and isinstance(f.message, Ping)
                received.append(encode_control(f.message))
                if len(received) == 4:
                    done.set()
        writer.close()

    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        t = await connect_broker("127.0.0.1", port, None, 5.0)
        for i in range(3):
            t.write(encode_control(Ping(i)))
            assert t.writes == i + 1
        t.write(encode_control(Ping(3)))
        t.close()
        await wait_for(done.is_set, 5.0, "four frames at the server")
        assert received == [encode_control(Ping(i)) for i in range(4)]
    finally:
        server.close()
        await server.wait_closed()


def test_trace_records_stamped_payloads_only_when_on(tmp_path: Path) -> None:
    assert not trace.ENABLED  # the test run has no SEDAX_TRACE: trace points cost one test of a constant
    code = (
        "from net import trace\n"
        "assert trace.ENABLED\n"
        "body = b'head' + trace.stamp(1.5) + b'-' + trace.stamp(2.5) + b'tail'\n"
        "trace.mark('forward', body)\n"
        "trace.mark('write', b'no stamp here')\n"
    )
    env = dict(os.environ, SEDAX_TRACE=str(tmp_path), PYTHONPATH=str(ROOT))
    subprocess.run([sys.executable, "-c", code], env=env, check=True, timeout=30)
    (out,) = tmp_path.glob("trace-*.jsonl")
    recs = [json.loads(line) for line in out.read_text().splitlines()]
    marks = [(t0, stage) for t0, stage, _ in recs if not stage.startswith("gc")]
    assert marks == [[1.5, "forward"], [2.5, "forward"]] or marks == [(1.5, "forward"), (2.5, "forward")]


async def test_a_started_broker_freezes_its_start_up_heap(tmp_path: Path) -> None:
    # Full collections must not walk the modules and classes of the start-up (a pause of tens of ms each).
    async with LocalCluster(1, resilience=1, state_dir=tmp_path, tls=False, broker_args=("--log-level", "DEBUG")) as c:
        await wait_for(lambda: log_has(c.nodes[0], "objects frozen for the garbage collector"), 10.0, "freeze")


@pytest.mark.parametrize("handler", ["on_message", "queue"])
async def test_a_delivered_run_is_handed_out_as_one_record_at_a_time_would_be(handler: str) -> None:
    """`Subscription._deliver_run` inlines the common case of `_deliver`; fed the same records (in order, a
    duplicate, a gap, a second publisher, a queue that overflows), both hand out, count and hold back alike."""
    from client.client import Subscription
    from overlay.pubsub import Record

    def rec(pub: str, seq: int) -> Record:
        return Record(float(seq) + (0.5 if pub == "b" else 0.0), pub, seq, f"{pub}{seq}".encode())

    batches = [
        [rec("a", 0), rec("a", 1), rec("a", 2)],
        [rec("a", 3), rec("b", 0), rec("a", 4), rec("b", 1)],
        [rec("a", 4), rec("a", 5), rec("b", 1), rec("b", 2)],  # duplicates
        [*(rec("b", s) for s in range(3, 40))],  # more than the queue holds
        [rec("a", 6), rec("a", 9), rec("a", 10), rec("b", 40)],  # a gap of publisher a: held back from 9 on
        [rec("a", 7), rec("b", 41)],  # the next of a, still held back until the gap is repaired
    ]
    client = Client(["127.0.0.1:1"])  # never connected: the subscriptions are fed by hand
    seen: dict[str, list[tuple[str, int]]] = {"one": [], "run": []}
    subs: dict[str, Subscription] = {}
    for way in seen:
        got = seen[way]
        on_message = (lambda m, got=got: got.append((m.publisher, m.seq))) if handler == "on_message" else None
        subs[way] = Subscription(client, "t", None, 16, on_message=on_message)
        subs[way]._repairing = True  # a gap is held back, not fetched: no broker here
    for batch in batches:
        for r in batch:
            subs["one"]._deliver(r)
        subs["run"]._deliver_run(batch)
    one, run = subs["one"], subs["run"]
    if handler == "queue":
        for way, sub in subs.items():
            seen[way] = [(m.publisher, m.seq) for m in sub._queue]
    assert seen["run"] == seen["one"] and seen["one"]
    assert ("a", 7) not in seen["one"] and ("b", 39) in seen["one"]
    assert (run.duplicates, run.dropped, run.gaps) == (one.duplicates, one.dropped, one.gaps)
    assert one.duplicates == 2 and (one.dropped > 0) == (handler == "queue")
    assert run._last_seq == one._last_seq and run._last_ts == one._last_ts and run.since == one.since
    assert {p: sorted(h) for p, h in run._behind.items()} == {p: sorted(h) for p, h in one._behind.items()}
    assert run._wakeup.is_set() == one._wakeup.is_set()
