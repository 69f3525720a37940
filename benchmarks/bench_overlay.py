"""Overlay benchmark (not a test): join convergence, heal time, routed throughput, greedy path stretch.

    .venv/bin/python benchmarks/bench_overlay.py [--nodes 30] [--frames 200000] [--seed 1]

Real broker processes on 127.0.0.1 (`LocalCluster`).  Figures:

* join convergence: from a new broker's readiness line until every live broker's links equal scipy's
  Delaunay neighbours (checked through STATUS, polled every 0.1 s, so the resolution is ~0.1 s);
* heal time: from SIGKILL of one broker until the survivors are exactly Delaunay again;
* routed throughput over 1, 3 and 6 overlay hops: a client pushes ROUTED frames (batches of 1000 per write)
  into a source broker, addressed to the coordinate of a destination broker whose greedy route from the
  source has exactly that many hops; the rate is frames delivered per second at the destination;
* path stretch: greedy hop count (measured by route probes) against the shortest path in the same Delaunay
  graph (BFS), and the Euclidean length of the greedy path against the shortest Euclidean path (Dijkstra).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import time
import types
from collections import deque
from pathlib import Path

import numpy as np
from scipy.sparse import csr_matrix
from scipy.sparse.csgraph import shortest_path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from cli.cluster import LocalCluster
from client.admin import AdminClient
from overlay.geometry import closest, delaunay_neighbour_map, distance, greedy_next_hop
from overlay.protocol import Ping, append_routed, encode_message

# Saturating a 6-hop path puts 7 busy brokers on the CPUs; on a 2-core machine a starved broker can miss the
# default 0.6 s heartbeat window and a healthy link is torn down (losing the frames in flight).  The
# throughput runs use a 2 s window; heal times after SIGKILL do not depend on it (the kernel resets the TCP
# connections of a killed process at once).
BROKER_ARGS = ("--heartbeat-interval", "0.5", "--heartbeat-misses", "4", "--log-level", "WARNING")
BATCH = 1000


def greedy_path(nbrs: dict[str, set[str]], coords: dict[str, tuple[float, float]], src: str, dst: str) -> list[str]:
    path = [src]
    cur = src
    while True:
        nxt = greedy_next_hop(cur, coords[cur], {k: coords[k] for k in nbrs[cur]}, coords[dst])
        if nxt is None:
            return path
        path.append(nxt)
        cur = nxt


def bfs_hops(nbrs: dict[str, set[str]], src: str) -> dict[str, int]:
    seen = {src: 0}
    q = deque([src])
    while q:
        u = q.popleft()
        for w in nbrs[u]:
            if w not in seen:
                seen[w] = seen[u] + 1
                q.append(w)
    return seen


async def delivered(client: AdminClient) -> int:
    return (await client.status()).counters["routed_delivered"]


async def throughput(cluster: LocalCluster, src: str, dst: str, frames: int) -> float:
    nodes = {bp.node_id: bp for bp in cluster.live()}
    dest = nodes[dst].coord
    body = encode_message(Ping(0))
    batch = bytearray()
    for _ in range(BATCH):
        append_routed(batch, dest[0], dest[1], body, hop_limit=64)
    data = bytes(batch)
    async with (
        await AdminClient.connect(nodes[src].listen, role="client") as sender,
        await AdminClient.connect(nodes[dst].listen, timeout=30.0) as watcher,
    ):
        before = await delivered(watcher)
        start = time.perf_counter()
        for _ in range(frames // BATCH):
            await sender.send_frames(data)
        want = before + (frames // BATCH) * BATCH
        deadline = time.monotonic() + 120
        while (got := await delivered(watcher)) < want:
            if time.monotonic() > deadline:
                raise RuntimeError(f"only {got - before} of {want - before} frames delivered")
            await asyncio.sleep(0.005)
        return (want - before) / (time.perf_counter() - start)


def pick_pair(nbrs: dict[str, set[str]], coords: dict[str, tuple[float, float]], hops: int) -> tuple[str, str] | None:
    for src in sorted(coords):
        for dst in sorted(coords):
            if src != dst and len(greedy_path(nbrs, coords, src, dst)) - 1 == hops:
                return src, dst
    return None


async def stretch(cluster: LocalCluster, probes: int, seed: int) -> dict[str, float]:
    live = cluster.live()
    coords = {bp.node_id: bp.coord for bp in live}
    nbrs = delaunay_neighbour_map(coords)
    ids = sorted(coords)
    index = {k: i for i, k in enumerate(ids)}
    rows, cols, w = [], [], []
    for u in ids:
        for v in nbrs[u]:
            rows.append(index[u])
            cols.append(index[v])
            w.append(distance(coords[u], coords[v]))
    dist = shortest_path(csr_matrix((w, (rows, cols)), shape=(len(ids), len(ids))), method="D")
    rng = np.random.default_rng(seed)
    clients = {bp.node_id: await AdminClient.connect(bp.listen, timeout=30.0) for bp in live}
    try:
        sources = [ids[int(i)] for i in rng.integers(len(ids), size=probes)]
        targets = [(float(x), float(y)) for x, y in rng.random((probes, 2))]
        replies = await asyncio.gather(*(clients[s].route(t) for s, t in zip(sources, targets, strict=True)))
    finally:
        for c in clients.values():
            await c.aclose()
    hop_ratio, len_ratio, g_hops, s_hops = [], [], [], []
    for s, t, r in zip(sources, targets, replies, strict=True):
        assert r.node.id == closest(coords, t)[0], "greedy routing missed the closest broker"
        shortest = bfs_hops(nbrs, s)[r.node.id]
        g_hops.append(r.hops)
        s_hops.append(shortest)
        if shortest:
            hop_ratio.append(r.hops / shortest)
            glen = sum(distance(a.coord, b.coord) for a, b in zip(r.path, r.path[1:], strict=False))
            len_ratio.append(glen / dist[index[s], index[r.node.id]])
    return {
        "probes": probes,
        "mean_greedy_hops": statistics.fmean(g_hops),
        "mean_shortest_hops": statistics.fmean(s_hops),
        "hop_stretch_mean": statistics.fmean(hop_ratio),
        "hop_stretch_max": max(hop_ratio),
        "hop_optimal_share": sum(1 for x in hop_ratio if x == 1.0) / len(hop_ratio),
        "length_stretch_mean": statistics.fmean(len_ratio),
        "length_stretch_max": max(len_ratio),
    }


class _CountingLink:
    """Stands in for a next-hop PeerLink in the CPU micro-benchmark: takes bytes, never congests."""

    established = True
    write_buffered = 0

    def __init__(self) -> None:
        self.bytes = 0

    def write(self, data: bytes) -> None:
        self.bytes += len(data)


def forwarding_cpu(frames: int = 200_000) -> tuple[float, float]:
    """In-process cost of the broker's hot path (decode + greedy next hop + re-encode), frames/s per core."""
    import math

    from broker.config import BrokerConfig
    from broker.node import Broker
    from overlay.dt import NeighbourView
    from overlay.protocol import FrameDecoder, NodeInfo

    broker = Broker(BrokerConfig(coord=(0.5, 0.5), insecure=True))
    broker.info = NodeInfo("me", (0.5, 0.5), "127.0.0.1:1")
    broker.view = NeighbourView(broker.info)
    peers = {}
    for i in range(6):  # a typical Delaunay degree
        a = 2 * math.pi * i / 6
        info = NodeInfo(f"p{i}", (0.5 + 0.1 * math.cos(a), 0.5 + 0.1 * math.sin(a)), f"127.0.0.1:{i + 2}")
        broker.view.link_up(info)
        peers[info.id] = _CountingLink()
    broker.peers = peers  # type: ignore[assignment]
    # Frames arrive from a neighbour farther from both destinations, as greedy forwarding has it (the
    # broker checks that: a frame from a peer closer to its destination is a loop or a forgery).
    source = types.SimpleNamespace(peer=NodeInfo("p-src", (0.1, 0.1), "127.0.0.1:9"), may_route=True)
    body = encode_message(Ping(0))
    rates = []
    for dest in ((0.9, 0.9), (0.5, 0.5)):  # forwarded, then delivered here
        batch = bytearray()
        for _ in range(BATCH):
            append_routed(batch, dest[0], dest[1], body, hop_limit=64)
        data = bytes(batch)
        dec = FrameDecoder()
        start = time.perf_counter()
        for _ in range(frames // BATCH):
            for frame in dec.feed(data):
                broker.on_routed(source, frame)  # type: ignore[arg-type]
            broker._dirty.clear()
        rates.append(frames / (time.perf_counter() - start))
    return rates[0], rates[1]


async def main() -> None:
    # The overlay on plain TCP, as before TLS existed; benchmarks/bench_tls.py measures what TLS costs.
    os.environ["SEDAX_INSECURE"] = "1"
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--nodes", type=int, default=30)
    ap.add_argument("--frames", type=int, default=200_000)
    ap.add_argument("--probes", type=int, default=2000)
    ap.add_argument("--seed", type=int, default=1)
    args = ap.parse_args()
    pyver = sys.version.split()[0]
    print(f"# bench_overlay: {args.nodes} brokers, seed {args.seed}, {os.cpu_count()} CPUs, python {pyver}")
    fwd, dlv = forwarding_cpu()
    print(f"hot path, in-process: forward {fwd:,.0f} frames/s per core, deliver {dlv:,.0f} frames/s per core")
    t0 = time.monotonic()
    async with LocalCluster(args.nodes, seed=args.seed, broker_args=BROKER_ARGS) as cluster:
        started = time.monotonic() - t0
        conv = await cluster.wait_converged(60.0)
        print(f"start {args.nodes} processes (batches of 8): {started:.2f} s, then Delaunay after {conv:.2f} s more")

        joins = []
        for _ in range(3):
            await cluster.add()
            joins.append(await cluster.wait_converged(30.0))
        print(f"join convergence (ready -> exact Delaunay): {', '.join(f'{j:.2f}' for j in joins)} s")

        heals = []
        rng = np.random.default_rng(args.seed)
        for _ in range(3):
            victim = cluster.live()[int(rng.integers(len(cluster.live())))]
            await cluster.kill(victim.index)
            heals.append(await cluster.wait_converged(10.0))
        print(f"heal after SIGKILL (kill -> exact Delaunay): {', '.join(f'{h:.2f}' for h in heals)} s")

        st = await stretch(cluster, args.probes, args.seed)
        print(
            f"path stretch over {st['probes']} probes: greedy {st['mean_greedy_hops']:.2f} hops vs shortest "
            f"{st['mean_shortest_hops']:.2f}; hop stretch mean {st['hop_stretch_mean']:.3f} max "
            f"{st['hop_stretch_max']:.2f} ({100 * st['hop_optimal_share']:.0f}% optimal); Euclidean length "
            f"stretch mean {st['length_stretch_mean']:.3f} max {st['length_stretch_max']:.2f}"
        )

        coords = {bp.node_id: bp.coord for bp in cluster.live()}
        nbrs = delaunay_neighbour_map(coords)
        base = None
        for hops in (1, 3, 6):
            pair = pick_pair(nbrs, coords, hops)
            if pair is None:
                print(f"routed throughput over {hops} hops: no pair with that many greedy hops")
                continue
            rate = await throughput(cluster, *pair, args.frames)
            base = base or rate
            print(
                f"routed throughput over {hops} hop(s) {pair[0]}->{pair[1]}: {rate:,.0f} frames/s "
                f"({rate / base:.2f} x the 1-hop rate)"
            )


if __name__ == "__main__":
    asyncio.run(main())
