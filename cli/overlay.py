"""Overlay subcommands of the `sedax` CLI: broker, status, route, cluster.

`cli/main.py` calls `register(subparsers)`; each subcommand sets `func(args) -> int` (the exit code).
Exit codes: 0 success; 1 the overlay refused or did not answer, or a file could not be read; 2 usage errors.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shlex
import sys
import time
from pathlib import Path
from typing import Any, Final

from broker import defaults
from cli.args import (
    EXIT_FAILED,
    EXIT_USAGE,
    UsageError,
    add_broker_flag,
    coordinate,
    fail,
    parse_xy,
    positive_int,
    seconds,
    target,
)
from client.admin import AdminClient, AdminError, RequestFailed, route_json, status_json
from net.credentials import Credentials

DEFAULT_STATE_DIR: Final = ".sedax-cluster"
# A rolling restart says what it waits for when a step takes longer than this many seconds.
PROGRESS_EVERY: Final = 5.0


async def _first_answer(addrs: list[str], limit: float, creds: Credentials) -> AdminClient:
    """An admin connection to the first broker of addrs that answers (BrokerUnavailable names the last error)."""
    last: AdminError | None = None
    for addr in addrs:
        try:
            return await AdminClient.connect(addr, timeout=limit, credentials=creds)
        except AdminError as exc:
            last = exc
    assert last is not None  # addrs is never empty (cli.args.brokers)
    raise last


# ------------------------------------------------------------------------------------------------ broker


def _cmd_broker(args: argparse.Namespace) -> int:
    from broker.main import start  # (here, not at the top: it imports the broker, uvloop and the geometry stack)

    return start(args)


# ------------------------------------------------------------------------------------------------ status


async def _status(addrs: list[str], limit: float, creds: Credentials) -> dict[str, Any]:
    async with await _first_answer(addrs, limit, creds) as c:
        st = await c.status()
        return status_json(st, await c.holdings(st))


def _cmd_status(args: argparse.Namespace) -> int:
    try:
        addrs, creds = target(args)
    except UsageError as exc:
        return fail(str(exc), EXIT_USAGE)
    try:
        st = asyncio.run(_status(addrs, args.timeout, creds))
    except AdminError as exc:
        return fail(str(exc), EXIT_FAILED)
    if args.json:
        print(json.dumps(st))
        return 0
    print(f"broker {st['node']} at {st['listen']}  coord ({st['coord'][0]:.6f}, {st['coord'][1]:.6f})")
    if st["version"] is not None:  # (None: a broker older than these fields)
        print(running_line(st, time.time()))
    if not st["reload_ok"]:
        print(
            "the last reload (SIGHUP) was REFUSED: the broker runs on its earlier files and settings; its log says why"
        )
    print(f"neighbours ({len(st['neighbours'])}):")
    for n in st["neighbours"]:
        print(f"  {n['id']:<16} ({n['coord'][0]:.6f}, {n['coord'][1]:.6f})  {n['listen']}")
    loads = "  ".join(f"{k} {v}" for k, v in sorted(st["loads"].items()))
    print(f"loads (bytes): {loads}")
    print(f"topics ({len(st['topics'])}):")
    for t in sorted(st["topics"], key=lambda t: t["topic"]):
        state = t["state"]
        if t["behind"]:
            state += f", {t['behind']} B behind"
        if t["pending"]:
            state += f", {t['pending']} pending"
        print(f"  {t['topic']:<40} {t['role']:<10} {t['size']:>12} B  {state}")
    return 0


def running_line(st: dict[str, Any], now: float) -> str:
    """What runs, since when, and until when its certificate (and CRL) holds: `sedax 0.1.0, resilience 2, up 3 h 12
    min (since 2026-11-29 09:50 UTC); TLS certificate (or its CA) valid until 2027-02-27 00:00 UTC (90 days left);
    CRL due 2026-12-29 09:50 UTC (30 days left)`."""
    since = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(st["started"]))
    line = (
        f"sedax {st['version']}, resilience {st['resilience']}, up {human_span(now - st['started'])} (since {since}); "
    )
    expires = st["certificate_expires"]
    if expires is None:
        return line + "plain TCP (--insecure)"
    until = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(expires))
    if expires <= now:
        line += f"TLS certificate EXPIRED at {until}: renew it (docs/security.md), then `kill -HUP` the broker"
    else:
        line += f"TLS certificate (or its CA) valid until {until} ({human_span(expires - now)} left)"
    due = st.get("crl_next_update")
    if due is not None:
        at = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(due))
        if due <= now:
            line += f"; its CRL was DUE at {at}: write a fresh one (sedax certs crl, or your CA), then `kill -HUP`"
        else:
            line += f"; CRL due {at} ({human_span(due - now)} left)"
    return line


def human_span(seconds: float) -> str:
    """A duration as people read it: `42 s`, `5 min`, `3 h 12 min`, `89 days`."""
    s = max(0, int(seconds))
    if s < 60:
        return f"{s} s"
    if s < 3600:
        return f"{s // 60} min"
    if s < 2 * 86400:
        return f"{s // 3600} h {s % 3600 // 60} min"
    return f"{s // 86400} days"


# ------------------------------------------------------------------------------------------------- route


async def _route(addrs: list[str], target: tuple[float, float], limit: float, creds: Credentials) -> dict[str, Any]:
    async with await _first_answer(addrs, limit, creds) as c:
        return route_json(await c.route(target))


def _cmd_route(args: argparse.Namespace) -> int:
    try:
        addrs, creds = target(args)
    except UsageError as exc:
        return fail(str(exc), EXIT_USAGE)
    coord = args.coord
    try:
        r = asyncio.run(_route(addrs, coord, args.timeout, creds))
    except RequestFailed as exc:
        return fail(f"broker refused the probe: {exc}", EXIT_FAILED)
    except AdminError as exc:
        return fail(str(exc), EXIT_FAILED)
    if args.json:
        print(json.dumps(r))
        return 0
    node = r["node"]
    hops = r["hops"]
    print(f"({coord[0]}, {coord[1]}) -> {node['id']} at {node['listen']} in {hops} hop{'' if hops == 1 else 's'}")
    print("path: " + " -> ".join(p["id"] for p in r["path"]))
    return 0


# ----------------------------------------------------------------------------------------------- cluster


class CoordsFileError(ValueError):
    """A --coords file cannot be read or holds something other than coordinates."""


def read_coords(path: str) -> list[tuple[float, float]]:
    """Coordinates from a file of X,Y lines (# comments) or a JSON list of [x, y] pairs; CoordsFileError if bad."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise CoordsFileError(f"cannot read --coords {path}: {exc}") from None
    if text.lstrip().startswith("["):
        try:
            pairs = json.loads(text)
        except ValueError as exc:
            raise CoordsFileError(f"--coords {path} is not valid JSON: {exc}") from None
        if not isinstance(pairs, list) or not all(isinstance(c, list) and len(c) == 2 for c in pairs):
            raise CoordsFileError(f"--coords {path}: a JSON file must be a list of [x, y] pairs")
        items = [(i, f"{c[0]},{c[1]}") for i, c in enumerate(pairs, 1)]
    else:
        lines = enumerate(text.splitlines(), 1)
        items = [(i, ln.strip()) for i, ln in lines if ln.strip() and not ln.lstrip().startswith("#")]
    coords: list[tuple[float, float]] = []
    for i, item in items:
        try:
            coords.append(parse_xy(item))
        except ValueError as exc:
            raise CoordsFileError(f"--coords {path}, entry {i}: {exc}") from None
    if not coords:
        raise CoordsFileError(f"--coords {path} holds no coordinates (one X,Y per line, or a JSON list of pairs)")
    return coords


def _progress(started: int, n: int) -> None:
    print(f"started {started}/{n} brokers", file=sys.stderr, flush=True)


async def _cluster_up(args: argparse.Namespace) -> int:
    from cli.cluster import STATE_FILE, STOPPED_FILE, ClusterError, LocalCluster, StateFileError, read_stopped
    from net.certs import CertError

    state_dir = Path(args.state_dir)
    if (state_dir / STATE_FILE).exists():
        return fail(
            f"{state_dir}/{STATE_FILE} exists: run `sedax cluster down --state-dir {state_dir}` first", EXIT_FAILED
        )
    try:
        coords = read_coords(args.coords) if args.coords else None
        # Without --nodes and --coords, the cluster stopped in this state directory starts again: the same
        # brokers, coordinates, data directories and (where still free) addresses, so clients find them.
        stopped = read_stopped(state_dir) if args.nodes is None and coords is None else None
    except (CoordsFileError, StateFileError) as exc:
        return fail(str(exc), EXIT_FAILED)
    if stopped is not None:
        coords = [n.coord for n in stopped.nodes]
    n = args.nodes if args.nodes is not None else (len(coords) if coords else 0)
    if n < 1:
        return fail(
            f"give --nodes N (>= 1) or --coords FILE (no cluster was stopped in {state_dir} to start again)", EXIT_USAGE
        )
    # Flags given now win over the stopped cluster's; otherwise its own, or the defaults of a new cluster.
    resilience = args.resilience or (stopped.resilience if stopped else defaults.RESILIENCE)
    if args.broker_args is not None:
        extra = shlex.split(args.broker_args)
    else:
        extra = list(stopped.broker_args) if stopped else []
    tls = False if args.insecure else (stopped.tls if stopped else None)
    try:
        cluster = LocalCluster(
            n,
            seed=args.seed,
            coords=coords,
            resilience=resilience,
            state_dir=state_dir,
            broker_args=tuple(extra),
            tls=tls,
            detached=True,
            data_dirs=True,
            listens=[n.listen for n in stopped.nodes] if stopped else (),
        )
        creds = cluster.credentials("client")
    except CertError as exc:
        return fail(f"cannot create the cluster's certificates: {exc}", EXIT_FAILED)
    except ClusterError as exc:
        return fail(f"--nodes {n}: {exc}", EXIT_USAGE)
    try:
        await cluster.start(_progress)
        print(f"waiting for the overlay to become the Delaunay triangulation (at most {args.timeout:g} s) ...",
              file=sys.stderr, flush=True)  # fmt: skip
        took = await cluster.wait_converged(args.timeout)
        path = cluster.write_state()
    except (ClusterError, AdminError) as exc:
        await cluster.close()
        return fail(f"cluster did not come up: {exc}", EXIT_FAILED)
    except BaseException:
        # Ctrl-C (the task is cancelled) or anything unforeseen before the state file exists: `cluster down`
        # could not find these brokers, so none may outlive this command.
        cluster.abort()
        raise
    (state_dir / STOPPED_FILE).unlink(missing_ok=True)  # running now: its state is the state file
    if stopped is not None:
        moved = [bp.node_id for bp in cluster.nodes if bp.listen != stopped.nodes[bp.index].listen]
        print(f"started the cluster stopped in {state_dir} again: same brokers, coordinates and data directories")
        if moved:
            print(f"  new addresses for {', '.join(moved)}: the old ones were taken by another program")
    print(f"{n} brokers up, Delaunay overlay converged in {took:.2f} s")
    for bp in cluster.nodes:
        print(f"  {bp.node_id:<6} pid {bp.pid:<8} {bp.listen:<22} ({bp.coord[0]:.4f}, {bp.coord[1]:.4f})")
    first = cluster.nodes[0].listen
    brokers = ",".join(bp.listen for bp in cluster.nodes)
    if creds.insecure:
        print("plain TCP (--insecure); the brokers' addresses for clients and tools:")
        print(f"  export SEDAX_BROKERS={brokers} SEDAX_INSECURE=1")
    else:
        print(f"TLS with a development CA in {cluster.certs_dir}; addresses and credentials for clients and tools:")
        print(f"  export SEDAX_BROKERS={brokers} SEDAX_CA={creds.ca} SEDAX_CERT={creds.cert} SEDAX_KEY={creds.key}")
    print(f"try:  sedax status --broker {first}     sedax route 0.5,0.5 --broker {first}")
    print(f"stop: sedax cluster down --state-dir {state_dir}   (state: {path})")
    cluster.detach()
    return 0


async def _cluster_restart(args: argparse.Namespace) -> int:
    """A rolling restart: each broker in turn stopped (SIGTERM: a graceful leave) and started again at its
    address with its data, the next only once the overlay is whole and every topic's copies caught up."""
    from cli.cluster import ClusterError, LocalCluster, StateFileError

    state_dir = Path(args.state_dir)
    try:
        cluster = LocalCluster.from_state(state_dir)
    except StateFileError as exc:
        return fail(str(exc), EXIT_FAILED)
    loop = asyncio.get_running_loop()
    n = len(cluster.nodes)

    async def settled(what: str) -> None:
        await cluster.wait_converged(args.timeout)
        deadline = loop.time() + args.timeout
        told = loop.time()
        while lagging := await cluster.lagging():
            shown = ", ".join(lagging[:5]) + (f" and {len(lagging) - 5} more" if len(lagging) > 5 else "")
            if loop.time() > deadline:
                raise ClusterError(f"{what}: topics not caught up within {args.timeout:g} s: {shown}")
            if loop.time() - told > PROGRESS_EVERY:
                told = loop.time()
                print(f"  {what}: waiting for {len(lagging)} topic(s) to catch up: {shown}", file=sys.stderr)
            await asyncio.sleep(0.2)

    try:
        if any(bp.alive for bp in cluster.nodes):
            await settled("before the first restart")
        for bp in list(cluster.nodes):
            start = loop.time()
            was = f"pid {bp.pid}" if bp.alive else "not running"
            if bp.alive:
                await cluster.stop(bp.index, args.grace)
            new = await cluster.restart(bp.index)
            cluster.write_state()  # (`cluster down` finds the new process even if this command is SIGKILLed)
            await settled(f"after restarting {bp.node_id}")
            print(
                f"{bp.node_id}: restarted at {new.listen} ({was} -> pid {new.pid}); overlay whole and every topic "
                f"caught up after {loop.time() - start:.1f} s",
                flush=True,
            )
    except (ClusterError, AdminError) as exc:
        return fail(f"rolling restart stopped: {exc}", EXIT_FAILED)
    finally:
        cluster.write_state()  # every broker this command started is in it, whatever ended it (Ctrl-C too)
        cluster.detach()
    print(f"rolling restart done: {n} brokers, one at a time")
    return 0


def _cmd_cluster(args: argparse.Namespace) -> int:
    if args.action == "up":
        return asyncio.run(_cluster_up(args))
    if args.action == "restart":
        return asyncio.run(_cluster_restart(args))
    from cli.cluster import STATE_FILE, STOPPED_FILE, StateFileError, read_state, stop_pids

    state_dir = Path(args.state_dir)
    path = state_dir / STATE_FILE
    try:
        pids = [n.pid for n in read_state(path).nodes if n.pid is not None]
    except FileNotFoundError:
        return fail(
            f"no readable cluster state at {path}: no cluster was started with this --state-dir "
            "(give the --state-dir `sedax cluster up` printed)",
            EXIT_FAILED,
        )
    except StateFileError as exc:
        return fail(str(exc), EXIT_FAILED)
    result = stop_pids(pids, grace=args.grace)
    for pid, what in result.items():
        print(f"pid {pid}: {what}")
    path.replace(state_dir / STOPPED_FILE)
    print(f"start them again, with their data and addresses: sedax cluster up --state-dir {state_dir}")
    return 0


# -------------------------------------------------------------------------------------------- registration


def register(subparsers: Any) -> None:
    """Add the broker, status, route and cluster subcommands to an argparse subparsers object."""
    from broker.flags import add_broker_arguments

    p = subparsers.add_parser("broker", help="run one broker process", description="Run one SeDAX broker.")
    add_broker_arguments(p)
    p.set_defaults(func=_cmd_broker)

    p = subparsers.add_parser(
        "status", help="show a broker's version, uptime, coordinate, neighbours, topics and loads"
    )
    add_broker_flag(p, what="broker to ask (the first that answers)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--timeout", type=seconds, default=5.0, help="seconds (default 5)")
    p.set_defaults(func=_cmd_status)

    p = subparsers.add_parser("route", help="probe the overlay route to the broker closest to X,Y")
    p.add_argument("coord", metavar="X,Y", type=coordinate, help="target coordinate")
    add_broker_flag(p, what="broker the probe starts from (the first that answers)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--timeout", type=seconds, default=5.0, help="seconds (default 5)")
    p.set_defaults(func=_cmd_route)

    p = subparsers.add_parser("cluster", help="start or stop a local cluster of broker processes")
    p.add_argument(
        "action",
        choices=("up", "down", "restart"),
        help="up: start brokers and wait for the overlay; down: stop them; restart: a rolling restart, one broker "
        "at a time, the next once the overlay is whole and every topic caught up",
    )
    p.add_argument(
        "--nodes",
        type=positive_int,
        help="number of brokers (up; without --nodes and --coords, up starts the cluster stopped in --state-dir again)",
    )
    p.add_argument("--seed", type=int, default=0, help="seed of the random coordinates (up)")
    p.add_argument(
        "--resilience",
        type=int,
        choices=(1, 2, 3),
        help=f"resilience level (up; default {defaults.RESILIENCE}, or the stopped cluster's)",
    )
    p.add_argument("--coords", help="file of X,Y lines or a JSON list of pairs (up)")
    p.add_argument(
        "--state-dir",
        dest="state_dir",
        default=DEFAULT_STATE_DIR,
        help="logs, state file, certificates and every broker's data directory (data/n<i>)",
    )
    p.add_argument(
        "--timeout", type=seconds, default=60.0, help="seconds to wait for convergence (up; restart: per step)"
    )
    p.add_argument("--grace", type=seconds, default=5.0, help="seconds between SIGTERM and SIGKILL (down, restart)")
    p.add_argument(
        "--broker-args",
        dest="broker_args",
        metavar="FLAGS",
        help='flags for every broker, e.g. "--balance combined"',
    )
    p.add_argument(
        "--insecure",
        action="store_true",
        help="plain TCP (up; default: TLS with a development CA in STATE_DIR/certs, or as $SEDAX_INSECURE says)",
    )
    p.set_defaults(func=_cmd_cluster)
