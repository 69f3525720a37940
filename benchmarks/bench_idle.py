"""What an idle cluster costs (not a test): CPU time and RSS per broker with no traffic, and time to start.

    .venv/bin/python benchmarks/bench_idle.py                          # N = 10, 50, 100; 30 s idle window
    .venv/bin/python benchmarks/bench_idle.py --nodes 10 --window 20 --json
    .venv/bin/python benchmarks/bench_idle.py --nodes 10 --broker-args "--heartbeat-interval 0.5"

For each N a fresh `LocalCluster` is started as `sedax cluster up` starts one (TLS with a development CA,
resilience 2, a data directory per broker, default settings otherwise), the overlay is waited for until its
links are exactly the Delaunay triangulation, the cluster is left alone for a few seconds to settle (the last
joins' re-ranking, the first load reports), and then every broker's CPU time (utime + stime from
/proc/PID/stat) is read at the start and the end of an idle window; RSS (VmRSS of /proc/PID/status) at its
end.  Nothing talks to the brokers during the window.  Printed per N: time to start (processes ready) and to
converge, CPU per broker in ms per second (mean and the busiest broker), RSS per broker in MiB (mean, max),
the cores the whole cluster uses, and how busy the rest of the machine was meanwhile (other work on the same
cores inflates everything: the figure is in the table so a reader can tell).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(_ROOT))

from harness import cpu_seconds  # noqa: E402

from cli.cluster import LocalCluster  # noqa: E402

SETTLE = 5.0  # seconds between convergence and the window (late re-ranking, first reports)


def memory_mib(pid: int) -> tuple[float, float, float]:
    """(RSS, PSS, private) in MiB of a process (zeros if it is gone).

    RSS counts the shared libraries' pages in every process that maps them; PSS shares them out among those
    processes; private (dirty + clean) is what this process alone holds: what one more broker costs.
    """
    out = {"Rss:": 0.0, "Pss:": 0.0, "Private_Clean:": 0.0, "Private_Dirty:": 0.0}
    try:
        for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
            key = line.split(maxsplit=1)[0] if line else ""
            if key in out:
                out[key] = int(line.split()[1]) / 1024
    except OSError:
        pass
    return out["Rss:"], out["Pss:"], out["Private_Clean:"] + out["Private_Dirty:"]


def machine_busy() -> tuple[float, float]:
    """(busy, total) jiffies of all cores since boot (/proc/stat)."""
    parts = [int(v) for v in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
    idle = parts[3] + parts[4]  # idle + iowait
    return float(sum(parts) - idle), float(sum(parts))


def spawn_profiled(cluster: LocalCluster, out: Path, delay: float, seconds: float) -> subprocess.Popen[bytes]:
    """One more broker, joining the cluster, under benchmarks/profile_broker.py (cProfile over a window)."""
    assert cluster.state_dir is not None
    index = len(cluster.nodes)
    x, y = (float(v) for v in cluster.space.uniform(cluster._rng, 1)[0])
    node_id = f"n{index}"
    args = [sys.executable, str(_ROOT / "benchmarks" / "profile_broker.py"), str(out), str(delay), str(seconds), "--"]
    args += ["--coord", f"{x!r},{y!r}", "--node-id", node_id, "--listen", "127.0.0.1:0"]
    args += ["--resilience", str(cluster.resilience), *cluster.tls_args(node_id)]
    args += ["--data-dir", str(cluster.data_dir(index)), *cluster.broker_args]
    for bp in cluster.nodes[:3]:
        args += ["--join", bp.listen]
    env = dict(os.environ, PYTHONPATH=str(_ROOT))
    err = (cluster.state_dir / "profiled.err").open("wb")
    return subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=err, env=env, start_new_session=True)


async def measure(
    n: int,
    window: float,
    broker_args: list[str],
    seed: int,
    workdir: Path,
    profile: Path | None = None,
    tls: bool = True,
) -> dict[str, Any]:
    t0 = time.monotonic()
    # As `sedax cluster up` starts one: TLS, resilience 2, a data directory per broker.
    cluster = LocalCluster(
        n, seed=seed, resilience=2, state_dir=workdir / f"n{n}", broker_args=broker_args, data_dirs=True, tls=tls
    )
    profiled: subprocess.Popen[bytes] | None = None
    try:
        await cluster.start()
        started = time.monotonic() - t0
        await cluster.wait_converged(120.0 + n)
        converged = time.monotonic() - t0
        if profile is not None:
            profiled = spawn_profiled(cluster, profile, SETTLE + 10.0, window - 3.0)
            await asyncio.sleep(10.0)  # its start and join, before the cluster settles
        await asyncio.sleep(SETTLE)
        pids = [bp.pid for bp in cluster.nodes]
        cpu0 = [cpu_seconds(p) for p in pids]
        busy0, total0 = machine_busy()
        w0 = time.monotonic()
        await asyncio.sleep(window)
        elapsed = time.monotonic() - w0
        cpu1 = [cpu_seconds(p) for p in pids]
        busy1, total1 = machine_busy()
        mem = [memory_mib(p) for p in pids]
        alive = sum(1 for bp in cluster.nodes if bp.alive)
    finally:
        if profiled is not None:
            profiled.terminate()
            profiled.wait()
        await cluster.close()
    per = [(b - a) / elapsed * 1e3 for a, b in zip(cpu0, cpu1, strict=True)]
    rss = [m[0] for m in mem]
    cores = os.cpu_count() or 1
    machine_cores = (busy1 - busy0) / (total1 - total0) * cores
    brokers_cores = sum(per) / 1e3
    return {
        "nodes": n,
        "alive": alive,
        "start_s": started,
        "converged_s": converged,
        "window_s": elapsed,
        "cpu_ms_per_s_mean": sum(per) / n,
        "cpu_ms_per_s_max": max(per),
        "rss_mib_mean": sum(rss) / n,
        "rss_mib_max": max(rss),
        "pss_mib_mean": sum(m[1] for m in mem) / n,
        "private_mib_mean": sum(m[2] for m in mem) / n,
        "cluster_cores": brokers_cores,
        "other_cores": max(0.0, machine_cores - brokers_cores),
        "load_average": os.getloadavg()[0],
    }


async def main_async(args: argparse.Namespace) -> int:
    workdir = Path(tempfile.mkdtemp(prefix="sedax-bench-idle-"))
    extra = shlex.split(args.broker_args) if args.broker_args else []
    results = []
    for n in args.nodes:
        r = await measure(n, args.window, extra, args.seed, workdir, args.profile, tls=not args.insecure)
        results.append(r)
        print(
            f"  N={n}: started in {r['start_s']:.1f} s, converged at {r['converged_s']:.1f} s; "
            f"{r['cpu_ms_per_s_mean']:.2f} ms/s per broker (max {r['cpu_ms_per_s_max']:.2f}), "
            f"RSS {r['rss_mib_mean']:.1f} MiB (max {r['rss_mib_max']:.1f}, PSS {r['pss_mib_mean']:.1f}, private "
            f"{r['private_mib_mean']:.1f}); other work {r['other_cores']:.2f} cores",
            flush=True,
        )
    if args.json:
        print(json.dumps(results, indent=1))
    flags = " ".join(extra) or "(defaults)"
    flags += ", plain TCP" if args.insecure else ", TLS"
    print(f"\nbroker args: {flags}; idle window {args.window:g} s after {SETTLE:g} s settling")
    print("| brokers | start (ready) | converged | CPU ms/s per broker (mean / max) | cluster cores "
          "| RSS MiB per broker (mean / max) | PSS / private MiB | other work (cores) |")  # fmt: skip
    print("|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in results:
        print(
            f"| {r['nodes']} | {r['start_s']:.1f} s | {r['converged_s']:.1f} s "
            f"| {r['cpu_ms_per_s_mean']:.2f} / {r['cpu_ms_per_s_max']:.2f} | {r['cluster_cores']:.2f} "
            f"| {r['rss_mib_mean']:.1f} / {r['rss_mib_max']:.1f} "
            f"| {r['pss_mib_mean']:.1f} / {r['private_mib_mean']:.1f} | {r['other_cores']:.2f} |"
        )
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--nodes", type=lambda s: [int(v) for v in s.split(",")], default=[10, 50, 100], help="e.g. 10,50,100"
    )
    parser.add_argument("--window", type=float, default=30.0, help="idle seconds measured (default 30)")
    parser.add_argument("--broker-args", default="", help="extra broker flags, one string")
    parser.add_argument("--seed", type=int, default=1, help="seed of the coordinates")
    parser.add_argument("--insecure", action="store_true", help="plain TCP between the brokers (default: TLS)")
    parser.add_argument("--json", action="store_true", help="also print the results as JSON")
    parser.add_argument(
        "--profile", type=Path, help="also run one more broker under cProfile over the window; its stats go here"
    )
    args = parser.parse_args()
    return asyncio.run(main_async(args))


if __name__ == "__main__":
    sys.exit(main())
