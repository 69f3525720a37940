"""`sedax brokers`: every broker of the cluster, one line each, and whether the cluster is ready for the next step.

The overlay is crawled from one broker (client/crawl.py).  Ready means: every broker the others report answered
(and, with `--expect N`, N of them did: a broker that is down and that the overlay healed around is reported by
nobody), every broker is linked to exactly its Delaunay neighbours, and every topic's copies are caught up.  That
is what a rolling restart or upgrade waits for between two hosts (docs/deploy.md), so the exit status says it:
0 ready, 1 not (the last line says why), and `--wait S` waits up to S seconds for it.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from dataclasses import dataclass
from typing import Any, Final

from cli.args import EXIT_FAILED, EXIT_USAGE, UsageError, add_broker_flag, fail, positive_int, seconds, target
from cli.overlay import human_span
from client.admin import AdminError, Holdings, status_json
from client.crawl import COPY_ROLES, Crawl, caught_up, crawl_any, crl_gaps, overlay_gaps
from client.errors import describe
from net.credentials import Credentials
from overlay.protocol import Status

# How often `--wait` crawls again, and how often it says on stderr what it still waits for.
WAIT_POLL: Final = 0.5
WAIT_PROGRESS: Final = 10.0


@dataclass(frozen=True, slots=True)
class Verdict:
    """One crawl, judged: what keeps the overlay from being whole and the topics not caught up."""

    found: Crawl
    gaps: list[str]
    lagging: list[str]

    @property
    def ready(self) -> bool:
        return not self.gaps and not self.lagging

    def summary(self) -> str:
        """The last line: ready, or the first reasons it is not."""
        n = len(self.found.statuses)
        if self.ready:
            return f"ready: {n} brokers answered; the overlay is whole; every topic's copies are caught up"
        why = [*self.gaps[:3]]
        if len(self.gaps) > 3:
            why.append(f"{len(self.gaps) - 3} more (--json lists them all)")
        if self.lagging:
            more = f" and {len(self.lagging) - 5} more" if len(self.lagging) > 5 else ""
            why.append(f"{len(self.lagging)} topics not caught up: {', '.join(self.lagging[:5])}{more}")
        return "not ready: " + "; ".join(why)


async def judge(addrs: list[str], creds: Credentials, timeout: float, expect: int | None) -> Verdict:  # noqa: ASYNC109
    """Crawl the overlay from the first broker that answers and judge it."""
    found, _ = await crawl_any(addrs, credentials=creds, timeout=timeout)
    return Verdict(found, overlay_gaps(found, expect), found.lagging())


def broker_row(st: Status, holdings: Holdings, now: float) -> dict[str, Any]:
    """One broker as `--json` lists it."""
    copies = [h for h in holdings.held if h.role in COPY_ROLES]
    whole = status_json(st)  # (its None for what an older broker does not say)
    return {
        **{
            k: whole[k]
            for k in ("node", "listen", "coord", "version", "certificate_expires", "crl_next_update", "reload_ok")
        },
        "uptime": round(now - st.started, 3) if st.started else None,
        "neighbours": sorted(n.id for n in st.neighbours),
        "topics": len(copies),
        "lagging": sum(not caught_up(h) for h in copies),
    }


def _print_table(rows: list[dict[str, Any]], unreachable: dict[str, tuple[float, float]], now: float) -> None:
    print(f"{'NODE':<16} {'ADDRESS':<22} {'COORD':<15} {'VERSION':<9} {'UP':<12} {'LINKS':>5} {'TOPICS':>6} "
          f"{'LAGGING':>7}  CERTIFICATE")  # fmt: skip
    for r in rows:
        up = "?" if r["uptime"] is None else human_span(r["uptime"])
        expires = r["certificate_expires"]
        cert = "plain TCP" if expires is None else "EXPIRED" if expires <= now else human_span(expires - now)
        due = r["crl_next_update"]
        if due is not None:
            cert += "; CRL DUE" if due <= now else f"; CRL {human_span(due - now)}"
        if not r["reload_ok"]:
            cert += "; last reload REFUSED"
        coord = f"{r['coord'][0]:.4f},{r['coord'][1]:.4f}"
        print(f"{r['node']:<16} {r['listen']:<22} {coord:<15} {r['version'] or '?':<9} {up:<12} "
              f"{len(r['neighbours']):>5} {r['topics']:>6} {r['lagging']:>7}  {cert}")  # fmt: skip
    for nid, c in sorted(unreachable.items()):
        print(f"{nid:<16} {'(does not answer)':<22} {c[0]:.4f},{c[1]:.4f}")


async def _judged(args: argparse.Namespace, addrs: list[str], creds: Credentials) -> Verdict:
    """One verdict, or with --wait the first ready one (else the last) within the time given."""
    if args.wait is None:
        return await judge(addrs, creds, args.timeout, args.expect)
    loop = asyncio.get_running_loop()
    deadline = loop.time() + args.wait
    told = loop.time()
    while True:
        try:
            verdict = await judge(addrs, creds, args.timeout, args.expect)
        except AdminError as exc:  # the brokers asked may be the ones restarting: ask again until the deadline
            verdict = Verdict(Crawl(), [f"no broker answered: {describe(exc)}"], [])
        if verdict.ready or loop.time() >= deadline:
            return verdict
        if loop.time() - told >= WAIT_PROGRESS:
            told = loop.time()
            print(f"waiting: {verdict.summary()}", file=sys.stderr, flush=True)
        await asyncio.sleep(WAIT_POLL)


def _cmd_brokers(args: argparse.Namespace) -> int:
    try:
        addrs, creds = target(args)
    except UsageError as exc:
        return fail(str(exc), EXIT_USAGE)
    try:
        verdict = asyncio.run(_judged(args, addrs, creds))
    except (AdminError, OSError, TimeoutError) as exc:
        return fail(describe(exc), EXIT_FAILED)
    now = time.time()
    found = verdict.found
    rows = [broker_row(st, found.holdings[nid], now) for nid, st in sorted(found.statuses.items())]
    # Not part of the verdict (a revocation does not wait for a restart), but what the operator must see.
    warnings = crl_gaps(found.statuses)
    if args.json:
        unreachable = {nid: list(c) for nid, c in sorted(found.unreachable.items())}
        out = {"brokers": rows, "unreachable": unreachable, "ready": verdict.ready, "gaps": verdict.gaps}
        print(json.dumps({**out, "lagging": verdict.lagging, "warnings": warnings}))
    else:
        _print_table(rows, found.unreachable, now)
        for w in warnings:
            print(f"warning: {w}")
        print(verdict.summary())
    return 0 if verdict.ready else EXIT_FAILED


def register(subparsers: Any) -> None:
    """Add the `brokers` subcommand."""
    p = subparsers.add_parser(
        "brokers",
        help="list every broker of the cluster and say whether it is ready: overlay whole, topics caught up",
        description="List every broker of the cluster (crawled from the first that answers) and say whether the "
        "cluster is ready: every broker answers and is linked to its Delaunay neighbours, and every topic's copies "
        "are caught up.  Exit 0 if ready, 1 if not (the last line says why): what a rolling restart waits for "
        "between two hosts.",
    )
    add_broker_flag(p, what="any broker of the cluster (the overlay is crawled from the first that answers)")
    p.add_argument(
        "--expect",
        type=positive_int,
        help="the number of brokers the cluster has: fewer answering is not ready (a broker that is down is "
        "reported by nobody once the overlay has healed around it)",
    )
    p.add_argument("--wait", type=seconds, help="wait up to S seconds for the cluster to be ready")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--timeout", type=seconds, default=5.0, help="seconds per broker request (5)")
    p.set_defaults(func=_cmd_brokers)
