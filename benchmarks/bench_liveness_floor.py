"""The floor of an idle broker's liveness cost on this machine (not a test; docs/benchmarks-scale.md).

    .venv/bin/python benchmarks/bench_liveness_floor.py tcp 30      # minimal asyncio Protocol over TCP
    .venv/bin/python benchmarks/bench_liveness_floor.py udp 30      # UDP beacons read at the beat, HMAC'd
    .venv/bin/python benchmarks/bench_liveness_floor.py idle 30     # the beat's timer alone
    UNALIGNED=1 .venv/bin/python benchmarks/bench_liveness_floor.py tcp 30

N processes (uvloop), each linked to the K=3 next ones on a ring (6 links each, as a broker at 100 has), send
one 13-byte frame on every link every 0.2 s, the beats on the wall clock's multiples of 0.2 s (UNALIGNED=1:
each from its own start).  Nothing else runs: no TLS, no decoding, no broker.  Printed: CPU per process in ms
per second (sum_exec_runtime from /proc/PID/schedstat over 20 s) and wake-ups per process per second
(voluntary + involuntary context switches).  What a broker cannot get below with one frame each way per link
per 0.2 s.
"""

from __future__ import annotations

import argparse
import asyncio
import hmac
import math
import os
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import cast

import uvloop

PERIOD = 0.2
K = 3  # links to i+1..i+K: degree 2K
FRAME = b"\x00\x00\x00\x08\x0112345678"
KEY = b"k" * 32


def cpu(pid: int) -> float:
    return int(Path(f"/proc/{pid}/schedstat").read_text().split()[0]) / 1e9


def switches(pid: int) -> int:
    lines = Path(f"/proc/{pid}/status").read_text().splitlines()
    return sum(int(line.split(":")[1]) for line in lines if "ctxt_switches" in line)


def next_beat(now: float, wall: float) -> float:
    if os.environ.get("UNALIGNED"):
        return now + PERIOD
    return (math.floor((now + wall) / PERIOD) + 1) * PERIOD - wall


class Counting(asyncio.Protocol):
    def __init__(self, links: list[asyncio.Transport]) -> None:
        self.links = links

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # (uvloop's TCPTransport is not an asyncio.Transport subclass: an isinstance check here failed, and the
        # tcp mode then beat on no links at all)
        self.links.append(cast(asyncio.Transport, transport))

    def data_received(self, data: bytes) -> None:
        pass


async def child(mode: str, i: int, ports: list[int]) -> None:
    n = len(ports)
    loop = asyncio.get_running_loop()
    wall = time.time() - loop.time()
    links: list[asyncio.Transport] = []
    if mode == "tcp":
        await loop.create_server(lambda: Counting(links), "127.0.0.1", ports[i])
        await asyncio.sleep(1.0)
        for j in range(1, K + 1):
            await loop.create_connection(lambda: Counting(links), "127.0.0.1", ports[(i + j) % n])
        await asyncio.sleep(1.0)
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    if mode == "udp":
        sock.bind(("127.0.0.1", ports[i]))
        sock.setblocking(False)
    peers = [("127.0.0.1", ports[(i + j) % n]) for j in [*range(1, K + 1), *range(-K, 0)]]
    while True:
        await asyncio.sleep(next_beat(loop.time(), wall) - loop.time())
        if mode == "tcp":
            for t in links:
                t.write(FRAME)
        elif mode == "udp":
            for p in peers:
                sock.sendto(FRAME + hmac.digest(KEY, FRAME, "sha256")[:16], p)
            while True:
                try:
                    data, _ = sock.recvfrom(2048)
                except BlockingIOError:
                    break
                hmac.compare_digest(hmac.digest(KEY, data[:-16], "sha256")[:16], data[-16:])


def free_ports(n: int, kind: socket.SocketKind) -> list[int]:
    """n ports the OS hands out now on 127.0.0.1 (held open together, so all differ), for the children to bind."""
    socks = [socket.socket(socket.AF_INET, kind) for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def main() -> int:
    if sys.argv[1:2] == ["child"]:  # (how the processes below are started)
        uvloop.run(child(sys.argv[2], int(sys.argv[3]), [int(p) for p in sys.argv[4].split(",")]))
        return 0
    parser = argparse.ArgumentParser(
        description="The floor of an idle broker's liveness cost (not a test; docs/benchmarks-scale.md).",
        epilog="UNALIGNED=1 in the environment: each process beats from its own start, not on the wall clock's "
        "multiples of 0.2 s.",
    )
    parser.add_argument("mode", choices=("tcp", "udp", "idle"), help="what each process does at every beat")
    parser.add_argument("n", type=int, help="processes on the ring (at least K + 1 = 4)")
    args = parser.parse_args()
    if args.n <= K:
        parser.error(f"n must be at least {K + 1}: each process links to the {K} next ones on the ring")
    mode, n = args.mode, args.n
    ports = ",".join(str(p) for p in free_ports(n, socket.SOCK_DGRAM if mode == "udp" else socket.SOCK_STREAM))
    procs = [subprocess.Popen([sys.executable, __file__, "child", mode, str(i), ports]) for i in range(n)]
    try:
        time.sleep(5)
        c0, x0, t0 = [cpu(p.pid) for p in procs], [switches(p.pid) for p in procs], time.monotonic()
        time.sleep(20)
        dt = time.monotonic() - t0
        c1, x1 = [cpu(p.pid) for p in procs], [switches(p.pid) for p in procs]
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            p.wait()
    per = [(b - a) / dt * 1e3 for a, b in zip(c0, c1, strict=True)]
    woke = sum(b - a for a, b in zip(x0, x1, strict=True)) / dt / n
    aligned = "unaligned" if os.environ.get("UNALIGNED") else "aligned"
    print(f"{mode} ({aligned}) n={n} degree={2 * K} period={PERIOD}: CPU ms/s mean {sum(per) / n:.3f} "
          f"max {max(per):.3f}; wake-ups/s {woke:.1f}")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
