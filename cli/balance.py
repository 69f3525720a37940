"""Delegation and balancing subcommands of `sedax`: load (workload generator), move, balance (dry run).

`sedax load` creates topics one after the other and publishes to each until its stored size follows the
paper's distribution (Sec. VII-A), so a broker running Alg. 1 places every new topic seeing the loads of the
topics before it, as the simulator's static runs do.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from typing import Any, Final

import numpy as np

from cli.args import (
    EXIT_FAILED,
    EXIT_USAGE,
    UsageError,
    add_broker_flag,
    brokers,
    coordinate,
    credentials,
    fail,
    positive_int,
    rate,
    seconds,
    target,
)
from client.admin import AdminError
from client.client import Client, ClientError, PublishAck, RequestFailed
from client.crawl import crawl_any
from client.errors import describe
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
    addrs: list[str],
    n_topics: int,
    model: LoadModel,
    unit_bytes: int,
    seed: int,
    msg_rate: float | None,
    prefix: str,
    payload_bytes: int,
    wait: float,
    credentials: Credentials | None = None,
) -> dict[str, Any]:
    """Create the topics and fill them; returns a summary (topics, bytes, messages, seconds, sizes).

    `credentials` default to the environment (SEDAX_CA, ... SEDAX_INSECURE).
    """
    sizes = topic_sizes(model, n_topics, unit_bytes, seed)
    interval = 1.0 / msg_rate if msg_rate else 0.0
    started = time.monotonic()
    messages = 0
    async with Client(addrs, request_timeout=wait, credentials=credentials) as c:
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


# The topics' sizes are drawn up front: 10^8 took a gigabyte before the first message left, silently.
MAX_LOAD_TOPICS: Final = 1_000_000


def _cmd_load(args: argparse.Namespace) -> int:
    if args.topics > MAX_LOAD_TOPICS:
        return fail(
            f"--topics {args.topics}: at most {MAX_LOAD_TOPICS:,} per run; run it again with another --prefix for more",
            EXIT_USAGE,
        )
    try:
        addrs = brokers(args)
        validate_topic(f"{args.prefix}/0000")
        creds = credentials(args)
    except (UsageError, BadTopic) as exc:
        return fail(str(exc), EXIT_USAGE)
    try:
        out = asyncio.run(
            run_load(
                addrs,
                args.topics,
                LoadModel(args.sizes),
                args.unit_bytes,
                args.seed,
                args.rate,
                args.prefix,
                args.payload_bytes,
                args.timeout,
                creds,
            )
        )
    except (ClientError, TimeoutError, OSError) as exc:
        return fail(f"load failed: {describe(exc, f'not acknowledged within {args.timeout} s')}", EXIT_FAILED)
    if not args.json:
        out.pop("sizes")
    print(json.dumps(out))
    return 0


async def _move(addrs: list[str], topic: str, to: tuple[float, float], wait: float, creds: Credentials) -> None:
    async with Client(addrs, request_timeout=wait, credentials=creds) as c:
        await c.move(topic, to)


def _cmd_move(args: argparse.Namespace) -> int:
    try:
        addrs = brokers(args)
        validate_topic(args.topic)
        creds = credentials(args)
    except (UsageError, BadTopic) as exc:
        return fail(str(exc), EXIT_USAGE)
    try:
        asyncio.run(_move(addrs, args.topic, args.to, args.timeout, creds))
    except RequestFailed as exc:
        if exc.code == "unknown_topic":
            return fail(
                f"no broker holds topic {args.topic!r}; publish to it first or check the name with `sedax topics`",
                EXIT_FAILED,
            )
        return fail(f"move failed: {exc}", EXIT_FAILED)
    except (ClientError, TimeoutError, OSError) as exc:
        return fail(f"move failed: {describe(exc, f'no answer within {args.timeout} s')}", EXIT_FAILED)
    print(f"moved {args.topic} to {args.to[0]},{args.to[1]}")
    return 0


# Dry runs in flight at once with --cluster (each sends its coordinate queries to other brokers).
PLAN_PARALLEL: Final = 8


async def _plan(
    addrs: list[str], all_topics: bool, wait: float, creds: Credentials
) -> tuple[str, list[dict[str, Any]]]:
    """The access broker's dry run: the address that answered, and its plans."""
    async with Client(addrs, request_timeout=wait, credentials=creds) as c:
        plans = await c.balance_plan(all_topics)
        return c.address or addrs[0], plans


