"""`sedax demo`: the main job on a fresh machine — a local cluster with publishers and subscribers.

Starts N broker processes on loopback (the embedded default of `sedax cluster up`), waits until their links
are exactly the Delaunay triangulation, attaches a subscriber and a publisher to different brokers, streams
messages over several topics, kills the primary of one topic mid-stream (SIGKILL) and moves another topic
to a new coordinate mid-stream (topic delegation, Sec. III), and shows that delivery goes on without loss or
duplicates.  The brokers run combined load balancing (Alg. 1 at topic creation, Alg. 2 every Δτ).  Exits 0
only if every acknowledged message reached the subscriber exactly once, in order.
Every link is TLS (brokers with mutual TLS against a development CA created for the run, clients with
client certificates) unless --insecure is given.
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from cli.args import EXIT_FAILED, EXIT_USAGE, fail, positive_int
from client.client import Client, ClientError, PublishAck
from client.errors import describe

if TYPE_CHECKING:  # cli.cluster imports numpy: `sedax --help` and the light commands must not pay for it
    from cli.cluster import LocalCluster


def _say(text: str) -> None:
    print(text, flush=True)


async def run_demo(nodes: int, seed: int, resilience: int, messages: int, topics: int, insecure: bool = False) -> int:
    """Run the demo; returns the exit code."""
    from cli.cluster import LocalCluster

    names = [f"grid/feeder-{i}/voltage" for i in range(topics)]
    _say(f"starting {nodes} brokers on 127.0.0.1 (resilience level {resilience}) ...")
    balancing = ("--balance", "combined", "--goal", "L3", "--selection", "bestlocal", "--balance-interval", "2")
    # The brokers' logs and the development CA (with its private key) live only as long as the demo.
    with tempfile.TemporaryDirectory(prefix="sedax-demo-") as state:
        return await _demo(
            LocalCluster(
                n=nodes,
                seed=seed,
                resilience=resilience,
                broker_args=balancing,
                tls=False if insecure else None,
                state_dir=Path(state),
                data_dirs=True,
            ),
            names,
            messages,
            resilience,
        )


async def _demo(cluster: LocalCluster, names: list[str], messages: int, resilience: int) -> int:
    topics = len(names)
    async with cluster:
        took = await cluster.wait_converged()
        _say(f"overlay converged to the Delaunay triangulation in {took:.2f} s")
        if cluster.tls:
            _say(f"every link is TLS: brokers mutually authenticated by the development CA in {cluster.certs_dir}")
        else:
            _say("plain TCP (--insecure): no TLS, no client authentication")
        for bp in cluster.nodes:
            _say(f"  broker {bp.node_id:<14} at ({bp.coord[0]:.3f}, {bp.coord[1]:.3f})  {bp.listen}")
        addrs = [bp.listen for bp in cluster.nodes]
        # Attach the clients to brokers that do not hold the first topic, so the kill hits the topic only.
        async with Client(addrs, credentials=cluster.credentials("demo-probe")) as probe:
            first = await probe.locate(names[0])
        holders = {n.listen for n in (first.primary, first.secondary) if n is not None}
        others = [a for a in addrs if a not in holders] or addrs
        async with (
            Client(others, credentials=cluster.credentials("demo-subscriber")) as sub_client,
            Client(others[::-1], credentials=cluster.credentials("demo-publisher")) as pub_client,
        ):
            _say(f"subscriber attached to {sub_client.address}, publisher to {pub_client.address}")
            subs = {t: await sub_client.subscribe(t) for t in names}
            loc = await pub_client.locate(names[0])
            _say(f"{names[0]}: primary {loc.primary.listen}, secondary {loc.secondary and loc.secondary.listen}")
            victim = next(
                (i for i, bp in enumerate(cluster.nodes) if bp.node_id == loc.primary.id),
                None,
            )
            access = {sub_client.address, pub_client.address}
            moving = names[1 % topics]
            move_to = (0.5, 0.5)
            move: asyncio.Task[None] | None = None
            acks: list[asyncio.Future[PublishAck]] = []
            t0 = time.monotonic()
            for i in range(messages):
                topic = names[i % topics]
                acks.append(await pub_client.publish_nowait(topic, f"{230.0 + (i % 7) / 10:.1f} V (reading {i})"))
                if (
                    i == messages // 2
                    and resilience >= 2
                    and victim is not None
                    and cluster.nodes[victim].listen not in access
                ):
                    await asyncio.gather(*acks)
                    _say(f"killing the primary of {names[0]} ({loc.primary.listen}) with SIGKILL mid-stream")
                    await cluster.kill(victim)
                if i == (3 * messages) // 4 and topics > 1:
                    _say(f"moving {moving} to ({move_to[0]}, {move_to[1]}) mid-stream (delegation)")
                    move = asyncio.create_task(pub_client.move(moving, move_to))
            async with asyncio.timeout(60):
                await asyncio.gather(*acks)
                if move is not None:
                    await move
            _say(f"published {messages} messages on {topics} topics, all acknowledged in {time.monotonic() - t0:.2f} s")
            per_topic = {t: len(range(j, messages, topics)) for j, t in enumerate(names)}
            received: dict[str, list[Any]] = {t: [] for t in names}
            async with asyncio.timeout(60):
                for t, sub in subs.items():
                    while len(received[t]) < per_topic[t]:
                        m = await anext(sub)
                        received[t].append(m.seq)
                        if len(received[t]) <= 2:
                            _say(f"  {t}: {m.payload.decode()}  (publisher {m.publisher}, seq {m.seq})")
            ok = all(received[t] == list(range(per_topic[t])) for t in names)
            dups = sum(s.duplicates for s in subs.values())
            _say(
                f"subscriber received {sum(map(len, received.values()))} messages, in order per topic: {ok}; "
                f"re-deliveries suppressed: {dups}"
            )
            if loc_after := await pub_client.locate(names[0]):
                _say(f"{names[0]} is now served by {loc_after.primary.listen}")
            if move is not None:
                moved = await pub_client.locate(moving)
                hops = " -> ".join(f"({d.coord[0]:.3f}, {d.coord[1]:.3f})" for d in moved.delegates)
                _say(f"{moving} delegate list: {hops}; served by {moved.primary.listen}")
    _say("cluster stopped")
    _say(
        "next: `sedax cluster up` keeps a cluster running; then `sedax brokers`, `sedax topics`, `sedax pub` and "
        '`sedax sub TOPIC --since 10m` against it (README, "Using it")'
    )
    return 0 if ok else 1


def _cmd(args: argparse.Namespace) -> int:
    from cli.cluster import ClusterError, ClusterTooLarge

    try:
        return asyncio.run(run_demo(args.nodes, args.seed, args.resilience, args.messages, args.topics, args.insecure))
    except ClusterTooLarge as exc:  # the command line asked for it: a usage error, as for `cluster up`
        return fail(f"--nodes {args.nodes}: {exc}", EXIT_USAGE)
    except (ClusterError, ClientError, TimeoutError, OSError) as exc:
        return fail(f"the demo failed: {describe(exc)}", EXIT_FAILED)


def register(subparsers: Any) -> None:
    """Add the demo subcommand."""
    p = subparsers.add_parser("demo", help="start a local cluster, publish and subscribe through it, then stop")
    p.add_argument("--nodes", type=positive_int, default=9, help="broker processes (default 9)")
    p.add_argument("--seed", type=int, default=1, help="seed of the broker coordinates")
    p.add_argument("--resilience", type=int, choices=(1, 2, 3), default=2, help="resilience level (2)")
    p.add_argument("--messages", type=positive_int, default=200, help="messages to stream (200)")
    p.add_argument("--topics", type=positive_int, default=4, help="topics to spread them over (4)")
    p.add_argument("--insecure", action="store_true", help="plain TCP instead of TLS (default: $SEDAX_INSECURE)")
    p.set_defaults(func=_cmd)
