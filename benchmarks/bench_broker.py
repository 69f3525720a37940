"""The brokers' whole per-message path in one process (not a test): real brokers, real sockets, no scheduling.

    .venv/bin/python benchmarks/bench_broker.py [--messages 20000] [--configs l1,l2,l2far] [--subscribers 1]
        [--publishers 1] [--window 1] [--profile 30]

bench_engine.py times the pub/sub engine alone; bench_latency.py times everything, on a 2-core machine where
six processes take turns, so its CPU figures move by +-10 % from run to run.  This one runs the brokers of
bench_latency's layout (on a line through h(t): broker 0 the primary, broker 1 the secondary, broker 3 three
hops away) as `Broker` objects in this process, over loopback TCP, with every layer a message crosses in a
broker process: transport, link, node, routing, engine, store, metrics.  The publisher and the subscriber
are raw connections in the same loop (a HELLO, then pre-encoded PUBLISH frames, one at a time; the next
leaves once the previous one's ACK and DELIVER are back), so almost all the CPU is the brokers'.  With
`--window W` the publisher writes W PUBLISH frames at once and waits for all of them: the pipelined
one-PUBLISH-per-message path of bench_pubsub, where one read carries several frames and one turn answers them.

Reported per message: user CPU (the interpreter, the event loop, msgpack: what the code decides) and system
CPU (the kernel: reads, writes, epoll), from os.times over the whole run.  Both end points' cost is in the
figure too (one frame decoded per arrival, one write per message): the same in every configuration.  With
`--profile N` each configuration also runs under cProfile and prints its N costliest functions.
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import logging
import os
import sys
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_pubsub as bp
import numpy as np
import uvloop
from harness import print_profile

from broker.config import BrokerConfig
from broker.node import Broker
from overlay.geometry import delaunay_neighbours
from overlay.protocol import PROTOCOL_VERSION, ControlFrame, FrameDecoder, Hello, HelloOk, encode_control
from overlay.pubsub import Ack, Deliver, Publish, Subscribe, Subscribed

TOPIC = "bench/latency/t1"  # bench_latency's topic
PAYLOAD = b"x" * 100
WARMUP = 1000
CONFIGS = {"l1": (1, 0), "l2": (2, 0), "l2far": (2, 3)}  # name -> (resilience level, publisher's hops)


class Raw(asyncio.Protocol):
    """A client connection that counts the ACKs and DELIVERs it reads (and answers nothing else)."""

    def __init__(self) -> None:
        self.decoder = FrameDecoder()
        self.acked: dict[str, int] = {}  # publisher -> highest seq acknowledged (ACKs are cumulative)
        self.acked_count = 0  # messages acknowledged, all publishers together
        self.delivered = 0
        self.changed = asyncio.Event()
        self.first: list[object] = []

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.t: asyncio.Transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        for f in self.decoder.feed(data):
            if not isinstance(f, ControlFrame):
                continue
            m = f.message
            if isinstance(m, Ack):
                last = self.acked.get(m.publisher, -1)
                if m.seq > last:
                    self.acked[m.publisher] = m.seq
                    self.acked_count += m.seq - last
            elif isinstance(m, Deliver):
                self.delivered += len(m.records)
            else:
                self.first.append(m)
        self.changed.set()

    async def until(self, done: object) -> None:
        while not done():  # type: ignore[operator]
            self.changed.clear()
            await self.changed.wait()


async def raw_client(addr: str, name: str) -> Raw:
    host, port = addr.rsplit(":", 1)
    _, proto = await asyncio.get_running_loop().create_connection(Raw, host, int(port))
    proto.t.write(encode_control(Hello(PROTOCOL_VERSION, name, "client")))
    await asyncio.wait_for(proto.until(lambda: any(isinstance(m, HelloOk) for m in proto.first)), 10.0)
    return proto


@dataclass
class Result:
    name: str
    user_us: float
    sys_us: float
    wall_us: float


async def run(
    name: str, messages: int, profile: int, subscribers: int = 1, publishers: int = 1, window: int = 1
) -> Result:
    level, hops = CONFIGS[name]
    coords = bp.line_coords(TOPIC, max(hops + 1, level))
    brokers: list[Broker] = []
    try:
        for i, c in enumerate(coords):
            join = (brokers[0].info.listen,) if brokers else ()
            config = BrokerConfig(
                coord=c, node_id=f"b{i}", listen="127.0.0.1:0", join=join, resilience=level, insecure=True,
                log_level="WARNING", client_timeout=3600.0,  # the raw clients send no heartbeats
            )  # fmt: skip
            b = Broker(config)
            await b.start()
            if join:
                await b.join()
            brokers.append(b)
        # Converged: each broker's live neighbours are its Delaunay neighbours (on a line: the brokers beside it).
        expected = [{f"b{j}" for j in nbrs} for nbrs in delaunay_neighbours(np.array(coords))]
        for _ in range(600):  # 30 s
            if all({n.id for n in b.port.neighbour_infos()} == e for b, e in zip(brokers, expected, strict=True)):
                break
            await asyncio.sleep(0.05)
        else:
            raise TimeoutError("the brokers did not link as their Delaunay neighbours within 30 s")
        subs = [await raw_client(brokers[0].info.listen, f"bench-sub-{k}") for k in range(subscribers)]
        for sub in subs:
            sub.t.write(encode_control(Subscribe(1, TOPIC)))
            await asyncio.wait_for(sub.until(lambda s=sub: any(isinstance(m, Subscribed) for m in s.first)), 10.0)
        pub = await raw_client(brokers[hops].info.listen, "bench-pub")
        # Message i comes from publisher i mod `publishers` (the topic's publisher table has that many entries).
        frames = [
            encode_control(Publish(TOPIC, f"bench-publisher-{i % publishers}", i // publishers, PAYLOAD, 0))
            for i in range(WARMUP + messages)
        ]

        def acked(upto: int) -> bool:  # messages 0..upto-1 acknowledged
            # A count, not a look at every publisher: with --publishers 1000 that look was most of the CPU
            # this benchmark charged to the brokers.  Only 0..upto-1 were sent, and ACKs are cumulative.
            return pub.acked_count >= upto

        async def send(lo: int, hi: int) -> None:
            for i in range(lo, hi, window):
                j = min(i + window, hi)
                pub.t.write(b"".join(frames[i:j]))
                await pub.until(lambda j=j: acked(j))
                for sub in subs:
                    await sub.until(lambda s=sub, j=j: s.delivered >= j)

        await asyncio.wait_for(send(0, WARMUP), 60.0)
        prof = cProfile.Profile() if profile else None
        loop = asyncio.get_running_loop()
        t0, w0 = os.times(), loop.time()
        if prof is not None:
            prof.enable()
        await asyncio.wait_for(send(WARMUP, WARMUP + messages), 600.0)
        if prof is not None:
            prof.disable()
        t1, w1 = os.times(), loop.time()
        if prof is not None:
            print(f"\n### {name} under cProfile")
            print_profile(prof, messages, profile)
        for c in (pub, *subs):
            c.t.close()
        return Result(
            name, (t1.user - t0.user) / messages * 1e6, (t1.system - t0.system) / messages * 1e6,
            (w1 - w0) / messages * 1e6,
        )  # fmt: skip
    finally:
        for b in reversed(brokers):
            await b.shutdown()


async def main_async(args: argparse.Namespace) -> int:
    names = args.configs.split(",")
    for n in names:
        if n not in CONFIGS:
            print(f"error: unknown configuration {n!r}; choose from {', '.join(CONFIGS)}", file=sys.stderr)
            return 2
    logging.basicConfig(level=logging.WARNING)
    results = []
    for n in names:
        results.append(await run(n, args.messages, args.profile, args.subscribers, args.publishers, args.window))
    print(f"| configuration | user CPU µs/msg | system CPU µs/msg | wall µs/msg ({args.window} in flight) |")
    print("|---|---:|---:|---:|")
    for r in results:
        level, hops = CONFIGS[r.name]
        who = f", {args.subscribers} subscribers, {args.publishers} publishers, window {args.window}"
        print(f"| level {level}, {hops} hops{who} | {r.user_us:.1f} | {r.sys_us:.1f} | {r.wall_us:.1f} |")
    return 0


def main() -> int:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    p.add_argument("--messages", type=int, default=20000, help="messages per configuration (default 20000)")
    p.add_argument("--configs", default="l1,l2,l2far", help=f"subset of {','.join(CONFIGS)} (default all)")
    p.add_argument("--subscribers", type=int, default=1, help="subscriber connections at the primary (default 1)")
    p.add_argument("--publishers", type=int, default=1, help="publisher ids, taking turns (default 1)")
    p.add_argument("--window", type=int, default=1, help="PUBLISH frames written at once (default 1)")
    p.add_argument("--profile", type=int, default=0, metavar="N", help="also profile: the N costliest functions")
    return uvloop.run(main_async(p.parse_args()))


if __name__ == "__main__":
    sys.exit(main())
