"""What listing a broker's topics costs it (not a test): the pages of STATUS and HELD_REQ at 10^4-10^5 topics.

    .venv/bin/python benchmarks/bench_listing.py                     # 20,000 and 100,000 topics
    .venv/bin/python benchmarks/bench_listing.py --topics 50000 --listings 3
    .venv/bin/python benchmarks/bench_listing.py --topics 50000 --brokers 3 --resilience 2

`sedax brokers`, `sedax topics`, `sedax status` and `sedax cluster restart`'s wait read every topic of a broker,
STATUS_PAGE (1,000) names at a time.  A page is answered on the broker's event loop, so what it costs is a stall
of everything else the broker does: heartbeats (0.6 s of silence is a failure), publishes, deliveries.

One broker (level 1, memory only, plain TCP; or `--brokers` of them at `--resilience`, the first one measured)
is given N topics (one message each, published in batches), then
read whole `--listings` times by an admin connection (`AdminClient.status` + `holdings`, as the tools do) while a
second client publishes one message at a time and times each acknowledgement.  Printed per N: the time of a
listing, the longest page answer as the tool saw it, and the publisher's ACK latency p50 / max during the
listings against the same publisher's while nothing lists (the stall the listing put on the broker's loop).
Before the listings the broker's CPU is measured for `--window` seconds idle and as long with the publisher's
probes: what holding N topics costs it with nothing and with little going on.  Then `--scrapes` GETs of the
broker's Prometheus endpoint (`--metrics`), as Prometheus makes them, the same way: the time of a scrape and the
ACK latency meanwhile.  With `--log-interval S` the brokers also write the metrics log (`--log-dir`, a snapshot
every S seconds listing every topic held), as compose's brokers do every 5 s.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(_ROOT))

from harness import code_state, cpu_seconds, uptime  # noqa: E402

from cli.cluster import LocalCluster  # noqa: E402
from client.admin import AdminClient  # noqa: E402
from client.client import Client  # noqa: E402
from net.credentials import Credentials  # noqa: E402

PLAIN = Credentials(insecure=True)


async def fill(addr: str, n: int, prefix: str = "grid/list/") -> None:
    """n topics (prefix + a 7-digit number) of one message each, published in acknowledged batches through addr."""
    async with Client(addr, credentials=PLAIN) as c:
        batch = 2000
        for start in range(0, n, batch):
            acks = [await c.publish_nowait(f"{prefix}{i:07d}", b"v") for i in range(start, min(n, start + batch))]
            await asyncio.gather(*acks)


async def _acks(addr: str, stop: asyncio.Event, out: list[float]) -> None:
    async with Client(addr, credentials=PLAIN) as c:
        while not stop.is_set():
            t = time.perf_counter()
            await c.publish("grid/probe", b"p")
            out.append((time.perf_counter() - t) * 1000)
            await asyncio.sleep(0.002)


async def _cpu_share(pid: int, seconds: float) -> float:
    """The share of a core pid used over the next `seconds`, in %."""
    c0, t0 = cpu_seconds(pid), time.monotonic()
    await asyncio.sleep(seconds)
    return (cpu_seconds(pid) - c0) / (time.monotonic() - t0) * 100


def _scrape(endpoint: str) -> float:
    """One GET /metrics, as Prometheus makes it; seconds."""
    t = time.perf_counter()
    with urllib.request.urlopen(f"http://{endpoint}/metrics", timeout=30) as r:
        r.read()
    return time.perf_counter() - t


async def one(
    n: int, listings: int, brokers: int, resilience: int, scrapes: int, window: float, log_interval: float | None
) -> dict[str, float]:
    with tempfile.TemporaryDirectory(prefix="sedax-bench-listing-") as d:
        args: tuple[str, ...] = ("--metrics", "127.0.0.1:0")
        if log_interval is not None:
            args += ("--log-dir", str(Path(d) / "logs"), "--log-interval", str(log_interval))
        async with LocalCluster(
            brokers, seed=3, state_dir=Path(d), tls=False, resilience=resilience, broker_args=args
        ) as cluster:
            await cluster.wait_converged(30.0)
            addr = cluster.nodes[0].listen
            await fill(addr, n)
            pid = cluster.nodes[0].proc.pid
            await asyncio.sleep(2.0)  # (the fill's batches confirmed and its connection gone)
            idle_cpu = await _cpu_share(pid, window)
            quiet: list[float] = []
            stop = asyncio.Event()
            probe = asyncio.create_task(_acks(addr, stop, quiet))
            probed_cpu = await _cpu_share(pid, window)
            stop.set()
            await probe
            busy: list[float] = []
            stop = asyncio.Event()
            probe = asyncio.create_task(_acks(addr, stop, busy))
            took, longest = [], 0.0
            async with await AdminClient.connect(addr, credentials=PLAIN) as admin:
                for _ in range(listings):
                    t0 = time.perf_counter()
                    st = await admin.status()
                    held = await admin.holdings(st)
                    took.append(time.perf_counter() - t0)
                    if brokers == 1:
                        assert len(held.held) == n + 1, len(held.held)  # (the probe's topic too)
                    longest = max(longest, took[-1] / max(1, (n + 999) // 1000))
            stop.set()
            await probe
            scraping: list[float] = []
            stop = asyncio.Event()
            probe = asyncio.create_task(_acks(addr, stop, scraping))
            scraped = []
            for _ in range(scrapes):
                scraped.append(await asyncio.to_thread(_scrape, cluster.nodes[0].metrics))
                await asyncio.sleep(0.2)
            stop.set()
            await probe
            return {
                "idle_cpu": idle_cpu,
                "probed_cpu": probed_cpu,
                "scrape_s": statistics.median(scraped) if scraped else float("nan"),
                "scrape_p50": statistics.median(scraping),
                "scrape_max": max(scraping),
                "listing_s": statistics.median(took),
                "page_ms_mean": longest * 1000,
                "quiet_p50": statistics.median(quiet),
                "quiet_max": max(quiet),
                "busy_p50": statistics.median(busy),
                "busy_max": max(busy),
            }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--topics", default="20000,100000", help="topic counts (default 20000,100000)")
    p.add_argument("--listings", type=int, default=3, help="whole listings per count (default 3)")
    p.add_argument("--brokers", type=int, default=1, help="brokers (default 1); the first is measured")
    p.add_argument("--resilience", type=int, default=1, choices=(1, 2, 3), help="resilience level (default 1)")
    p.add_argument("--log-interval", type=float, help="write the metrics log, a snapshot every this many seconds")
    p.add_argument("--window", type=float, default=5.0, help="seconds of each CPU measurement (default 5)")
    p.add_argument("--scrapes", type=int, default=5, help="GETs of the broker's /metrics per count (default 5)")
    args = p.parse_args()
    log = f", metrics log every {args.log_interval} s" if args.log_interval is not None else ""
    print(f"{uptime()}  {code_state()}  {args.brokers} broker(s), resilience {args.resilience}{log}")
    print(
        "| topics | a listing, s | per page, ms | ACK p50 / max ms, nothing listing | ACK p50 / max ms, listing "
        "| a scrape, s | ACK p50 / max ms, scraping | broker CPU %, idle / probed |"
    )
    print("|---:|---:|---:|---:|---:|---:|---:|---:|")
    for n in (int(x) for x in args.topics.split(",")):
        r = asyncio.run(
            one(n, args.listings, args.brokers, args.resilience, args.scrapes, args.window, args.log_interval)
        )
        print(
            f"| {n:,} | {r['listing_s']:.2f} | {r['page_ms_mean']:.1f} | {r['quiet_p50']:.2f} / {r['quiet_max']:.1f} "
            f"| {r['busy_p50']:.2f} / {r['busy_max']:.1f} | {r['scrape_s']:.3f} "
            f"| {r['scrape_p50']:.2f} / {r['scrape_max']:.1f} | {r['idle_cpu']:.1f} / {r['probed_cpu']:.1f} |",
            flush=True,
        )


if __name__ == "__main__":
    main()
