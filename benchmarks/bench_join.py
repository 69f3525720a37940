"""What a broker joining next to many topics costs the publishers (not a test): ACK latency through a join.

    .venv/bin/python benchmarks/bench_join.py                           # 30,000 topics, 3 brokers + 1, level 2
    .venv/bin/python benchmarks/bench_join.py --topics 10000,30000 --probes 40
    .venv/bin/python benchmarks/bench_join.py --topics 10000,30000 --leave     # and the new broker leaves again

Three brokers at level 2 (memory only, plain TCP) are given N topics (one message each, published in batches).
Then probe publishers (one `Client` each, on the three brokers in turn) publish one message at a time, each
awaited, to topics of their own spread over the square, as devices do.  After `--window` seconds of that (the
baseline), a fourth broker joins at the centre of the square: it becomes the primary or the secondary of a share
of every broker's topics, the probes' among them, and pulls their history before it serves them.  Measured:

* the join: until the new broker is ready, until the overlay is Delaunay again, until no topic is lagging
  (`LocalCluster.lagging`: every copy caught up, what `sedax cluster restart` waits for);
* the probes' ACK latency p50 / p99 / max, before the join and from its start until nothing lags, and how many
  waited over 1 s; a publish not acknowledged within the client's request time-out (10 s) counts as failed (with
  --keep-logs DIR the topics that failed or lag, their holders' rows and the brokers' logs are kept, and the logs
  after a leave that made a broker detect a failure);
* the probes' ACK latency during the join by what the new broker became of each probe's topic (its primary, its
  secondary, or neither);
* every broker's CPU over the join, the neighbours it took for dead and the topics taken over (none should be: a
  join is no failure), and its heartbeat ticks that ran over 0.25 s and 0.5 s late (`sedax_event_loop_lag_seconds`:
  a broker silent for 0.6 s is taken for dead);
* the batches re-sent after a time-out and the offers sent, all brokers over the join (a re-send of what the peer
  has queued only lengthens its queue: docs/storage.md, `PeerProgress`), and the acknowledged messages a primary
  logged lost (none are: a join loses nothing, but a new primary serving a topic before it has pulled the history
  logs the messages it lacks as lost).

With --leave, once nothing lags the new broker leaves again (SIGTERM: its graceful shutdown offers every topic it
holds to the brokers that hold it next) while the probes go on: its time to exit, until nothing lags, the probes'
ACK latency over that span and what failed, the failures detected (none should be) and take-overs (the
secondaries of the topics it was primary of take them over: a leave's take-overs), the offers of the brokers that
stay (the leaver's own hand-off offers leave with it), what was logged lost.

What a topic's move costs is what the probes see: a publish to a topic being handed over waits until the new
holder serves it, and one whose new secondary is the joining broker waits for that broker's confirmation, which
comes behind the back-fills and offers of every other topic on the same links (docs/benchmarks-scale.md, "A join
next to many topics").
"""

from __future__ import annotations

import argparse
import asyncio
import math
import os
import shutil
import statistics
import sys
import tempfile
import time
import urllib.request
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(_ROOT))

from bench_listing import fill  # noqa: E402
from harness import code_state, cpu_seconds, pct, uptime  # noqa: E402
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from cli.cluster import ClusterError, LocalCluster  # noqa: E402
from client.client import Client  # noqa: E402
from client.crawl import report  # noqa: E402
from net.credentials import Credentials  # noqa: E402
from overlay.protocol import Status  # noqa: E402

PLAIN = Credentials(insecure=True)
COORDS = [(0.2, 0.2), (0.8, 0.25), (0.5, 0.85)]
JOINER = (0.5, 0.45)
# More broker flags, e.g. BENCH_JOIN_BROKER_ARGS="--log-level INFO" with --keep-logs.
EXTRA: tuple[str, ...] = tuple(os.environ.get("BENCH_JOIN_BROKER_ARGS", "").split())


@dataclass
class Probe:
    """One device: its ACK latencies with the time each publish began, and what failed."""

    samples: list[tuple[float, float, str]] = field(default_factory=list)  # (began, latency, topic)
    failed: int = 0
    failures: list[str] = field(default_factory=list)  # what the first few failed publishes raised


async def _probe(addr: str, topics: list[str], stop: asyncio.Event, out: Probe) -> None:
    async with Client(addr, credentials=PLAIN) as c:
        k = 0
        while not stop.is_set():
            t = time.perf_counter()
            try:
                await c.publish(topics[k % len(topics)], b"probe")
            except Exception as exc:
                out.failed += 1
                if len(out.failures) < 3:
                    out.failures.append(f"{topics[k % len(topics)]}: {exc!r}")
            else:
                out.samples.append((t, time.perf_counter() - t, topics[k % len(topics)]))
            k += 1
            await asyncio.sleep(0.01)  # ~50-100 Hz per device, well under what a broker takes


