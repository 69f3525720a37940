"""What TLS costs SeDAX: 1 publisher -> 1 subscriber through one broker, TLS against plain TCP, same run.

    .venv/bin/python benchmarks/bench_tls.py --out docs/benchmarks-tls.md     # ~2 min
    .venv/bin/python benchmarks/bench_tls.py --quick                          # ~30 s, prints only

One broker process (resilience 1, so the publish path is the broker alone), a subscriber and a publisher,
each its own process (the `sedax` Client under uvloop), the subscriber and the publisher attached to the
broker.  The broker is started twice, with TLS (a development CA, client certificates: the secure default)
and with --insecure; the configurations alternate run by run so both see the same machine load.

* msg/s: messages / (last delivery at the subscriber - first measured publish), after a warm-up;
  timestamps from CLOCK_MONOTONIC, shared by the processes.  Best and median of the runs.
* broker CPU per message: user+system CPU of the broker process over the measured phase (/proc), median.
* connection set-up: TCP connect (+ TLS handshake) + HELLO/HELLO_OK, sequential, median over 200.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(_ROOT))
sys.path.insert(0, str(_ROOT / "benchmarks"))

from harness import cpu_seconds, spawn_worker  # noqa: E402 - after the path set-up above

PAYLOAD = 100
WARMUP = 1000
TOPIC = "grid/bench/voltage"
RESULTS_MARK = "## Results"


# ------------------------------------------------------------------------------------------------ workers


def _creds(spec: dict[str, Any]) -> Any:
    from net.credentials import Credentials

    return Credentials(**spec["credentials"])


async def sub_worker(spec: dict[str, Any]) -> dict[str, Any]:
    from client.client import Client

    n = spec["count"] + WARMUP
    async with Client([spec["addr"]], credentials=_creds(spec), client_id="bench-sub") as c:
        sub = await c.subscribe(TOPIC)
        print(json.dumps({"event": "ready"}), flush=True)
        got = 0
        first = last = 0.0
        async for _ in sub:
            got += 1
            if got == WARMUP + 1:
                first = time.monotonic()
            if got == n:
                last = time.monotonic()
                break
        return {"received": got, "first_rx": first, "last_rx": last, "dropped": sub.dropped}


async def pub_worker(spec: dict[str, Any]) -> dict[str, Any]:
    from client.client import Client

    payload = b"v" * PAYLOAD
    async with Client([spec["addr"]], credentials=_creds(spec), client_id="bench-pub") as c:
        for _ in range(WARMUP):
            await c.publish_nowait(TOPIC, payload)
        async with asyncio.timeout(60):
            await c.flush()
        start = time.monotonic()
        for _ in range(spec["count"]):
            await c.publish_nowait(TOPIC, payload)
        async with asyncio.timeout(300):
            await c.flush()
        return {"start": start, "acked": time.monotonic()}


async def connect_worker(spec: dict[str, Any]) -> dict[str, Any]:
    from client.admin import AdminClient

    creds = _creds(spec)
    times = []
    for _ in range(spec["count"]):
        t0 = time.monotonic()
        c = await AdminClient.connect(spec["addr"], credentials=creds)
        times.append(time.monotonic() - t0)
        await c.aclose()
    return {"median_ms": 1000 * statistics.median(times), "p90_ms": 1000 * sorted(times)[int(0.9 * len(times))]}


def worker_main(raw: str) -> int:
    import uvloop

    spec = json.loads(raw)
    fn = {"sub": sub_worker, "pub": pub_worker, "connect": connect_worker}[spec["role"]]
    print(json.dumps(uvloop.run(fn(spec))), flush=True)
    return 0


# ------------------------------------------------------------------------------------------------- driver


async def spawn(spec: dict[str, Any]) -> asyncio.subprocess.Process:
    return await spawn_worker(__file__, spec)


def last_json(out: bytes) -> dict[str, Any]:
    result: dict[str, Any] = json.loads(out.decode().strip().splitlines()[-1])
    return result


@dataclass
class Mode:
    name: str
    tls: bool
    rates: list[float] = field(default_factory=list)
    cpu_us: list[float] = field(default_factory=list)
    connect_ms: float = 0.0
    connect_p90_ms: float = 0.0


async def run_once(mode: Mode, count: int, workdir: Path) -> None:
    from cli.cluster import LocalCluster

    state = workdir / f"{mode.name}-{len(mode.rates)}"
    async with LocalCluster(1, coords=[(0.5, 0.5)], resilience=1, tls=mode.tls, state_dir=state) as cluster:
        bp = cluster.nodes[0]

        def creds(name: str) -> dict[str, Any]:
            c = cluster.credentials(name)
            return {"ca": c.ca, "cert": c.cert, "key": c.key, "insecure": c.insecure}

        base = {"addr": bp.listen, "count": count}
        sub = await spawn(dict(base, role="sub", credentials=creds("bench-sub")))
        assert sub.stdout is not None
        async with asyncio.timeout(60):
            ready = await sub.stdout.readline()
        if b"ready" not in ready:
            raise RuntimeError(f"subscriber not ready: {ready!r}")
        cpu0 = cpu_seconds(bp.pid)
        pub = await spawn(dict(base, role="pub", credentials=creds("bench-pub")))
        (pout, _), (sout, _) = await asyncio.gather(pub.communicate(), sub.communicate())
        cpu1 = cpu_seconds(bp.pid)
        p, s = last_json(pout), last_json(sout)
        if s["received"] != count + WARMUP:
            raise RuntimeError(f"{mode.name}: {s['received']} of {count + WARMUP} delivered")
        mode.rates.append(count / (s["last_rx"] - p["start"]))
        mode.cpu_us.append(1e6 * (cpu1 - cpu0) / (count + WARMUP))
        if not mode.connect_ms:
            conn = await spawn(dict(base, role="connect", count=200, credentials=creds("bench-connect")))
            out, _ = await conn.communicate()
            c = last_json(out)
            mode.connect_ms, mode.connect_p90_ms = c["median_ms"], c["p90_ms"]


def report(modes: list[Mode], count: int, runs: int, load: tuple[float, float]) -> str:
    plain, tls = modes
    rows = [
        "| transport | msg/s best | msg/s median | broker CPU µs/msg (median) | connection set-up median (p90) |",
        "|---|---:|---:|---:|---:|",
    ]
    for m in modes:
        rows.append(
            f"| {m.name} | {max(m.rates):,.0f} | {statistics.median(m.rates):,.0f} | "
            f"{statistics.median(m.cpu_us):.1f} | {m.connect_ms:.2f} ms ({m.connect_p90_ms:.2f}) |"
        )
    ratio_best = max(tls.rates) / max(plain.rates)
    ratio_med = statistics.median(tls.rates) / statistics.median(plain.rates)
    cpu_ratio = statistics.median(tls.cpu_us) / statistics.median(plain.cpu_us)
    uname = subprocess.run(["uname", "-srm"], capture_output=True, text=True, check=False).stdout.strip()
    return "\n".join(
        [
            f"{count:,} messages of {PAYLOAD} B per run after {WARMUP:,} warm-up, {runs} runs per transport "
            f"(alternating), load average {load[0]:.1f} before and {load[1]:.1f} after; {os.cpu_count()} CPUs, "
            f"{uname}, Python {sys.version.split()[0]}.",
            "",
            *rows,
            "",
            f"**TLS / plain throughput: {ratio_best:.2f}× (best), {ratio_med:.2f}× (median); broker CPU per message "
            f"{cpu_ratio:.2f}×; connection set-up {tls.connect_ms / plain.connect_ms:.1f}× "
            f"(+{tls.connect_ms - plain.connect_ms:.2f} ms).**",
        ]
    )


async def main_async(args: argparse.Namespace) -> int:
    count = args.messages or (10_000 if args.quick else 50_000)
    runs = args.repeat or (1 if args.quick else 3)
    workdir = Path(f"/tmp/sedax-bench-tls-{os.getpid()}")
    modes = [Mode("plain TCP (--insecure)", False), Mode("TLS (mutual for brokers, client certificates)", True)]
    load0 = os.getloadavg()[0]
    for i in range(runs):
        for m in modes if i % 2 == 0 else modes[::-1]:
            await run_once(m, count, workdir)
            print(f"{m.name}: {m.rates[-1]:,.0f} msg/s, broker {m.cpu_us[-1]:.1f} µs/msg", flush=True)
    text = report(modes, count, runs, (load0, os.getloadavg()[0]))
    print(text)
    if args.out:
        write_results(Path(args.out), text)
    return 0


def write_results(path: Path, text: str) -> None:
    """Replace what follows the results heading of the markdown file (or start one)."""
    head = path.read_text().split(RESULTS_MARK)[0] if path.exists() else ""
    stamp = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    path.write_text(f"{head}{RESULTS_MARK} ({stamp})\n\n{text}\n")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="10,000 messages, 1 run per transport")
    p.add_argument("--messages", type=int, help="messages per run (default 50,000)")
    p.add_argument("--repeat", type=int, help="runs per transport (default 3)")
    p.add_argument("--out", help="write the results below the '## Results' heading of this markdown file")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        return worker_main(args.worker)
    return asyncio.run(main_async(args))


if __name__ == "__main__":
    sys.exit(main())
