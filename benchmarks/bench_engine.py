"""The pub/sub engine's own CPU per message (not a test): no sockets, no event loop, no other process.

    .venv/bin/python benchmarks/bench_engine.py [--messages 20000] [--profile 25]

Three brokers' `PubSub` engines (broker/pubsub/) on an in-memory overlay: broker 0 at h(t) (the primary,
with the subscriber's session), broker 1 next to it (the secondary at level 2), broker 2 farther away.  A
publisher's session at broker 0 ("0 hops") or at broker 2 ("far": the PUBLISH travels in a TOPIC_REQUEST and
its ACK in a TOPIC_REPLY) publishes one message per turn; each routed message is encoded, handed to the
broker closest to its destination and decoded there, and each turn runs to completion (replicated, stored,
acknowledged, delivered) before the next.  Reported: CPU (`time.process_time`) per message over the whole
exchange and every broker, and the routed frames per message.

What it isolates: the engine and the codec, which the socket benchmarks (bench_latency, bench_fanin) see
only mixed with the kernel, the event loop, the link layer and the other processes of a 2-core machine.  It
is the figure to move when the per-message Python path is the target (issue 17): low noise, seconds to run.
With `--profile N` each configuration also runs under cProfile and prints its N costliest functions.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import sys
import time
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from broker.pubsub import PubSub, PubSubConfig
from overlay.geometry import Coord, closest, geohash
from overlay.protocol import MAX_LINK_FRAME_SIZE, Message, NodeInfo, decode_message, encode_message
from overlay.pubsub import Publish, Subscribe

TOPIC = "bench/latency/t1"  # bench_latency's topic
PAYLOAD = b"x" * 100
WARMUP = 1000


class Net:
    """Routed messages between in-memory brokers: encoded on the way out, decoded on arrival, in order."""

    def __init__(self, coords: list[Coord], level: int) -> None:
        self.queue: deque[tuple[Coord, bytes]] = deque()
        self.deferred: deque[Callable[[], None]] = deque()
        self.nodes = {
            f"n{i}": Node(self, NodeInfo(f"n{i}", c, f"127.0.0.1:{7000 + i}"), level) for i, c in enumerate(coords)
        }
        self.view = {nid: n.info for nid, n in self.nodes.items()}
        self._closest: dict[Coord, Node] = {}  # destination -> broker (the view never changes here)
        self.frames = 0

    def run(self) -> None:
        """Deliver routed messages and run end-of-turn work until nothing is left."""
        while self.queue or self.deferred:
            if not self.queue:
                self.deferred.popleft()()
                continue
            dest, body = self.queue.popleft()
            node = self._closest.get(dest)
            if node is None:
                node = self._closest[dest] = self.nodes[closest({k: v.coord for k, v in self.view.items()}, dest)[0]]
            self.frames += 1
            node.ps.routed(decode_message(body))


class Node:
    """One broker as the engine sees it (broker.pubsub.Overlay); local sessions count what they are sent."""

    def __init__(self, net: Net, info: NodeInfo, level: int) -> None:
        self.net = net
        self.info = info
        self.frames_to: dict[str, int] = {}
        self.ps = PubSub(self, PubSubConfig(resilience=level))

    @property
    def me(self) -> NodeInfo:
        return self.info

    def view(self) -> Mapping[str, NodeInfo]:
        return self.net.view

    def route(self, dest: Coord, msg: Message) -> None:
        self.net.queue.append((dest, encode_message(msg, MAX_LINK_FRAME_SIZE)))  # as routing.send_routed

    def to_session(self, session: str, frame: bytes, sent: Message | None = None) -> bool:
        if session not in self.frames_to:
            return False
        self.frames_to[session] += 1
        return True

    def now(self) -> float:
        return time.time()

    def defer(self, fn: Callable[[], None]) -> None:
        self.net.deferred.append(fn)


@dataclass(frozen=True, slots=True)
class Result:
    level: int
    far: bool
    us_per_message: float
    frames_per_message: float


def run(level: int, far: bool, messages: int, profile: int) -> Result:
    h = geohash(TOPIC)
    coords = [h, (min(1.0, h[0] + 0.05), h[1]), (min(1.0, h[0] + 0.3), min(1.0, h[1] + 0.3))]
    net = Net(coords, level)
    primary, access = net.nodes["n0"], net.nodes["n2" if far else "n0"]
    primary.frames_to["sub"] = 0
    access.frames_to["pub"] = 0
    primary.ps.client_message("sub", Subscribe(1, TOPIC))
    net.run()

    def publish(seq: int) -> None:
        access.ps.client_message("pub", Publish(TOPIC, "bench-publisher", seq, PAYLOAD, seq))
        net.run()

    for seq in range(WARMUP):
        publish(seq)
    frames0 = net.frames
    prof = cProfile.Profile() if profile else None
    if prof is not None:
        prof.enable()
    t0 = time.process_time()
    for seq in range(WARMUP, WARMUP + messages):
        publish(seq)
    spent = time.process_time() - t0
    if prof is not None:
        prof.disable()
        pstats.Stats(prof).sort_stats("tottime").print_stats(profile)
    got, acked = primary.frames_to["sub"], access.frames_to["pub"]
    if got < WARMUP + messages or acked < WARMUP + messages:
        raise RuntimeError(f"level {level}: {got} deliveries and {acked} ACKs for {WARMUP + messages} messages")
    return Result(level, far, spent / messages * 1e6, (net.frames - frames0) / messages)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--messages", type=int, default=20000, help="messages per configuration (default 20000)")
    p.add_argument("--profile", type=int, default=0, metavar="N", help="also profile: the N costliest functions")
    args = p.parse_args()
    if args.messages < 1:
        print("error: --messages must be at least 1", file=sys.stderr)
        return 2
    print("| level | publisher | engine CPU µs per message | routed frames per message |")
    print("|---:|---|---:|---:|")
    for level in (1, 2, 3):
        for far in (False, True):
            r = run(level, far, args.messages, 0)
            where = "far (TOPIC_REQUEST / TOPIC_REPLY)" if r.far else "at the primary (0 hops)"
            print(f"| {r.level} | {where} | {r.us_per_message:.1f} | {r.frames_per_message:.1f} |", flush=True)
    if args.profile:
        for level in (1, 2):
            print(f"\n### level {level}, publisher at the primary, under cProfile")
            run(level, False, args.messages, args.profile)
    return 0


if __name__ == "__main__":
    sys.exit(main())
