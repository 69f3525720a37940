"""Broker memory under connection churn (not a test): waves of concurrent clients that connect and leave.

    .venv/bin/python benchmarks/bench_churn.py [--waves 12] [--clients 400] [--plain]

One broker process (TLS as users run it, or plain TCP with --plain); each wave opens --clients connections at
once, completes the TLS handshake and HELLO on each, then closes them all.  After every wave the broker's RSS
(/proc/PID/status VmRSS) is read once the broker has closed every link (its STATUS shows no client left) and
idled for --idle seconds.
Prints one line per wave and a JSON summary; docs/benchmarks.md ("Connection churn") has the figures.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import time
from pathlib import Path

_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(_ROOT))

from cli.cluster import LocalCluster  # noqa: E402
from client.admin import AdminClient, AdminError  # noqa: E402
from net.credentials import Credentials  # noqa: E402


def rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise RuntimeError(f"no VmRSS for pid {pid}")


async def one(addr: str, creds: Credentials) -> bool:
    try:
        c = await AdminClient.connect(addr, timeout=20.0, role="client", credentials=creds)
    except (AdminError, OSError, TimeoutError):
        return False
    await c.aclose()
    return True


async def run(args: argparse.Namespace) -> dict[str, object]:
    state = Path(tempfile.mkdtemp(prefix="bench-churn-"))
    cluster = LocalCluster(1, coords=[(0.5, 0.5)], state_dir=state, tls=not args.plain)
    async with cluster:
        bp = cluster.nodes[0]
        creds = cluster.credentials("churn")
        admin = cluster.credentials("admin")
        rows = []
        start = rss_kib(bp.pid)
        print(f"start: RSS {start / 1024:.1f} MiB ({'plain TCP' if args.plain else 'TLS'})")
        for w in range(args.waves):
            t = time.monotonic()
            ok = sum(await asyncio.gather(*(one(bp.listen, creds) for _ in range(args.clients))))
            # Wait until the broker has let go of every client link (one STATUS asks through a link of its own).
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline:
                async with await AdminClient.connect(bp.listen, timeout=10.0, credentials=admin) as c:
                    st = await c.status()
                if st.counters.get("links", 0) <= 1:
                    break
                await asyncio.sleep(0.2)
            await asyncio.sleep(args.idle)  # the broker idles a moment, as between bursts in real life
            rss = rss_kib(bp.pid)
            rows.append({"wave": w + 1, "ok": ok, "rss_kib": rss, "seconds": round(time.monotonic() - t, 2)})
            print(f"wave {w + 1:2d}: {ok}/{args.clients} handshakes, RSS {rss / 1024:.1f} MiB")
    growth = (rows[-1]["rss_kib"] - rows[min(2, len(rows) - 1)]["rss_kib"]) / 1024  # type: ignore[operator]
    return {"tls": not args.plain, "clients": args.clients, "start_kib": start, "waves": rows,
            "growth_after_warmup_mib": round(growth, 1)}  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--waves", type=int, default=12)
    ap.add_argument("--clients", type=int, default=400)
    ap.add_argument("--plain", action="store_true", help="plain TCP instead of TLS")
    ap.add_argument("--idle", type=float, default=1.5, help="seconds the broker idles before RSS is read")
    args = ap.parse_args()
    print(json.dumps(asyncio.run(run(args))))


if __name__ == "__main__":
    main()
