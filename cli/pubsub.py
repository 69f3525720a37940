"""Pub/sub subcommands of the `sedax` CLI: pub, sub, locate (in the spirit of mosquitto_pub/sub, nats pub/sub).

Every command takes `--broker HOST:PORT`, repeatable or comma-separated; the client attaches to the first that
answers and fails over to the others.  `SEDAX_BROKERS` gives the default list.

Exit codes: 0 success; 1 the overlay refused or did not answer (the reason is printed); 2 usage errors.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from collections.abc import Iterator
from typing import Any

from cli.args import (
    EXIT_FAILED,
    EXIT_USAGE,
    UsageError,
    add_broker_flag,
    fail,
    positive_int,
    rate,
    seconds,
    target,
    timestamp,
)
from client.client import Client, ClientError, ConnectError, PublishAck, ReceivedMessage, RequestFailed
from client.errors import describe
from overlay.pubsub import MAX_PAYLOAD_SIZE
from overlay.topics import BadTopic, validate_topic


class PayloadTooLarge(ValueError):
    """A stdin line is longer than a message may be."""


def _stdin_payloads() -> Iterator[bytes]:
    # Bytes, not text: a payload is whatever the line holds (a non-UTF-8 byte is data, not an error).
    for i, line in enumerate(sys.stdin.buffer, 1):
        payload = line.rstrip(b"\n")
        if len(payload) > MAX_PAYLOAD_SIZE:
            raise PayloadTooLarge(
                f"stdin line {i} is {len(payload)} bytes, over the {MAX_PAYLOAD_SIZE} bytes a message may carry: "
                "split it into several messages"
            )
        yield payload


# --------------------------------------------------------------------------------------------------- pub


async def _pub(args: argparse.Namespace, brokers: list[str]) -> int:
    if args.message is not None:
        lines: Any = (args.message for _ in range(args.count if args.count is not None else 1))
    else:
        lines = _stdin_payloads()
    interval = 1.0 / args.rate if args.rate else 0.0
    futures: list[asyncio.Future[PublishAck]] = []
    async with Client(brokers, request_timeout=args.timeout, credentials=args.credentials) as c:
        start = time.monotonic()
        for i, line in enumerate(lines):
            if args.message is None and args.count is not None and i >= args.count:
                break
            if interval:
                delay = start + i * interval - time.monotonic()
                if delay > 0:
                    await asyncio.sleep(delay)
            futures.append(await c.publish_nowait(args.topic, line))
        try:
            async with asyncio.timeout(args.timeout):
                results = await asyncio.gather(*futures, return_exceptions=True)
        except TimeoutError:
            return fail(
                f"{c.unacknowledged} of {len(futures)} messages not acknowledged within {args.timeout}s", EXIT_FAILED
            )
    failed = [r for r in results if isinstance(r, BaseException)]
    if failed:
        return fail(f"{len(failed)} of {len(results)} messages refused: {failed[0]}", EXIT_FAILED)
    if args.verbose:
        print(f"published {len(results)} message(s) to {args.topic}", file=sys.stderr)
    return 0


def _cmd_pub(args: argparse.Namespace) -> int:
    try:
        addrs, args.credentials = target(args)
        validate_topic(args.topic)
        if args.message is not None and len(args.message.encode()) > MAX_PAYLOAD_SIZE:
            raise UsageError(f"MESSAGE is over the {MAX_PAYLOAD_SIZE} bytes a message may carry")
    except (UsageError, BadTopic) as exc:
        return fail(str(exc), EXIT_USAGE)
    try:
        return asyncio.run(_pub(args, addrs))
    except PayloadTooLarge as exc:
        return fail(str(exc), EXIT_FAILED)
    except ConnectError as exc:
        return fail(str(exc), EXIT_FAILED)
    except (ClientError, TimeoutError, OSError) as exc:
        return fail(f"publish failed: {describe(exc)}", EXIT_FAILED)


# --------------------------------------------------------------------------------------------------- sub


def _payload_text(payload: bytes) -> tuple[str, bool]:
    try:
        return payload.decode("utf-8"), True
    except UnicodeDecodeError:
        return payload.hex(), False


def message_json(m: ReceivedMessage) -> dict[str, Any]:
    """One delivered message as printed by `sedax sub --json`."""
    text, utf8 = _payload_text(m.payload)
    out: dict[str, Any] = {"topic": m.topic, "payload": text, "publisher": m.publisher, "seq": m.seq, "ts": m.ts}
    if not utf8:
        out["payload_hex"] = True
    return out


async def _sub(args: argparse.Namespace, brokers: list[str]) -> int:
    got = 0
    async with Client(brokers, credentials=args.credentials) as c, c.subscribe(args.topic, since=args.since) as sub:
        if args.verbose:
            print(f"subscribed to {args.topic} via {c.address}", file=sys.stderr)
        try:
            async with asyncio.timeout(args.timeout):
                async for m in sub:
                    if args.json:
                        print(json.dumps(message_json(m)), flush=True)
                    else:
                        print(_payload_text(m.payload)[0], flush=True)
                    got += 1
                    if args.count is not None and got >= args.count:
                        break
        except TimeoutError:
            if args.count is not None:
                return fail(f"timed out after {got} of {args.count} messages", EXIT_FAILED)
        if sub.gaps:
            return fail(f"{sub.gaps} message(s) were lost with a failed broker (resilience level 1)", EXIT_FAILED)
    return 0


def _cmd_sub(args: argparse.Namespace) -> int:
    try:
        addrs, args.credentials = target(args)
        validate_topic(args.topic)
    except (UsageError, BadTopic) as exc:
        return fail(str(exc), EXIT_USAGE)
    try:
        return asyncio.run(_sub(args, addrs))
    except KeyboardInterrupt:
        return 0
    except RequestFailed as exc:
        return fail(f"subscribe refused: {exc}", EXIT_FAILED)
    except (ClientError, TimeoutError, OSError) as exc:
        return fail(describe(exc), EXIT_FAILED)


# ------------------------------------------------------------------------------------------------ locate


async def _locate(args: argparse.Namespace, brokers: list[str]) -> dict[str, Any]:
    async with Client(brokers, request_timeout=args.timeout, reconnect=False, credentials=args.credentials) as c:
        topic = args.topic
        loc = await c.locate(topic)
    return {
        "topic": loc.topic,
        "home": list(loc.home),
        "coord": list(loc.coord),
        "primary": loc.primary.listen,
        "secondary": loc.secondary.listen if loc.secondary else None,
        "tertiary": loc.tertiary.listen if loc.tertiary else None,
        "delegates": [{"coord": list(d.coord), "start": d.start} for d in loc.delegates],
        "size": loc.size,
        "subscribers": loc.subscribers,
        "nodes": {
            role: {"id": n.id, "coord": list(n.coord), "listen": n.listen}
            for role, n in (("primary", loc.primary), ("secondary", loc.secondary), ("tertiary", loc.tertiary))
            if n is not None
        },
    }


def _cmd_locate(args: argparse.Namespace) -> int:
    try:
        addrs, args.credentials = target(args)
        validate_topic(args.topic)
    except (UsageError, BadTopic) as exc:
        return fail(str(exc), EXIT_USAGE)
    try:
        out = asyncio.run(_locate(args, addrs))
    except (ClientError, TimeoutError, OSError) as exc:
        return fail(f"locate failed: {describe(exc, f'no answer within {args.timeout} s')}", EXIT_FAILED)
    if args.json:
        print(json.dumps(out))
    else:
        print(f"topic      {out['topic']}")
        print(f"home       {out['home'][0]:.6f},{out['home'][1]:.6f}")
        print(f"coordinate {out['coord'][0]:.6f},{out['coord'][1]:.6f}")
        for role in ("primary", "secondary", "tertiary"):
            print(f"{role:<10} {out[role] or '-'}")
        print(f"stored     {out['size']} bytes, {out['subscribers']} subscriber(s)")
        for d in out["delegates"]:
            print(f"delegate   {d['coord'][0]:.6f},{d['coord'][1]:.6f} since {d['start']:.3f}")
    return 0


def register(subparsers: Any) -> None:
    """Add the pub, sub and locate subcommands."""
    p = subparsers.add_parser("pub", help="publish messages (MESSAGE, or one per stdin line)")
    p.add_argument("topic", metavar="TOPIC", help="topic name, e.g. grid/feeder-1/voltage")
    p.add_argument("message", metavar="MESSAGE", nargs="?", help="the payload; without it, one message per stdin line")
    add_broker_flag(p)
    p.add_argument("--rate", type=rate, help="messages per second (default: as fast as acknowledged)")
    p.add_argument("--count", type=positive_int, help="with MESSAGE: send it N times; from stdin: at most N lines")
    p.add_argument("--timeout", type=seconds, default=30.0, help="seconds to wait for acknowledgements (30)")
    p.add_argument("-v", "--verbose", action="store_true", help="say on stderr what was published")
    p.set_defaults(func=_cmd_pub)

    p = subparsers.add_parser("sub", help="subscribe and print messages")
    p.add_argument("topic", metavar="TOPIC", help="topic name, e.g. grid/feeder-1/voltage")
    add_broker_flag(p)
    p.add_argument("--count", type=positive_int, help="exit after N messages")
    p.add_argument("--timeout", type=seconds, help="exit after S seconds (non-zero if --count was not reached)")
    p.add_argument(
        "--since",
        type=timestamp,
        help="first replay the stored messages newer than this: a Unix timestamp (0: all), a span back from now "
        "(90s, 10m, 2h, 1d) or an ISO date and time (2026-11-29T09:00, local time unless a zone is given)",
    )
    p.add_argument("--json", action="store_true", help="one JSON object per message")
    p.add_argument("-v", "--verbose", action="store_true", help="say on stderr where the subscription went")
    p.set_defaults(func=_cmd_sub)

    p = subparsers.add_parser("locate", help="where a topic lives: coordinates, holders, delegate list")
    p.add_argument("topic", metavar="TOPIC", help="topic name, e.g. grid/feeder-1/voltage")
    add_broker_flag(p)
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--timeout", type=seconds, default=5.0, help="seconds to wait for the answer (5)")
    p.set_defaults(func=_cmd_locate)
