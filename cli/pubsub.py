"""Pub/sub subcommands of the `sedax` CLI: pub, sub, locate (in the spirit of mosquitto_pub/sub, nats pub/sub).

Every command takes `--broker HOST:PORT`, repeatable or comma-separated; the client attaches to the first that
answers and fails over to the others.  `SEDAX_BROKERS` gives the default list.

Exit codes: 0 success; 1 the overlay refused or did not answer (the reason is printed); 2 usage errors.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from typing import Any, Final

from client.client import Client, ClientError, ConnectError, PublishAck, ReceivedMessage, RequestFailed
from net.credentials import add_credential_flags, credentials_from_args
from overlay.topics import BadTopic, validate_topic

EXIT_FAILED: Final = 1
EXIT_USAGE: Final = 2


def _err(msg: str, code: int) -> int:
    print(f"sedax: error: {msg}", file=sys.stderr)
    return code


def brokers_arg(values: list[str] | None) -> list[str]:
    """The broker list from --broker flags (repeatable, comma-separated) or SEDAX_BROKERS."""
    raw = values or [os.environ.get("SEDAX_BROKERS", "")]
    out = [a.strip() for v in raw for a in v.split(",") if a.strip()]
    if not out:
        raise ValueError("give --broker HOST:PORT (or set SEDAX_BROKERS)")
    return out


def add_broker_flag(p: argparse.ArgumentParser) -> None:
    """The shared --broker flag and the credential flags (--ca, --cert, --key, --token, --insecure)."""
    p.add_argument(
        "--broker",
        action="append",
        metavar="HOST:PORT",
        help="access broker; repeat or comma-separate for fail-over (default: $SEDAX_BROKERS)",
    )
    add_credential_flags(p)


# --------------------------------------------------------------------------------------------------- pub


async def _pub(args: argparse.Namespace, brokers: list[str]) -> int:
    if args.message is not None:
        lines: Any = (args.message for _ in range(args.count if args.count is not None else 1))
    else:
        lines = (line.rstrip("\n") for line in sys.stdin)
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
            return _err(
                f"{c.unacknowledged} of {len(futures)} messages not acknowledged within {args.timeout}s", EXIT_FAILED
            )
    failed = [r for r in results if isinstance(r, BaseException)]
    if failed:
        return _err(f"{len(failed)} of {len(results)} messages refused: {failed[0]}", EXIT_FAILED)
    if args.verbose:
        print(f"published {len(results)} message(s) to {args.topic}", file=sys.stderr)
    return 0


def _cmd_pub(args: argparse.Namespace) -> int:
    try:
        brokers = brokers_arg(args.broker)
        validate_topic(args.topic)
        args.credentials = credentials_from_args(args)
        if args.rate is not None and args.rate <= 0:
            raise ValueError("--rate must be positive")
        if args.count is not None and args.count < 0:
            raise ValueError("--count must not be negative")
    except (ValueError, BadTopic) as exc:
        return _err(str(exc), EXIT_USAGE)
    try:
        return asyncio.run(_pub(args, brokers))
    except ConnectError as exc:
        return _err(str(exc), EXIT_FAILED)
    except (ClientError, TimeoutError) as exc:
        return _err(f"publish failed: {exc}", EXIT_FAILED)


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
                return _err(f"timed out after {got} of {args.count} messages", EXIT_FAILED)
        if sub.gaps:
            return _err(f"{sub.gaps} message(s) were lost with a failed broker (resilience level 1)", EXIT_FAILED)
    return 0


def _cmd_sub(args: argparse.Namespace) -> int:
    try:
        brokers = brokers_arg(args.broker)
        validate_topic(args.topic)
        args.credentials = credentials_from_args(args)
        if args.count is not None and args.count < 1:
            raise ValueError("--count must be at least 1")
    except (ValueError, BadTopic) as exc:
        return _err(str(exc), EXIT_USAGE)
    try:
        return asyncio.run(_sub(args, brokers))
    except KeyboardInterrupt:
        return 0
    except RequestFailed as exc:
        return _err(f"subscribe refused: {exc}", EXIT_FAILED)
    except (ClientError, TimeoutError) as exc:
        return _err(str(exc) or type(exc).__name__, EXIT_FAILED)


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
        brokers = brokers_arg(args.broker)
        validate_topic(args.topic)
        args.credentials = credentials_from_args(args)
    except (ValueError, BadTopic) as exc:
        return _err(str(exc), EXIT_USAGE)
    try:
        out = asyncio.run(_locate(args, brokers))
    except (ClientError, TimeoutError) as exc:
        return _err(f"locate failed: {exc}", EXIT_FAILED)
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
    p.add_argument("topic", metavar="TOPIC")
    p.add_argument("message", metavar="MESSAGE", nargs="?", help="the payload; without it, one message per stdin line")
    add_broker_flag(p)
    p.add_argument("--rate", type=float, help="messages per second (default: as fast as acknowledged)")
    p.add_argument("--count", type=int, help="with MESSAGE: send it N times; from stdin: at most N lines")
    p.add_argument("--timeout", type=float, default=30.0, help="seconds to wait for acknowledgements (30)")
    p.add_argument("-v", "--verbose", action="store_true")
    p.set_defaults(func=_cmd_pub)

    p = subparsers.add_parser("sub", help="subscribe and print messages")
    p.add_argument("topic", metavar="TOPIC")
    add_broker_flag(p)
    p.add_argument("--count", type=int, help="exit after N messages")
    p.add_argument("--timeout", type=float, help="exit after S seconds (non-zero if --count was not reached)")
    p.add_argument("--since", type=float, help="first replay stored messages newer than this timestamp")
    p.add_argument("--json", action="store_true", help="one JSON object per message")
    p.add_argument("-v", "--verbose", action="store_true")
    p.set_defaults(func=_cmd_sub)

    p = subparsers.add_parser("locate", help="where a topic lives: coordinates, holders, delegate list")
    p.add_argument("topic", metavar="TOPIC")
    add_broker_flag(p)
    p.add_argument("--json", action="store_true")
    p.add_argument("--timeout", type=float, default=5.0)
    p.set_defaults(func=_cmd_locate)