def _sent(statuses: Mapping[str, Status]) -> list[float]:
    """Batches re-sent after a time-out, offers sent (back-fills, retiring copies, repeats, anti-entropy rounds),
    acknowledged messages a primary found missing and logged lost (a join loses none: a primary serving a topic
    without the history it has not yet pulled does log them), and the anti-entropy rounds' offers, all brokers."""
    keys = ("replication_resends", "offers", "lost", "anti_entropy_offers")
    return [float(sum(st.counters.get(k, 0) for st in statuses.values())) for k in keys]


def _late_beats(endpoint: str | None) -> tuple[float, float]:
    """Heartbeat ticks of one broker so far that ran over 0.25 s and over 0.5 s late (its event loop busy that long:
    a neighbour takes a broker silent for 0.6 s for dead), from its Prometheus endpoint; NaN where it cannot tell
    (no endpoint, no answer, a broker that predates the metric)."""
    nan = (math.nan, math.nan)
    if endpoint is None:
        return nan
    try:
        with urllib.request.urlopen(f"http://{endpoint}/metrics", timeout=30) as r:
            text = r.read().decode()
    except OSError:
        return nan
    for family in text_string_to_metric_families(text):
        if family.name == "sedax_event_loop_lag_seconds":
            count = next(s.value for s in family.samples if s.name.endswith("_count"))
            under = {s.labels["le"]: s.value for s in family.samples if s.name.endswith("_bucket")}
            return (count - under["0.25"], count - under["0.5"])
    return nan


async def _leave(cluster: LocalCluster, known: list[str], outs: list[Probe], settle: float) -> dict[str, float]:
    """The joined broker leaves again (SIGTERM: its graceful shutdown offers every topic it holds to the brokers
    that hold it next) while the probes publish: its time to exit, until nothing lags, the probes' ACK latency over
    that span and what failed, and what the brokers counted meanwhile."""
    failed0 = sum(o.failed for o in outs)
    before = await cluster.statuses(within=30.0)
    t0 = time.perf_counter()
    code = await cluster.stop(len(cluster.nodes) - 1, grace=60.0)
    t_exit = time.perf_counter()
    lagging = await _until_settled(cluster, known, t0 + settle)
    t_settled = time.perf_counter()
    statuses = await cluster.statuses(within=30.0)
    # The brokers that stayed: the leaver's counters go with it (its hand-off offers are not among these).
    sent = [a - b for a, b in zip(_sent(statuses), _sent({k: before[k] for k in statuses}), strict=True)]
    during = sorted(lat for o in outs for t, lat, _ in o.samples if t0 <= t <= t_settled)
    return {
        "exit": t_exit - t0,
        "code": float(code if code is not None else math.nan),
        "settled": t_settled - t0,
        "lagging": float(len(lagging)),
        **_summary(during),
        "max": max(during) * 1e3 if during else math.nan,
        "over_1s": float(sum(1 for x in during if x > 1.0)),
        "failed": float(sum(o.failed for o in outs) - failed0),
        "failures_detected": float(sum(st.counters.get("failures_detected", 0) for st in statuses.values())),
        "takeovers": float(sum(st.counters.get("takeovers", 0) for st in statuses.values())),
        "offers": sent[1],
        "lost": sent[2],
        "anti_entropy": sent[3],
    }


async def _until_settled(cluster: LocalCluster, known: list[str], deadline: float) -> list[str]:
    """Wait until none of known lags (every copy caught up) or perf_counter() passes deadline; what still lags."""
    lagging = await cluster.lagging(known, within=30.0)
    while lagging and time.perf_counter() < deadline:
        await asyncio.sleep(0.5)
        lagging = await cluster.lagging(known, within=30.0)
    return lagging


async def _roles(listen: str, topics: list[str]) -> dict[str, str]:
    """What the new broker is of each of topics once the join settled: primary, secondary or - (neither)."""
    try:
        _, held = await report(listen, credentials=PLAIN, timeout=30.0)
    except Exception:  # (a broker that does not answer: every topic counted as neither)
        return dict.fromkeys(topics, "-")
    mine = {h.topic: h.role for h in held.held}
    return {t: mine.get(t, "-") for t in topics}


def _summary(lats: list[float]) -> dict[str, float]:
    """p50, p99 (ms) and count of sorted ACK latencies (s)."""
    return {"p50": pct(lats, 0.5) * 1e3, "p99": pct(lats, 0.99) * 1e3, "n": float(len(lats))}


