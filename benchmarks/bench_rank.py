"""What a view change costs a broker in ranking (not a test): N_1..N_3 of every topic it holds or serves.

    .venv/bin/python benchmarks/bench_rank.py [--nodes 9,100,300] [--topics 100,1000] [--repeat 5]

When its view of the overlay changes, a broker ranks the coordinate of every topic it holds (take-over, new
secondary, hand-over: ranks `view_changed`) and of every topic its sessions subscribe (access
`view_changed`: a subscription whose N_1 changed is registered there again).  Two rows per size:

* ranking alone: `closest` per coordinate (a sort of every known broker each, what the broker did until
  2026-11-28) against `NearestNodes` over all coordinates at once (overlay/geometry.py), the same answers;
* the whole `view_changed` of a `PubSub` engine (level 3, on bench_engine.py's in-memory overlay) with one local
  session subscribed to every topic, as a broker joins at a corner of the space and leaves again, and how many
  subscriptions that moved to or from the corner broker were registered again per view change (the rest is the
  check alone).

Best of --repeat, milliseconds per view change, the whole walk of the topics held.  Since 2026-11-30 a broker
walks them RERANK_SLICE (256) per turn of its event loop and re-ranks a topic touched meanwhile first
(docs/benchmarks-scale.md, "A join next to many topics"): this is the walk's CPU in all, not one stall.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_engine as be
import numpy as np

from broker.pubsub import PubSub
from overlay.geometry import NearestNodes, closest, geohash
from overlay.protocol import NodeInfo
from overlay.pubsub import Subscribe


def _join_and_leave(net: be.Net, ps: PubSub) -> None:
    """A broker joins at a corner and leaves again: two new views, as membership makes them (the registrations
    they send stay queued: only the view change is timed)."""
    net.view = {**net.view, "corner": NodeInfo("corner", (0.0, 0.0), "127.0.0.1:1")}
    ps.view_changed()
    ps.ranks.settle_all()  # (the walk's later slices, which a broker runs one per turn of its loop)
    net.view = {k: v for k, v in net.view.items() if k != "corner"}
    ps.view_changed()
    ps.ranks.settle_all()


def _best(fn: Callable[[], object], repeat: int) -> float:
    best = float("inf")
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best * 1e3


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--nodes", default="9,100,300", help="brokers in the view (default 9,100,300)")
    p.add_argument("--topics", default="100,1000", help="topics ranked per view change (default 100,1000)")
    p.add_argument("--repeat", type=int, default=5, help="runs per figure, the best kept (default 5)")
    args = p.parse_args()
    try:
        sizes = [int(x) for x in args.nodes.split(",")]
        counts = [int(x) for x in args.topics.split(",")]
    except ValueError:
        print("error: --nodes and --topics are comma-separated whole numbers, e.g. 9,100", file=sys.stderr)
        return 2
    if min(sizes) < 2 or min(counts) < 1 or args.repeat < 1:
        print("error: at least 2 nodes, 1 topic and 1 repeat", file=sys.stderr)
        return 2
    print("| brokers known | topics | `closest` per topic, ms | `NearestNodes`, ms | engine `view_changed`, ms | "
          "registered again |")  # fmt: skip
    print("|---:|---:|---:|---:|---:|---:|")
    for n in sizes:
        rng = np.random.default_rng(n)
        sites = [(float(x), float(y)) for x, y in rng.uniform(0.05, 0.95, (n, 2))]
        coords = {f"n{i}": c for i, c in enumerate(sites)}
        for t in counts:
            topics = [f"grid/rank/{i}" for i in range(t)]
            homes = [geohash(topic) for topic in topics]
            per_topic = _best(lambda h=homes, c=coords: [closest(c, x, 3) for x in h], args.repeat)
            at_once = _best(lambda h=homes, c=coords: NearestNodes(c)(h, 3), args.repeat)
            net = be.Net(sites, 3)  # (bench_engine's in-memory overlay: the subscriptions are registered)
            access = net.nodes["n0"]
            access.frames_to["s"] = 0
            ps = access.ps
            for i, topic in enumerate(topics):
                ps.client_message("s", Subscribe(i + 1, topic))
            net.run()
            before = ps.table.counters["resubscribed"]
            engine = _best(lambda o=net, e=ps: _join_and_leave(o, e), args.repeat) / 2
            moved = (ps.table.counters["resubscribed"] - before) / (2 * args.repeat)
            print(f"| {n} | {t} | {per_topic:.1f} | {at_once:.1f} | {engine:.1f} | {moved:.0f} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
