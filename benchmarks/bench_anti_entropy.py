"""Anti-entropy against a long retained history (not a test): does a primary's digest check stall its topic?

    .venv/bin/python benchmarks/bench_anti_entropy.py [--fill 400000] [--retention-bytes 42000000]
                                                      [--duration 20] [--rate 500] [--trials 1]
                                                      [--kill-during no|secondary|primary]
                                                      [--fsync none|always|batch|never]

A primary compares digests with its secondary every anti-entropy interval (5 s) for the topics that changed
(broker/pubsub/replication.py); a copy that lacks something pulls it, and the primary finds what the copy lacks
in its log (`TopicLog.missing_from`).  A copy lacks something at most rounds once its secondary changed: a new
secondary is back-filled with what is retained, while the primary's digest still names what retention dropped
(dedup state is kept for a day).  This measures what that costs the topic's own traffic:

1. three brokers at level 2 (plain TCP) keep at most --retention-bytes per topic;
2. one topic is filled with --fill messages of 100 B (more than the retention keeps, so some expire);
3. its secondary is killed (SIGKILL); the third broker becomes the secondary and is back-filled;
4. for --duration seconds a device publishes --rate messages a second to the topic (one PUBLISH each, awaited,
   like bench_fanin.py's devices) through the primary's broker, and a subscriber on the same broker measures
   publish -> deliver (the payload carries the publisher's perf_counter()).

Reported per trial: p50/p99/p99.9/max of publish -> deliver, how far the publisher fell behind its schedule, and
the primary's pull answers (`handovers`) during the steady window.

With `--kill-during secondary|primary` step 3 moves into step 4: the holder is killed a quarter of the way
through the steady phase, with the device and the subscriber connected to every broker (the primary first).
The longest the device waited is then the topic's failover with a long history behind it (bench_failover.py
fails over topics of 5,000 messages).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import struct
import sys
import tempfile
import time
from pathlib import Path
from typing import Final

_ROOT: Final = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(_ROOT))

from harness import code_state, pct, uptime  # noqa: E402

from cli.cluster import LocalCluster  # noqa: E402
from client.admin import AdminClient  # noqa: E402
from client.client import Client, ReceivedMessage  # noqa: E402

TOPIC: Final = "bench/anti-entropy"
PAYLOAD: Final = 100
_HEAD: Final = struct.Struct("<d")


async def counter(addr: str, name: str) -> int:
    async with await AdminClient.connect(addr) as admin:
        return (await admin.status()).counters.get(name, 0)


async def wait_caught_up(addrs: list[str], within: float) -> float:
    """Seconds until every live broker holding the topic reports it caught up with nothing behind."""
    t0 = time.perf_counter()
    deadline = t0 + within
    while time.perf_counter() < deadline:
        states = []
        for a in addrs:
            async with await AdminClient.connect(a) as admin:
                states += [(h.state, h.behind) for h in (await admin.status()).held if h.topic == TOPIC]
        if len(states) >= 2 and all(s == "caught_up" and b == 0 for s, b in states):
            return time.perf_counter() - t0
        await asyncio.sleep(0.2)
    raise TimeoutError(f"the topic's holders did not catch up within {within:.0f} s")


async def trial(args: argparse.Namespace, workdir: Path, k: int) -> str:
    broker_args = ["--log-level", "WARNING", "--retention-bytes", str(args.retention_bytes)]
    disks = args.fsync != "none"
    if disks:
        broker_args += ["--fsync", args.fsync]
    async with LocalCluster(3, seed=args.seed + k, resilience=2, tls=False, state_dir=workdir / f"t{k}",
                            broker_args=broker_args, data_dirs=disks) as cluster:  # fmt: skip
        addrs = [n.listen for n in cluster.nodes]
        by_id = {n.node_id: n for n in cluster.nodes}
        async with Client(addrs, client_id=f"ae-locate-{k}") as c:
            loc = await c.locate(TOPIC)
        assert loc.secondary is not None
        primary = by_id[loc.primary.id]
        # The fill: batched, as a gateway catching up would send it.
        t0 = time.perf_counter()
        async with Client([primary.listen], client_id=f"ae-fill-{os.getpid()}-{k}") as c:
            body = b"f" * PAYLOAD
            for _ in range(args.fill):
                await c.publish_nowait(TOPIC, body)
            await c.flush()
        fill_s = time.perf_counter() - t0
        victim = by_id[(loc.primary if args.kill_during == "primary" else loc.secondary).id]
        backfill = "during the run"
        if args.kill_during == "no":
            await cluster.kill(victim.index)
            live = [n.listen for n in cluster.nodes if n.alive]
            backfill = f"{await wait_caught_up(live, within=120.0):.1f} s"
        access = [primary.listen] + [n.listen for n in cluster.nodes if n is not primary]

        lat: list[float] = []
        perf = time.perf_counter
        n = int(args.duration * args.rate)
        all_in = asyncio.Event()

        def on_message(m: ReceivedMessage) -> None:
            lat.append(perf() - _HEAD.unpack_from(m.payload)[0])
            if len(lat) >= n:
                all_in.set()

        sub = Client(access, client_id=f"ae-sub-{os.getpid()}-{k}")
        pub = Client(access, client_id=f"ae-pub-{os.getpid()}-{k}", batch_publishes=False)
        async with sub, pub:
            await sub.subscribe(TOPIC, on_message=on_message)
            pulls0 = await counter(primary.listen, "handovers")
            start, behind = perf(), 0.0
            killing: asyncio.Task[None] | None = None
            for i in range(n):
                if i == n // 4 and args.kill_during != "no":
                    # SIGKILL now, reaped beside the device: the reaping of a broker that held ~300,000 records
                    # took ~0.4 s here, which the device's schedule is not to count.
                    killing = asyncio.create_task(cluster.kill(victim.index))
                due = start + i / args.rate
                await asyncio.sleep(max(0.0, due - perf()))
                t = perf()
                behind = max(behind, t - due)
                await pub.publish(TOPIC, _HEAD.pack(t).ljust(PAYLOAD, b"x"))
            if killing is not None:
                await killing
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(all_in.wait(), 10.0)  # what did not come by then is reported missing
            pulls = "-" if args.kill_during == "primary" else await counter(primary.listen, "handovers") - pulls0
        lat.sort()
        ms = [x * 1e3 for x in lat]
        return (
            f"| {k + 1} | {args.fill:,} in {fill_s:.1f} s | {backfill} | {len(lat):,} / {n:,} | "
            f"{pct(ms, 0.5):.2f} | {pct(ms, 0.99):.2f} | {pct(ms, 0.999):.2f} | {ms[-1] if ms else float('nan'):.1f} | "
            f"{behind * 1e3:.0f} | {pulls} |"
        )


async def main_async(args: argparse.Namespace) -> int:
    os.environ["SEDAX_INSECURE"] = "1"
    print(f"`{' '.join(['.venv/bin/python', 'benchmarks/bench_anti_entropy.py', *sys.argv[1:]])}` - "
          f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, {code_state()}")  # fmt: skip
    print(f"\nLoad at the start: `{uptime()}`\n")
    print("| trial | fill | back-fill of the new secondary | delivered | p50 ms | p99 ms | p99.9 ms | max ms "
          "| publisher behind, ms | pull answers at the primary |")  # fmt: skip
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    with tempfile.TemporaryDirectory(prefix="sedax-bench-ae-") as tmp:
        for k in range(args.trials):
            print(await trial(args, Path(tmp), k), flush=True)
    print(f"\nLoad at the end: `{uptime()}`")
    return 0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--fill", type=int, default=400_000, help="messages of 100 B stored first (default 400,000)")
    p.add_argument("--retention-bytes", type=int, default=42_000_000, help="per topic (default 42,000,000)")
    p.add_argument("--duration", type=float, default=20.0, help="seconds of steady publishing (default 20)")
    p.add_argument("--rate", type=float, default=500.0, help="messages a second in the steady phase (default 500)")
    p.add_argument("--trials", type=int, default=1, help="trials, each on a new cluster (default 1)")
    p.add_argument("--seed", type=int, default=1, help="the brokers' coordinates (default 1)")
    p.add_argument(
        "--fsync", choices=("none", "always", "batch", "never"), default="none",
        help="brokers keep their topics on disk with this write policy (default none: in memory)",
    )  # fmt: skip
    p.add_argument(
        "--kill-during", choices=("no", "secondary", "primary"), default="no",
        help="kill this holder during the steady phase instead of before it (default: the secondary, before)",
    )  # fmt: skip
    args = p.parse_args()
    import uvloop

    return uvloop.run(main_async(args))


if __name__ == "__main__":
    sys.exit(main())
