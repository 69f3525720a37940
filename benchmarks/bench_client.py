"""The client library's per-message path (not a test): a publishing and a subscribing `Client` in this process,
a real broker in another.

    .venv/bin/python benchmarks/bench_client.py [--messages 20000] [--window 1] [--unbatched] [--profile 30]

bench_broker.py puts the brokers in one process and drives them with raw connections, so the client library's
own cost is not in its figure.  This is the other half: one broker (`sedax broker`, level 1, plain TCP) runs as
a child process, and this process holds what a device and an application hold: a `Client` publishing one
message at a time (`publish_nowait`, the next once the previous one's ACK and DELIVER are back; `--window W`
keeps W in flight) and a `Client` subscribed with `on_message`.  The CPU figures are this process's: both
clients' publish, acknowledgement, delivery, framing and event loop, and none of the broker's.

Run under valgrind by bench_instructions.py (`--configs client`), the broker child is not traced
(callgrind follows no child by default), so the count is the client library's alone.
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import logging
import os
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import uvloop
from harness import print_profile

from cli.cluster import LocalCluster
from client.client import Client, ReceivedMessage
from net.credentials import Credentials

TOPIC = "bench/client/t1"
PAYLOAD = b"x" * 100
WARMUP = 1000


async def run(messages: int, window: int, batched: bool, profile: int) -> tuple[float, float, float]:
    """User and system CPU µs and wall µs per message of this process (both clients)."""
    with tempfile.TemporaryDirectory(prefix="bench-client-") as tmp:
        cluster = LocalCluster(1, coords=[(0.5, 0.5)], resilience=1, tls=False, state_dir=Path(tmp))
        async with cluster:
            await cluster.wait_converged(30.0)
            addr = cluster.nodes[0].listen
            plain = Credentials(insecure=True)
            delivered = 0
            wake = asyncio.Event()
            goal = 0

            def take(_m: ReceivedMessage) -> None:
                nonlocal delivered
                delivered += 1
                if delivered >= goal:
                    wake.set()

            async with (
                Client([addr], client_id="bench-client-sub", credentials=plain) as sub,
                Client([addr], client_id="bench-client-pub", batch_publishes=batched, credentials=plain) as pub,
            ):
                await sub.subscribe(TOPIC, on_message=take)

                async def send(n: int) -> None:
                    nonlocal goal
                    for _ in range(0, n, window):
                        goal = delivered + window
                        wake.clear()
                        futs = [await pub.publish_nowait(TOPIC, PAYLOAD) for _ in range(window)]
                        await asyncio.gather(*futs)
                        await wake.wait()

                await asyncio.wait_for(send(WARMUP), 60.0)
                prof = cProfile.Profile() if profile else None
                loop = asyncio.get_running_loop()
                t0, w0 = os.times(), loop.time()
                if prof is not None:
                    prof.enable()
                await asyncio.wait_for(send(messages), 600.0)
                if prof is not None:
                    prof.disable()
                t1, w1 = os.times(), loop.time()
                if prof is not None:
                    print_profile(prof, messages, profile)
    return (
        (t1.user - t0.user) / messages * 1e6,
        (t1.system - t0.system) / messages * 1e6,
        (w1 - w0) / messages * 1e6,
    )


def main() -> int:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    p.add_argument("--messages", type=int, default=20000, help="messages measured, after 1000 of warm-up")
    p.add_argument("--window", type=int, default=1, help="publishes in flight at once (default 1)")
    p.add_argument("--unbatched", action="store_true", help="one PUBLISH frame per message (batch_publishes off)")
    p.add_argument("--profile", type=int, default=0, metavar="N", help="also profile: the N costliest functions")
    args = p.parse_args()
    if args.messages < 1 or args.window < 1 or args.messages % args.window:
        print("error: --messages and --window must be at least 1, and --messages a multiple of --window",
              file=sys.stderr)  # fmt: skip
        return 2
    logging.basicConfig(level=logging.WARNING)
    user, system, wall = uvloop.run(run(args.messages, args.window, not args.unbatched, args.profile))
    print("| clients | window | user CPU µs/msg | system CPU µs/msg | wall µs/msg |")
    print("|---|---:|---:|---:|---:|")
    print(f"| publisher + subscriber, {'unbatched' if args.unbatched else 'batched'} | {args.window} "
          f"| {user:.1f} | {system:.1f} | {wall:.1f} |")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
