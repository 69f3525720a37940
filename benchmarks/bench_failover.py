"""How long a topic is unavailable when its primary fails: SIGKILL (crash) and SIGSTOP (hang), level 2.

    .venv/bin/python benchmarks/bench_failover.py                 # 5 trials per failure kind, ~2 min
    .venv/bin/python benchmarks/bench_failover.py --trials 2 --json

Each trial starts a fresh cluster of 6 brokers (TLS, resilience 2, default heartbeat 0.2 s x 3), attaches a
publisher and a subscriber to two brokers that hold nothing of the topic, streams 1,000 msg/s, and after 2 s
fails the topic's primary: SIGKILL (the kernel resets its connections, so its neighbours see it at once) or
SIGSTOP (a hung process: only missed heartbeats tell).  Measured with one clock (publisher, subscriber and
this driver share the process):

* ack stall: the longest publish -> ACK time of any message published from 0.5 s before the failure on
  (the publisher keeps publishing; what was in flight to the dead primary is re-sent by the client);
* delivery gap: the longest pause between two deliveries at the subscriber after the failure;
* every message delivered exactly once and in order (checked, a trial fails otherwise).

The bounds printed beside them, measured or set in the same run: the detection window (heartbeat interval x
misses), the steady publish -> ACK p50 before the failure, and the 1 s target ("well under a second").
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(_ROOT))

from cli.cluster import LocalCluster  # noqa: E402
from client.client import Client  # noqa: E402

NODES = 6
RATE = 1000.0
BEFORE = 2.0  # seconds of steady stream before the failure
AFTER = 3.0  # seconds of stream after it
HEARTBEAT = (0.2, 3)  # the brokers' defaults (broker/config.py), shown as the detection bound
TARGET = 1.0


async def trial(kind: str, seed: int, workdir: Path) -> dict[str, Any]:
    topic = f"grid/failover/t{seed}"
    async with LocalCluster(NODES, seed=seed, resilience=2, state_dir=workdir / f"{kind}-{seed}") as cluster:
        await cluster.wait_converged(30.0)
        creds = cluster.credentials("bench")
        addrs = [bp.listen for bp in cluster.nodes]
        async with Client(addrs, credentials=creds) as probe:
            loc = await probe.locate(topic)
        holders = {loc.primary.id, loc.secondary.id if loc.secondary else ""}
        free = [i for i, bp in enumerate(cluster.nodes) if bp.node_id not in holders]
        victim = next(i for i, bp in enumerate(cluster.nodes) if bp.node_id == loc.primary.id)
        loop = asyncio.get_running_loop()
        sent: dict[int, float] = {}
        acked: dict[int, float] = {}
        recv: list[tuple[int, float]] = []
        others = [addrs[i] for i in free[2:]]
        async with (
            Client([addrs[free[0]], *others], credentials=creds) as pub,
            Client([addrs[free[1]], *others], credentials=creds) as subc,
        ):
            sub = await subc.subscribe(topic)

            want = [10**9]  # how many to receive: known once publishing stops
            done = asyncio.Event()

            async def consume() -> None:
                while True:
                    m = await anext(sub)
                    recv.append((m.seq, loop.time()))
                    if len(recv) >= want[0]:
                        done.set()

            consumer = asyncio.create_task(consume())
            t0 = loop.time()
            failed_at = 0.0
            seq = 0
            while loop.time() < t0 + BEFORE + AFTER:
                fut = await pub.publish_nowait(topic, b"x" * 100)
                sent[seq] = loop.time()
                fut.add_done_callback(lambda f, s=seq: None if f.exception() else acked.__setitem__(s, loop.time()))
                seq += 1
                if not failed_at and loop.time() >= t0 + BEFORE:
                    failed_at = loop.time()
                    if kind == "SIGKILL":
                        await cluster.kill(victim)
                    else:
                        os.kill(cluster.nodes[victim].pid, signal.SIGSTOP)
                await asyncio.sleep(max(0.0, t0 + seq / RATE - loop.time()))
            want[0] = seq
            if len(recv) >= seq:
                done.set()
            async with asyncio.timeout(30):
                await pub.flush()
                await done.wait()
            consumer.cancel()
            if kind == "SIGSTOP":
                os.kill(cluster.nodes[victim].pid, signal.SIGKILL)
        seqs = [s for s, _ in recv]
        if seqs != list(range(seq)):
            raise RuntimeError(f"{kind} trial {seed}: delivered {len(seqs)} of {seq}, in order: {seqs == sorted(seqs)}")
        steady = sorted(acked[s] - sent[s] for s in sent if sent[s] < failed_at - 0.5)
        around = [acked[s] - sent[s] for s in sent if sent[s] >= failed_at - 0.5]
        after = [t for _, t in recv if t >= failed_at]
        gaps = [b - a for a, b in zip([failed_at, *after], after, strict=False)]
        return {
            "kind": kind,
            "messages": seq,
            "ack_stall": max(around),
            "delivery_gap": max(gaps) if gaps else float("nan"),
            "steady_ack_p50": steady[len(steady) // 2],
        }


async def main_async(args: argparse.Namespace) -> int:
    workdir = Path(tempfile.mkdtemp(prefix="sedax-bench-failover-"))
    results: list[dict[str, Any]] = []
    for kind in ("SIGKILL", "SIGSTOP"):
        for t in range(args.trials):
            r = await trial(kind, 100 + t, workdir)
            results.append(r)
            print(
                f"  {kind} trial {t + 1}: ack stall {r['ack_stall'] * 1e3:7.1f} ms, delivery gap "
                f"{r['delivery_gap'] * 1e3:7.1f} ms, steady ack p50 {r['steady_ack_p50'] * 1e3:5.2f} ms, "
                f"{r['messages']} messages all delivered once, in order",
                flush=True,
            )
    window = HEARTBEAT[0] * HEARTBEAT[1]
    summary = {}
    for kind in ("SIGKILL", "SIGSTOP"):
        rs = [r for r in results if r["kind"] == kind]
        stall = [r["ack_stall"] for r in rs]
        gap = [r["delivery_gap"] for r in rs]
        summary[kind] = {
            "ack_stall_median": statistics.median(stall),
            "ack_stall_max": max(stall),
            "delivery_gap_median": statistics.median(gap),
            "delivery_gap_max": max(gap),
            "steady_ack_p50": statistics.median(r["steady_ack_p50"] for r in rs),
        }
    if args.json:
        print(json.dumps({"trials": results, "summary": summary, "detection_window": window}, indent=1))
    print(f"\nload average {os.getloadavg()[0]:.1f}; detection window (heartbeat) {window:.1f} s; target {TARGET} s")
    print("| failure | ack stall median / max | delivery gap median / max | ÷ target (max) | ÷ detection window |")
    print("|---|---:|---:|---:|---:|")
    for kind, s in summary.items():
        worst = max(s["ack_stall_max"], s["delivery_gap_max"])
        print(
            f"| {kind} | {s['ack_stall_median'] * 1e3:.0f} / {s['ack_stall_max'] * 1e3:.0f} ms "
            f"| {s['delivery_gap_median'] * 1e3:.0f} / {s['delivery_gap_max'] * 1e3:.0f} ms "
            f"| {worst / TARGET:.2f} | {worst / window:.2f} |"
        )
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=5, help="trials per failure kind (default 5)")
    parser.add_argument("--json", action="store_true", help="also print every trial as JSON")
    args = parser.parse_args()
    started = time.monotonic()
    rc = asyncio.run(main_async(args))
    print(f"({time.monotonic() - started:.0f} s)")
    return rc


if __name__ == "__main__":
    sys.exit(main())