async def one(
    n: int, probes: int, window: float, settle: float, keep: str | None, leave: bool
) -> tuple[dict[str, float], dict[str, float] | None]:
    with tempfile.TemporaryDirectory(prefix="sedax-bench-join-") as d:
        async with LocalCluster(
            3,
            coords=COORDS,
            state_dir=Path(d),
            tls=False,
            resilience=2,
            broker_args=("--metrics", "127.0.0.1:0", *EXTRA),
        ) as cluster:
            await cluster.wait_converged(30.0)
            addrs = [bp.listen for bp in cluster.nodes]
            await fill(addrs[0], n, prefix="grid/join/")
            # Probe topics: names of their own, so they hash all over the square; each probe writes two.
            names = [f"grid/join/probe/{i}" for i in range(2 * probes)]
            stop = asyncio.Event()
            outs = [Probe() for _ in range(probes)]
            tasks = [
                asyncio.create_task(_probe(addrs[i % 3], names[2 * i : 2 * i + 2], stop, outs[i]))
                for i in range(probes)
            ]
            await asyncio.sleep(window)  # the baseline (and every probe topic made)
            cpu0 = {bp.node_id: cpu_seconds(bp.proc.pid) for bp in cluster.nodes}
            late0 = [_late_beats(b.metrics) for b in cluster.nodes]
            sent0 = _sent(await cluster.statuses(within=30.0))
            t_join = time.perf_counter()
            bp = await cluster.add(JOINER, join=[addrs[0]])
            t_ready = time.perf_counter()
            try:
                await cluster.wait_converged(60.0)
                t_converged = time.perf_counter()
            except ClusterError:  # (reported: the join brought the overlay down)
                t_converged = math.inf
            known = [f"grid/join/{i:07d}" for i in range(0, n, max(1, n // 200))] + names
            lagging = await _until_settled(cluster, known, t_join + settle)
            t_settled = time.perf_counter()
            if lagging or any(o.failed for o in outs):
                print(f"  still lagging: {lagging[:10]}", file=sys.stderr)
                for o in outs:
                    for f in o.failures:
                        print(f"  failed: {f}", file=sys.stderr)
                bad = sorted({f.split(":")[0] for o in outs for f in o.failures} | set(lagging))
                for b in cluster.nodes:
                    try:
                        _, held = await report(b.listen, credentials=PLAIN, timeout=30.0)
                    except Exception as exc:  # (a broker that does not answer)
                        print(f"  {b.node_id}: no report ({exc!r})", file=sys.stderr)
                        continue
                    rows = [h for h in held.held if h.topic in bad]
                    print(f"  {b.node_id}: {rows}", file=sys.stderr)
                if keep is not None:
                    shutil.copytree(d, keep, dirs_exist_ok=True)
                    print(f"  broker logs copied to {keep}", file=sys.stderr)
            try:
                statuses = await cluster.statuses(within=30.0)
                counters: list[Mapping[str, float]] = [st.counters for st in statuses.values()]
                sent = [a - b for a, b in zip(_sent(statuses), sent0, strict=True)]
            except Exception:  # a broker that does not answer: the counts are unknown
                counters = [{"failures_detected": math.nan, "takeovers": math.nan}]
                sent = [math.nan] * 4
            late1 = [_late_beats(b.metrics) for b in cluster.nodes]
            late = [sum(x[k] for x in late1) - sum(x[k] for x in late0) for k in (0, 1)]
            cpu1 = {b.node_id: cpu_seconds(b.proc.pid) for b in cluster.nodes if b is not bp}
            cpu_new = cpu_seconds(bp.proc.pid)
            roles = await _roles(bp.listen, names)  # (before it leaves)
            left = await _leave(cluster, known, outs, settle) if leave else None
            if left is not None and (left["failures_detected"] or left["failed"]) and keep is not None:
                shutil.copytree(d, keep, dirs_exist_ok=True)  # (a leave is no failure: why was one detected?)
                print(f"  leave: broker logs copied to {keep}", file=sys.stderr)
            stop.set()
            await asyncio.gather(*tasks)
            before = sorted(lat for o in outs for t, lat, _ in o.samples if t < t_join)
            during = sorted(lat for o in outs for t, lat, _ in o.samples if t_join <= t <= t_settled)
            by_role = {
                role: sorted(
                    lat for o in outs for t, lat, x in o.samples if t_join <= t <= t_settled and roles[x] == role
                )
                for role in ("primary", "secondary", "-")
            }
            span = t_settled - t_join
            return {
                "ready": t_ready - t_join,
                "converged": t_converged - t_join,
                "settled": span,
                "lagging": float(len(lagging)),
                "before_p50": pct(before, 0.5) * 1e3,
                "before_p99": pct(before, 0.99) * 1e3,
                "before_max": max(before) * 1e3,
                "during_p50": pct(during, 0.5) * 1e3,
                "during_p99": pct(during, 0.99) * 1e3,
                "during_max": max(during) * 1e3 if during else float("nan"),
                "during_n": float(len(during)),
                "over_1s": float(sum(1 for x in during if x > 1.0)),
                "failed": float(sum(o.failed for o in outs)),
                "failures_detected": float(sum(c["failures_detected"] for c in counters)),
                "takeovers": float(sum(c["takeovers"] for c in counters)),
                "resends": sent[0],
                "offers": sent[1],
                "lost": sent[2],
                "anti_entropy": sent[3],
                "late_025": late[0],
                "late_05": late[1],
                "cpu_old": statistics.fmean((cpu1[k] - cpu0[k]) / span * 100 for k in cpu1),
                "cpu_new": cpu_new / span * 100,
                **{f"{role}_{k}": v for role, lats in by_role.items() for k, v in _summary(lats).items()},
            }, left


def main() -> None:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    p.add_argument("--topics", default="30000", help="topic counts (default 30000)")
    p.add_argument("--probes", type=int, default=20, help="probe publishers (default 20), two topics each")
    p.add_argument("--window", type=float, default=5.0, help="seconds of the baseline before the join (default 5)")
    p.add_argument("--settle", type=float, default=120.0, help="longest wait for no topic lagging (default 120 s)")
    p.add_argument(
        "--keep-logs",
        metavar="DIR",
        help="copy the brokers' logs here if a topic lags, a publish failed or a leave made a broker detect a failure",
    )
    p.add_argument("--leave", action="store_true", help="then the joined broker leaves again (SIGTERM), measured too")
    args = p.parse_args()
    print(f"{uptime()}  {code_state()}  3 brokers + 1 at {JOINER}, resilience 2, {args.probes} probes")
    print(
        "| topics | ready s | Delaunay s | nothing lagging s | ACK p50 / p99 / max ms before "
        "| ACK p50 / p99 / max ms during | ACKs during (> 1 s) | failed | failures detected / take-overs "
        "| batches re-sent / offers (anti-entropy) "
        "| logged lost | beats > 0.25 / > 0.5 s late | CPU % old (mean) / new |"
    )
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    leaves: list[tuple[int, dict[str, float]]] = []
    rows: list[tuple[int, dict[str, float]]] = []
    for n in (int(x) for x in args.topics.split(",")):
        r, left = asyncio.run(one(n, args.probes, args.window, args.settle, args.keep_logs, args.leave))
        rows.append((n, r))
        if left is not None:
            leaves.append((n, left))
        still = f" ({r['lagging']:.0f} still lagging)" if r["lagging"] else ""
        print(
            f"| {n:,} | {r['ready']:.1f} | {r['converged']:.1f} | {r['settled']:.1f}{still} "  # (inf: never Delaunay)
            f"| {r['before_p50']:.2f} / {r['before_p99']:.1f} / {r['before_max']:.1f} "
            f"| {r['during_p50']:.2f} / {r['during_p99']:.1f} / {r['during_max']:.1f} "
            f"| {r['during_n']:.0f} ({r['over_1s']:.0f}) | {r['failed']:.0f} "
            f"| {r['failures_detected']:.0f} / {r['takeovers']:.0f} "
            f"| {r['resends']:,.0f} / {r['offers']:,.0f} ({r['anti_entropy']:,.0f}) "
            f"| {r['lost']:.0f} "
            f"| {r['late_025']:.0f} / {r['late_05']:.0f} "
            f"| {r['cpu_old']:.0f} / {r['cpu_new']:.0f} |",
            flush=True,
        )
    print()
    print("ACK latency during the join by what the new broker became of the probe's topic (p50 / p99 ms, ACKs):")
    for n, r in rows:
        parts = [
            f"{label} {r[f'{role}_p50']:.1f} / {r[f'{role}_p99']:.1f} ({r[f'{role}_n']:.0f})"
            for role, label in (("primary", "primary"), ("secondary", "secondary"), ("-", "neither"))
        ]
        print(f"  {n:,} topics: " + ", ".join(parts))
    if leaves:
        print()
        print(
            "| topics | leave: exit s | nothing lagging s | ACK p50 / p99 / max ms during | ACKs during (> 1 s) "
            "| failed | failures detected / take-overs | offers (anti-entropy) of the brokers that stay | logged lost |"
        )
        print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
        for n, x in leaves:
            still = f" ({x['lagging']:.0f} still lagging)" if x["lagging"] else ""
            print(
                f"| {n:,} | {x['exit']:.1f} (exit {x['code']:.0f}) | {x['settled']:.1f}{still} "
                f"| {x['p50']:.2f} / {x['p99']:.1f} / {x['max']:.1f} | {x['n']:.0f} ({x['over_1s']:.0f}) "
                f"| {x['failed']:.0f} | {x['failures_detected']:.0f} / {x['takeovers']:.0f} "
                f"| {x['offers']:,.0f} ({x['anti_entropy']:,.0f}) "
                f"| {x['lost']:.0f} |"
            )


if __name__ == "__main__":
    main()