async def _cluster_plans(
    addrs: list[str], all_topics: bool, wait: float, creds: Credentials
) -> tuple[list[dict[str, Any]], list[str]]:
    """Every primary's dry run: the overlay is crawled from the first broker that answers, and each broker that
    STATUS says is primary (or delegate) of a topic with stored data is asked for its plans, which carry its id
    as "broker".  Returns the plans (by broker id) and one line per broker that did not answer."""
    found, _ = await crawl_any(addrs, credentials=creds, timeout=wait)
    primaries = sorted(
        (nid, st.node.listen)
        for nid, st in found.statuses.items()
        if any(h.role in ("primary", "delegate") and h.size > 0 for h in found.holdings[nid].held)
    )
    sem = asyncio.Semaphore(PLAN_PARALLEL)

    async def one(nid: str, addr: str) -> list[dict[str, Any]]:
        async with sem, Client([addr], request_timeout=wait, reconnect=False, credentials=creds) as c:
            return [{"broker": nid, **p} for p in await c.balance_plan(all_topics)]

    results = await asyncio.gather(*(one(nid, addr) for nid, addr in primaries), return_exceptions=True)
    plans: list[dict[str, Any]] = []
    failed: list[str] = []
    for (nid, addr), res in zip(primaries, results, strict=True):
        if isinstance(res, ClientError | TimeoutError | OSError):
            failed.append(f"broker {nid} at {addr}: {describe(res, f'no answer within {wait} s')}")
        elif isinstance(res, BaseException):
            raise res
        else:
            plans.extend(res)
    return plans, failed


def _plan_line(p: dict[str, Any]) -> str:
    cur = p.get("current", {})
    line = f"{p['topic']:<32} {p.get('size', 0):>10} B  {p['verdict']}"
    if "to" in p:
        best = p["best"]
        line += f" -> {p['to'][0]:.4f},{p['to'][1]:.4f} (L_max {cur['lmax']:.0f} -> {best['lmax']:.0f})"
    elif cur:
        line += f" (L_max here {cur['lmax']:.0f}, {p.get('offers', 0)} offers)"
    return line


def _cmd_balance(args: argparse.Namespace) -> int:
    try:
        addrs, creds = target(args)
    except UsageError as exc:
        return fail(str(exc), EXIT_USAGE)
    failed: list[str] = []
    try:
        if args.cluster:
            plans, failed = asyncio.run(_cluster_plans(addrs, args.all, args.timeout, creds))
        else:
            answered, plans = asyncio.run(_plan(addrs, args.all, args.timeout, creds))
    except (AdminError, ClientError, TimeoutError, OSError) as exc:
        return fail(f"dry run failed: {describe(exc, f'no answer within {args.timeout} s')}", EXIT_FAILED)
    if args.json:
        print(json.dumps(plans))
    elif args.cluster:
        if not plans and not failed:
            print("nothing to balance: no broker is primary of a topic with stored data")
        for p in plans:
            print(f"{p['broker']:<16} {_plan_line(p)}")
    else:
        if not plans:
            print(
                f"nothing to balance: the broker at {answered} is primary of no topic with stored data "
                "(--cluster asks every broker)"
            )
        for p in plans:
            print(_plan_line(p))
    for line in failed:
        fail(f"dry run failed: {line}")
    return EXIT_FAILED if failed else 0


def register(subparsers: Any) -> None:
    """Add the load, move and balance subcommands."""
    p = subparsers.add_parser("load", help="create N topics and fill them to the paper's size distribution")
    add_broker_flag(p)
    p.add_argument("--topics", type=positive_int, required=True, help="number of topics")
    p.add_argument(
        "--sizes",
        choices=[m.value for m in LoadModel],
        default="heterogeneous",
        help="topic size distribution of the paper's Sec. VII-A (default heterogeneous)",
    )
    p.add_argument(
        "--unit-bytes", dest="unit_bytes", type=positive_int, default=10_000, help="bytes of one load unit (10000)"
    )
    p.add_argument(
        "--payload-bytes",
        dest="payload_bytes",
        type=positive_int,
        default=DEFAULT_PAYLOAD,
        help=f"payload bytes per message ({DEFAULT_PAYLOAD})",
    )
    p.add_argument("--seed", type=int, default=1, help="seed of the topic sizes (1)")
    p.add_argument("--rate", type=rate, help="messages per second (default: as fast as acknowledged)")
    p.add_argument("--prefix", default="load", help="topic names are PREFIX/0000, PREFIX/0001, ...")
    p.add_argument("--timeout", type=seconds, default=60.0, help="seconds to wait for each topic's ACKs (60)")
    p.add_argument("--json", action="store_true", help="also print every topic's target size")
    p.set_defaults(func=_cmd_load)

    p = subparsers.add_parser("move", help="move a topic to another coordinate now (delegation)")
    p.add_argument("topic", metavar="TOPIC", help="topic name, e.g. grid/feeder-1/voltage")
    p.add_argument("to", metavar="X,Y", type=coordinate, help="the topic's new coordinate C(t)")
    add_broker_flag(p)
    p.add_argument("--timeout", type=seconds, default=15.0, help="seconds to wait for the hand-over (15)")
    p.set_defaults(func=_cmd_move)

    p = subparsers.add_parser("balance", help="dry run: what the access broker's balancer would move, and why")
    add_broker_flag(p)
    p.add_argument("--dry-run", action="store_true", default=True, help="(the only mode: nothing moves)")
    p.add_argument("--all", action="store_true", help="every topic, not just the smallest (Alg. 2)")
    p.add_argument(
        "--cluster",
        action="store_true",
        help="ask every broker that is primary of a topic (the overlay is crawled from the access broker)",
    )
    p.add_argument("--json", action="store_true", help="print the plans as one JSON list")
    p.add_argument("--timeout", type=seconds, default=30.0, help="seconds to wait for the plan (30)")
    p.set_defaults(func=_cmd_balance)
