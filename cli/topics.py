"""`sedax topics`: every topic of the cluster with its coordinate, holders, stored bytes, subscribers and rate.

The overlay is crawled from one broker (client/crawl.py: STATUS of every broker reachable from it); each
broker's STATUS lists the topics it holds and its role for each (primary, secondary, tertiary, delegate, home),
and for those it is primary of how many messages it stored in the last RATE_WINDOW seconds (the rate).
Each topic is then located once (LOCATE, answered by its primary) for its coordinate and subscriber count.
"""

from __future__ import annotations

import argparse
import asyncio
import json
from typing import Any

from cli.args import (
    EXIT_FAILED,
    EXIT_USAGE,
    UsageError,
    add_broker_flag,
    fail,
    seconds,
    target,
)
from client.admin import AdminError
from client.client import Client, ClientError
from client.crawl import crawl_any
from client.errors import describe
from net.credentials import Credentials
from overlay.protocol import RATE_WINDOW
from overlay.topics import WILDCARD_REST, BadTopic, matches, validate_pattern

# LOCATE requests in flight at once.
LOCATE_PARALLEL = 32


async def list_topics(
    addrs: list[str],
    creds: Credentials,
    timeout: float,  # noqa: ASYNC109
    pattern: str = WILDCARD_REST,
) -> list[dict[str, Any]]:
    """One dict per topic matching pattern (sorted by name): name, coord, home, holders by role, bytes,
    subscribers, rate.  Only those are located: the crawl reads every broker's topics in pages of 1,000, and the
    LOCATE per topic listed is what grows with the listing.

    rate is msg/s over the last RATE_WINDOW s, None if the topic's primary is a broker too old to say.
    """
    found, _ = await crawl_any(addrs, credentials=creds, timeout=timeout)
    holders: dict[str, dict[str, list[str]]] = {}
    sizes: dict[str, int] = {}
    recent: dict[str, int] = {}
    for nid, hs in sorted(found.holdings.items()):
        for h in hs.held:
            if not matches(pattern, h.topic):
                continue
            holders.setdefault(h.topic, {}).setdefault(h.role, []).append(nid)
            if h.role in ("primary", "delegate"):
                sizes[h.topic] = max(sizes.get(h.topic, 0), h.size)
        for topic, n in hs.recent.items():  # two primaries for a moment during a move: the larger count
            if topic in holders:
                recent[topic] = max(recent.get(topic, 0), n)
    sem = asyncio.Semaphore(LOCATE_PARALLEL)
    out: list[dict[str, Any]] = []
    async with Client(addrs, request_timeout=timeout, reconnect=False, credentials=creds) as c:

        async def one(topic: str) -> dict[str, Any]:
            async with sem:
                try:
                    loc = await c.locate(topic)
                except (ClientError, TimeoutError) as exc:  # a topic in hand-over or whose holder just failed
                    return {"topic": topic, "error": describe(exc)}
            return {
                "topic": topic,
                "coord": list(loc.coord),
                "home": list(loc.home),
                "delegated": loc.coord != loc.home,
                "bytes": loc.size,
                "subscribers": loc.subscribers,
            }

        located = await asyncio.gather(*(one(t) for t in sorted(holders)))
    for row in located:
        topic = row["topic"]
        row.setdefault("bytes", sizes.get(topic, 0))
        row["rate"] = round(recent[topic] / RATE_WINDOW, 3) if topic in recent else None
        row["holders"] = {role: ids for role, ids in sorted(holders[topic].items())}
        out.append(row)
    return out


def _cmd_topics(args: argparse.Namespace) -> int:
    try:
        addrs, creds = target(args)
    except UsageError as exc:
        return fail(str(exc), EXIT_USAGE)
    try:
        pattern = validate_pattern(args.pattern)
    except BadTopic as exc:
        return fail(f"{exc} (a topic pattern: grid/+/voltage, grid/feeder-7/#)", EXIT_USAGE)
    try:
        rows = asyncio.run(list_topics(addrs, creds, args.timeout, pattern))
    except (AdminError, ClientError, OSError, TimeoutError) as exc:
        return fail(describe(exc), EXIT_FAILED)
    if args.json:
        print(json.dumps(rows))
        return 0
    if not rows:
        print("no topics" if pattern == WILDCARD_REST else f"no topics match {pattern}")
        return 0
    print(f"{'TOPIC':<36} {'COORD':<17} {'PRIMARY':<10} {'SECONDARY':<10} {'BYTES':>12} {'SUBS':>5} {'MSG/S':>9}")
    for r in rows:
        coord = f"{r['coord'][0]:.4f},{r['coord'][1]:.4f}" if "coord" in r else "?"
        h = r["holders"]
        primary = ",".join(h.get("primary", []) or h.get("delegate", [])) or "-"
        secondary = ",".join(h.get("secondary", [])) or "-"
        subs = r.get("subscribers", "?")
        rate = "-" if r["rate"] is None else f"{r['rate']:.2f}"
        print(f"{r['topic']:<36} {coord:<17} {primary:<10} {secondary:<10} {r['bytes']:>12} {subs:>5} {rate:>9}")
    return 0


def register(subparsers: Any) -> None:
    """Add the `topics` subcommand."""
    p = subparsers.add_parser(
        "topics", help=f"list every topic of the cluster: holders, bytes, subscribers, msg/s over {RATE_WINDOW} s"
    )
    p.add_argument(
        "pattern",
        nargs="?",
        default=WILDCARD_REST,
        help="only the topics matching this pattern ('+' one level, '#' the rest: grid/feeder-7/#); all if left out",
    )
    add_broker_flag(p, what="any broker of the cluster (the overlay is crawled from the first that answers)")
    p.add_argument("--json", action="store_true", help="print one JSON list")
    p.add_argument("--timeout", type=seconds, default=5.0, help="seconds per broker request (5)")
    p.set_defaults(func=_cmd_topics)
