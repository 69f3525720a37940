"""Overlay subcommands of the `sedax` CLI: broker, status, route, cluster.

`cli/main.py` calls `register(subparsers)`; each subcommand sets `func(args) -> int` (the exit code).
Exit code 2 means a usage problem the message explains (bad coordinate, unreachable broker).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import shlex
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Final

from client.admin import AdminClient, AdminError, RequestFailed, route_json, status_json
from net.credentials import Credentials, CredentialsError, add_credential_flags, credentials_from_args

EXIT_USAGE: Final = 2
DEFAULT_STATE_DIR: Final = ".sedax-cluster"


def _fail(msg: str) -> int:
    print(f"sedax: error: {msg}", file=sys.stderr)
    return EXIT_USAGE


def _parse_xy(text: str) -> tuple[float, float]:
    # Kept free of overlay.geometry (and so of scipy): the broker checks the coordinate against its space.
    parts = text.split(",")
    if len(parts) != 2:
        raise ValueError(f"coordinate must be written X,Y, got {text!r}")
    try:
        x, y = float(parts[0]), float(parts[1])
    except ValueError:
        raise ValueError(f"coordinate must be two numbers X,Y, got {text!r}") from None
    if not (math.isfinite(x) and math.isfinite(y)):
        raise ValueError(f"coordinate must be finite, got {text!r}")
    return (x, y)


# ------------------------------------------------------------------------------------------------ broker


def _cmd_broker(args: argparse.Namespace) -> int:
    from broker.config import ConfigError, config_from_args
    from broker.main import run

    try:
        config = config_from_args(args)
    except ConfigError as exc:
        return _fail(str(exc))
    return run(config)


# ------------------------------------------------------------------------------------------------ status


async def _status(addr: str, limit: float, creds: Credentials) -> dict[str, Any]:
    async with await AdminClient.connect(addr, timeout=limit, credentials=creds) as c:
        return status_json(await c.status())


def _cmd_status(args: argparse.Namespace) -> int:
    try:
        st = asyncio.run(_status(args.broker, args.timeout, credentials_from_args(args)))
    except (AdminError, CredentialsError) as exc:
        return _fail(str(exc))
    if args.json:
        print(json.dumps(st))
        return 0
    print(f"broker {st['node']} at {st['listen']}  coord ({st['coord'][0]:.6f}, {st['coord'][1]:.6f})")
    print(f"neighbours ({len(st['neighbours'])}):")
    for n in st["neighbours"]:
        print(f"  {n['id']:<16} ({n['coord'][0]:.6f}, {n['coord'][1]:.6f})  {n['listen']}")
    print(f"topics: {len(st['topics'])}  loads: {st['loads']}")
    return 0


# ------------------------------------------------------------------------------------------------- route


async def _route(addr: str, target: tuple[float, float], limit: float, creds: Credentials) -> dict[str, Any]:
    async with await AdminClient.connect(addr, timeout=limit, credentials=creds) as c:
        return route_json(await c.route(target))


def _cmd_route(args: argparse.Namespace) -> int:
    try:
        target = _parse_xy(args.coord)
        creds = credentials_from_args(args)
    except ValueError as exc:
        return _fail(str(exc))
    try:
        r = asyncio.run(_route(args.broker, target, args.timeout, creds))
    except RequestFailed as exc:
        return _fail(f"broker refused the probe: {exc}")
    except AdminError as exc:
        return _fail(str(exc))
    if args.json:
        print(json.dumps(r))
        return 0
    node = r["node"]
    print(f"({target[0]}, {target[1]}) -> {node['id']} at {node['listen']} in {r['hops']} hops")
    print("path: " + " -> ".join(p["id"] for p in r["path"]))
    return 0


# ----------------------------------------------------------------------------------------------- cluster


def _read_coords(path: str) -> list[tuple[float, float]]:
    text = Path(path).read_text()
    if text.lstrip().startswith("["):
        return [(float(c[0]), float(c[1])) for c in json.loads(text)]
    return [_parse_xy(line.strip()) for line in text.splitlines() if line.strip() and not line.startswith("#")]


async def _cluster_up(args: argparse.Namespace) -> int:
    from cli.cluster import ClusterError, LocalCluster
    from net.certs import CertError

    coords = _read_coords(args.coords) if args.coords else None
    n = args.nodes if args.nodes is not None else (len(coords) if coords else 0)
    if n < 1:
        return _fail("give --nodes N (>= 1) or --coords FILE")
    state_dir = Path(args.state_dir)
    if (state_dir / "cluster.json").exists():
        return _fail(f"{state_dir}/cluster.json exists: run `sedax cluster down --state-dir {state_dir}` first")
    extra = shlex.split(args.broker_args) if args.broker_args else []
    try:
        cluster = LocalCluster(
            n,
            seed=args.seed,
            coords=coords,
            resilience=args.resilience,
            state_dir=state_dir,
            broker_args=tuple(extra),
            tls=False if args.insecure else None,
            detached=True,
        )
        creds = cluster.credentials("client")
    except CertError as exc:
        return _fail(f"cannot create the cluster's certificates: {exc}")
    try:
        await cluster.start()
        took = await cluster.wait_converged(args.timeout)
    except (ClusterError, AdminError) as exc:
        await cluster.close()
        return _fail(f"cluster did not come up: {exc}")
    path = cluster.write_state()
    print(f"{n} brokers up, Delaunay overlay converged in {took:.2f} s")
    for bp in cluster.nodes:
        print(f"  {bp.node_id:<6} pid {bp.pid:<8} {bp.listen:<22} ({bp.coord[0]:.4f}, {bp.coord[1]:.4f})")
    first = cluster.nodes[0].listen
    if creds.insecure:
        print("plain TCP (--insecure): clients and tools need --insecure (or SEDAX_INSECURE=1)")
    else:
        print(f"TLS with a development CA in {cluster.certs_dir}; credentials for clients and tools:")
        print(f"  export SEDAX_CA={creds.ca} SEDAX_CERT={creds.cert} SEDAX_KEY={creds.key}")
    print(f"try:  sedax status --broker {first}     sedax route 0.5,0.5 --broker {first}")
    print(f"stop: sedax cluster down --state-dir {state_dir}   (state: {path})")
    cluster.detach()
    return 0


def _cmd_cluster(args: argparse.Namespace) -> int:
    if args.action == "up":
        return asyncio.run(_cluster_up(args))
    from cli.cluster import STATE_FILE, stop_pids

    path = Path(args.state_dir) / STATE_FILE
    try:
        state = json.loads(path.read_text())
        pids = [int(n["pid"]) for n in state["nodes"]]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        return _fail(f"no readable cluster state at {path}: {exc}")
    result = stop_pids(pids, grace=args.grace)
    for pid, what in result.items():
        print(f"pid {pid}: {what}")
    path.unlink()
    return 0


# -------------------------------------------------------------------------------------------- registration


def register(subparsers: Any) -> None:
    """Add the broker, status, route and cluster subcommands to an argparse subparsers object."""
    from broker.flags import add_broker_arguments

    p = subparsers.add_parser("broker", help="run one broker process", description="Run one SeDAX broker.")
    add_broker_arguments(p)
    p.set_defaults(func=_cmd_broker)

    p = subparsers.add_parser("status", help="show a broker's coordinate, neighbours, topics and loads")
    p.add_argument("--broker", required=True, metavar="HOST:PORT", help="broker to ask")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--timeout", type=float, default=5.0, help="seconds (default 5)")
    add_credential_flags(p)
    p.set_defaults(func=_cmd_status)

    p = subparsers.add_parser("route", help="probe the overlay route to the broker closest to X,Y")
    p.add_argument("coord", metavar="X,Y", help="target coordinate")
    p.add_argument("--broker", required=True, metavar="HOST:PORT", help="broker the probe starts from")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--timeout", type=float, default=5.0, help="seconds (default 5)")
    add_credential_flags(p)
    p.set_defaults(func=_cmd_route)

    p = subparsers.add_parser("cluster", help="start or stop a local cluster of broker processes")
    p.add_argument("action", choices=("up", "down"))
    p.add_argument("--nodes", type=int, help="number of brokers (up)")
    p.add_argument("--seed", type=int, default=0, help="seed of the random coordinates (up)")
    p.add_argument("--resilience", type=int, choices=(1, 2, 3), default=2, help="resilience level (up)")
    p.add_argument("--coords", help="file of X,Y lines or a JSON list of pairs (up)")
    p.add_argument("--state-dir", dest="state_dir", default=DEFAULT_STATE_DIR, help="logs and state file")
    p.add_argument("--timeout", type=float, default=60.0, help="seconds to wait for convergence (up)")
    p.add_argument("--grace", type=float, default=5.0, help="seconds between SIGTERM and SIGKILL (down)")
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


def main(argv: Sequence[str] | None = None) -> int:
    """Stand-alone entry point (`python -m cli.overlay ...`) until `sedax` wires these in."""
    parser = argparse.ArgumentParser(prog="sedax")
    sub = parser.add_subparsers(dest="command", required=True)
    register(sub)
    args = parser.parse_args(argv)
    code: int = args.func(args)
    return code


if __name__ == "__main__":
    sys.exit(main())
