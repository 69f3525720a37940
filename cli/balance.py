"""Delegation and balancing subcommands of `sedax`: load (workload generator), move, balance (dry run).

`sedax load` creates topics one after the other and publishes to each until its stored size follows the
paper's distribution (Sec. VII-A), so a broker running Alg. 1 places every new topic seeing the loads of the
topics before it, as the simulator's static runs do.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import time
from typing import Any, Final

import numpy as np

from cli.pubsub import EXIT_FAILED, EXIT_USAGE, _err, add_broker_flag, brokers_arg
from client.client import Client, ClientError, PublishAck
from net.credentials import Credentials
from overlay.pubsub import MESSAGE_OVERHEAD
from overlay.topics import BadTopic, validate_topic
from sim.experiments import LoadModel, static_topic_loads

DEFAULT_PAYLOAD: Final = 1024


def topic_sizes(model: LoadModel, n: int, unit_bytes: int, seed: int) -> list[int]:
    """Stored bytes per topic: the simulator's topic loads (Sec. VII-A) times unit_bytes, in creation order."""
    units = static_topic_loads(model, n, np.random.default_rng(seed))
    return [max(1, round(float(u) * unit_bytes)) for u in units]


async def run_load(
    brokers: list[str],
    n_topics: int,
    model: LoadModel,
    unit_bytes: int,
    seed: int,
    rate: float | None,
    prefix: str,
    payload_bytes: int,
    wait: float,
    credentials: Credentials | None = None,
) -> dict[str, Any]:
    """Create the topics and fill them; returns a summary (topics, bytes, messages, seconds, sizes).

    `credentials` default to the environment (SEDAX_CA, ... SEDAX_INSECURE).
    """
    sizes = topic_sizes(model, n_topics, unit_bytes, seed)
    interval = 1.0 / rate if rate else 0.0
    started = time.monotonic()
    messages = 0
    async with Client(brokers, request_timeout=wait, credentials=credentials) as c:
        for i, size in enumerate(sizes):
            topic = f"{prefix}/{i:04d}"
            futures: list[asyncio.Future[PublishAck]] = []
            # A stored message counts its payload, publisher id and a fixed overhead (broker.store).
            overhead = len(c.client_id) + MESSAGE_OVERHEAD
            left = size
            while left > 0:
                chunk = max(1, min(payload_bytes, left - overhead))
                futures.append(await c.publish_nowait(topic, b"x" * chunk))
                left -= chunk + overhead
                messages += 1
                if interval:
                    await asyncio.sleep(interval)
            # The next topic is created only once this one is stored: Alg. 1 then sees its load.
            async with asyncio.timeout(wait):
                await asyncio.gather(*futures)
    return {
        "topics": n_topics,
        "bytes": sum(sizes),
        "messages": messages,
        "seconds": round(time.monotonic() - started, 3),
        "sizes": {f"{prefix}/{i:04d}": s for i, s in enumerate(sizes)},
    }


def _cmd_load(args: argparse.Namespace) -> int:
    try:
        brokers = brokers_arg(args.broker)
        validate_topic(f"{args.prefix}/0000")
        if args.topics < 1 or args.unit_bytes < 1 or args.payload_bytes < 1:
            raise ValueError("--topics, --unit-bytes and --payload-bytes must be at least 1")
        if args.rate is not None and not (math.isfinite(args.rate) and args.rate > 0):
            raise ValueError("--rate must be a positive number of messages per second")
    except (ValueError, BadTopic) as exc:
        return _err(str(exc), EXIT_USAGE)
    try:
        out = asyncio.run(
            run_load(
                brokers,
                args.topics,
                LoadModel(args.sizes),
                args.unit_bytes,
                args.seed,
                args.rate,
                args.prefix,
                args.payload_bytes,
                args.timeout,
            )
        )
    except (ClientError, TimeoutError) as exc:
        return _err(f"load failed: {exc}", EXIT_FAILED)
    if not args.json:
        out.pop("sizes")
    print(json.dumps(out))
    return 0


def _coord_arg(text: str) -> tuple[float, float]:
    parts = text.split(",")
    if len(parts) != 2:
        raise argparse.ArgumentTypeError(f"a coordinate is X,Y, got {text!r}")
    try:
        x, y = float(parts[0]), float(parts[1])
    except ValueError:
        raise argparse.ArgumentTypeError(f"a coordinate is two numbers X,Y, got {text!r}") from None
    if not (math.isfinite(x) and math.isfinite(y)):
        raise argparse.ArgumentTypeError(f"coordinate components must be finite, got {text!r}")
    return (x, y)


async def _move(brokers: list[str], topic: str, to: tuple[float, float], wait: float) -> None:
    async with Client(brokers, request_timeout=wait) as c:
        await c.move(topic, to)


def _cmd_move(args: argparse.Namespace) -> int:
    try:
        brokers = brokers_arg(args.broker)
        validate_topic(args.topic)
    except (ValueError, BadTopic) as exc:
        return _err(str(exc), EXIT_USAGE)
    try:
        asyncio.run(_move(brokers, args.topic, args.to, args.timeout))
    except (ClientError, TimeoutError) as exc:
        return _err(f"move failed: {exc}", EXIT_FAILED)
    print(f"moved {args.topic} to {args.to[0]},{args.to[1]}")
    return 0


async def _plan(brokers: list[str], all_topics: bool, wait: float) -> list[dict[str, Any]]:
    async with Client(brokers, request_timeout=wait) as c:
        return await c.balance_plan(all_topics)


def _cmd_balance(args: argparse.Namespace) -> int:
    try:
        brokers = brokers_arg(args.broker)
    except ValueError as exc:
        return _err(str(exc), EXIT_USAGE)
    try:
        plans = asyncio.run(_plan(brokers, args.all, args.timeout))
    except (ClientError, TimeoutError) as exc:
        return _err(f"dry run failed: {exc}", EXIT_FAILED)
    if args.json:
        print(json.dumps(plans))
        return 0
    if not plans:
        print("nothing to balance: this broker is primary of no topic with stored data")
    for p in plans:
        cur = p.get("current", {})
        line = f"{p['topic']:<32} {p.get('size', 0):>10} B  {p['verdict']}"
        if "to" in p:
            best = p["best"]
            line += f" -> {p['to'][0]:.4f},{p['to'][1]:.4f} (L_max {cur['lmax']:.0f} -> {best['lmax']:.0f})"
        elif cur:
            line += f" (L_max here {cur['lmax']:.0f}, {p.get('offers', 0)} offers)"
        print(line)
    return 0


def register(subparsers: Any) -> None:
    """Add the load, move and balance subcommands."""
    p = subparsers.add_parser("load", help="create N topics and fill them to the paper's size distribution")
    add_broker_flag(p)
    p.add_argument("--topics", type=int, required=True, help="number of topics")
    p.add_argument("--sizes", choices=[m.value for m in LoadModel], default="heterogeneous")
    p.add_argument("--unit-bytes", dest="unit_bytes", type=int, default=10_000, help="bytes of one load unit")
    p.add_argument("--payload-bytes", dest="payload_bytes", type=int, default=DEFAULT_PAYLOAD)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--rate", type=float, help="messages per second (default: as fast as acknowledged)")
    p.add_argument("--prefix", default="load", help="topic names are PREFIX/0000, PREFIX/0001, ...")
    p.add_argument("--timeout", type=float, default=60.0)
    p.add_argument("--json", action="store_true", help="also print every topic's target size")
    p.set_defaults(func=_cmd_load)

    p = subparsers.add_parser("move", help="move a topic to another coordinate now (delegation)")
    p.add_argument("topic", metavar="TOPIC")
    p.add_argument("to", metavar="X,Y", type=_coord_arg)
    add_broker_flag(p)
    p.add_argument("--timeout", type=float, default=15.0)
    p.set_defaults(func=_cmd_move)

    p = subparsers.add_parser("balance", help="dry run: what the access broker's balancer would move, and why")
    add_broker_flag(p)
    p.add_argument("--dry-run", action="store_true", default=True, help="(the only mode: nothing moves)")
    p.add_argument("--all", action="store_true", help="every topic, not just the smallest (Alg. 2)")
    p.add_argument("--json", action="store_true")
    p.add_argument("--timeout", type=float, default=30.0)
    p.set_defaults(func=_cmd_balance)
