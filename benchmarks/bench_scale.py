"""Live balancing at the paper's scale (not a test): 100 broker processes, Table III's workload through them,
the simulator on the same coordinates, then continuous balancing while topics grow.

    .venv/bin/python benchmarks/bench_scale.py                                   # 100 brokers, both phases
    .venv/bin/python benchmarks/bench_scale.py --nodes 30 --topics-per-node 20 --phases static

Phase "static" (Table III: heterogeneous sizes, L3 goal, BestLocalCoord, 10 queries, Alg. 1 at addition): a
cluster of N brokers at resilience 3 (TLS, as `sedax cluster up` starts one) at seeded coordinates; `sedax
load`'s run_load creates N x topics-per-node topics one after another through the brokers, each filled to its
heterogeneous size (Sec. VII-A: a fifth of them 4 units, the rest 0.25) before the next.  Then L3 of every
broker (STATUS, bytes) is set beside what `sim.world.SimNetwork` (the code of `sedax sim`) gives for the same
coordinates, topic names (hence h(t)) and stored sizes: q5 / mean / q95 in % of the mean load, and max/mean.

Phase "growth" (Sec. VIII, live): a fresh cluster with `--balance combined` (Alg. 1 at creation, Alg. 2 every
Δτ); N x growth-topics-per-node topics are created at one unit each, then grown in K steps to exp(λ_t τ) units
(λ_t spread linearly up to ln(l_max), eq. 12) while the brokers balance.  Printed after each step: live L3
q95; at the end the simulator's balanced L3 for the same coordinates and final sizes, and the signalling per
Δτ per broker (load reports, coordinate queries and offers: messages and bytes, from the brokers' counters).

For both phases the brokers' CPU (utime + stime from /proc) is printed, so a reader sees what the machine
spent; the brokers use a 3 s failure-detection window (heartbeat 0.5 s x 6) as bench_balance.py does, so a
machine loaded by the experiment itself does not declare busy brokers dead.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(_ROOT))
sys.path.insert(0, str(_ROOT / "benchmarks"))

from bench_balance import counter_sum, live_loads, run_sim, statuses  # noqa: E402
from harness import cpu_seconds  # noqa: E402

from cli.balance import run_load  # noqa: E402
from cli.cluster import LocalCluster  # noqa: E402
from client.client import Client  # noqa: E402
from overlay.dynamics import growth_rates, topic_sizes  # noqa: E402
from overlay.geometry import UNIT_SQUARE  # noqa: E402
from overlay.pubsub import MESSAGE_OVERHEAD  # noqa: E402
from sim.experiments import LoadModel, level_summary  # noqa: E402

REPORT_INTERVAL = 0.5  # --load-report-interval of the brokers (as bench_balance.py)
BASE_ARGS = ("--heartbeat-interval", "0.5", "--heartbeat-misses", "6", "--log-level", "WARNING")
SIGNALLING = (
    "load_reports_sent", "load_report_bytes", "balance_queries", "balance_query_bytes", "balance_offers",
    "balance_offer_bytes",
)  # fmt: skip


def l3_summary(loads: np.ndarray, norm: float) -> dict[str, float]:
    """q5 / mean / q95 of L3 in % of the mean load (Tables III-V), and max/mean."""
    rel = loads / norm * 100.0
    out = level_summary([rel])
    out["max_over_mean"] = float(loads.max() / loads.mean())
    return out


def balance_flags(mode: str, args: argparse.Namespace) -> tuple[str, ...]:
    return (
        *BASE_ARGS, "--balance", mode, "--goal", "L3", "--selection", args.selection, "--queries", str(args.queries),
        "--balance-interval", str(args.delta_tau), "--min-gain", str(args.min_gain),
        "--move-cooldown", str(args.cooldown), "--load-report-interval", str(REPORT_INTERVAL),
        "--query-timeout", "1.0",
    )  # fmt: skip


def cluster_cpu(cluster: LocalCluster) -> float:
    return sum(cpu_seconds(bp.pid) for bp in cluster.nodes)


async def start(n: int, coords: list[tuple[float, float]], flags: tuple[str, ...], state: Path) -> LocalCluster:
    cluster = LocalCluster(n, coords=coords, resilience=3, state_dir=state, broker_args=flags)
    t0 = time.monotonic()
    try:
        await cluster.start()
        await cluster.wait_converged(120.0 + n)
    except BaseException:
        await cluster.close()
        raise
    print(f"  {n} brokers up and converged in {time.monotonic() - t0:.1f} s", flush=True)
    await asyncio.sleep(3 * REPORT_INTERVAL)  # the first load reports: Alg. 1 needs the region's loads
    return cluster


def signalling(base: list[dict[str, Any]], sts: list[dict[str, Any]], rounds: float, n: int) -> dict[str, float]:
    return {name: (counter_sum(sts, name) - counter_sum(base, name)) / rounds / n for name in SIGNALLING}


async def static_phase(coords: list[tuple[float, float]], args: argparse.Namespace, state: Path) -> dict[str, Any]:
    n = len(coords)
    topics = n * args.topics_per_node
    cluster = await start(n, coords, balance_flags("addition", args), state / "static")
    try:
        cpu0, t0 = cluster_cpu(cluster), time.monotonic()
        summary = await run_load(
            [bp.listen for bp in cluster.nodes], topics, LoadModel.HETEROGENEOUS, args.unit_bytes, args.seed, None,
            "scale", 4096, 300.0, cluster.credentials("bench"),
        )  # fmt: skip
        load_s = time.monotonic() - t0
        cpu_load = cluster_cpu(cluster) - cpu0
        # The last topics' loads and tertiary notes go out with the next reports: measure after them.
        await asyncio.sleep(3 * REPORT_INTERVAL)
        sts = await statuses(cluster)
        alive = len(cluster.live())
    finally:
        await cluster.close()
    loads = live_loads(sts)[2]
    held = {t["topic"]: t["size"] for s in sts for t in s["topics"] if t["role"] in ("primary", "delegate")}
    names = [f"scale/{i:04d}" for i in range(topics)]
    sizes = [float(held.get(nm, 0)) for nm in names]
    sim = run_sim("addition", coords, names, sizes, _sim_args(args))
    total = float(sum(sizes))
    cli = sedax_sim(coords, args, state)
    return {
        "sedax_sim": cli,
        "topics": topics,
        "stored_topics": sum(1 for s in sizes if s > 0),
        "live": l3_summary(loads, total / n),
        "sim": l3_summary(sim["loads"][2], sim["norm"]),
        "delegations": counter_sum(sts, "delegations"),
        "load_seconds": load_s,
        "messages": summary["messages"],
        "cpu_cores_while_loading": cpu_load / load_s,
        "alive": alive,
    }


def sedax_sim(coords: list[tuple[float, float]], args: argparse.Namespace, state: Path) -> dict[str, Any]:
    """`sedax sim static` on the cluster's coordinates (--coords): Table III's statistic over random topic homes
    and sizes of the same workload, beside the replay of the very topics the brokers stored."""
    state.mkdir(parents=True, exist_ok=True)
    path = state / "coords.json"
    path.write_text(json.dumps([list(c) for c in coords]))
    argv = [
        "sim", "static", "--coords", str(path), "--topics-per-node", str(args.topics_per_node),
        "--loads", "heterogeneous", "--balance", "addition", "--goal", "L3", "--selection", args.selection,
        "--queries", str(args.queries), "--runs", str(args.sim_runs), "--seed", str(args.seed), "--json",
    ]  # fmt: skip
    print(f"  sedax {' '.join(argv)}", flush=True)
    out = subprocess.run([sys.executable, "-m", "cli.main", *argv], capture_output=True, text=True, check=True)
    res: dict[str, Any] = json.loads(out.stdout)
    return {"command": "sedax " + " ".join(argv), "L3": res["L3"]}


async def grow(client: Client, targets: dict[str, int], stored: dict[str, int]) -> int:
    """Publish to every topic until it holds its target bytes (payload + per-message overhead); messages sent."""
    overhead = len(client.client_id) + MESSAGE_OVERHEAD
    futures = []
    for topic, want in targets.items():
        left = want - stored.get(topic, 0)
        while left > overhead:
            chunk = min(4096, left - overhead)
            futures.append(await client.publish_nowait(topic, b"x" * chunk))
            left -= chunk + overhead
            stored[topic] = stored.get(topic, 0) + chunk + overhead
    async with asyncio.timeout(300.0):
        await asyncio.gather(*futures)
    return len(futures)


async def growth_phase(coords: list[tuple[float, float]], args: argparse.Namespace, state: Path) -> dict[str, Any]:
    n = len(coords)
    m = n * args.growth_topics_per_node
    names = [f"grow/{i:04d}" for i in range(m)]
    rates = growth_rates(m, args.lmax, 1.0)
    rng = np.random.default_rng(args.seed)
    rng.shuffle(rates)  # the growing topics are spread over the overlay, not ordered by name
    unit = args.growth_unit_bytes
    cluster = await start(n, coords, balance_flags("combined", args), state / "growth")
    steps: list[dict[str, Any]] = []
    try:
        base = await statuses(cluster)
        cpu0, t0 = cluster_cpu(cluster), time.monotonic()
        stored: dict[str, int] = {}
        async with Client([bp.listen for bp in cluster.nodes], credentials=cluster.credentials("grow")) as c:
            # τ = 0: every topic one unit, created one after another (Alg. 1 places each).
            for name in names:
                await grow(c, {name: unit}, stored)
            created = time.monotonic() - t0
            print(f"  {m} topics created in {created:.0f} s", flush=True)
            for k in range(1, args.steps + 1):
                tau = k / args.steps
                sizes = topic_sizes(rates, tau)
                targets = {nm: round(float(s) * unit) for nm, s in zip(names, sizes, strict=True)}
                msgs = await grow(c, targets, stored)
                await asyncio.sleep(args.step_rounds * args.delta_tau)  # Alg. 2 rounds at this size
                sts = await statuses(cluster)
                loads = live_loads(sts)[2]
                total = float(live_loads(sts)[0].sum())  # every topic once: its primary
                row = {
                    "tau": tau,
                    "messages": msgs,
                    "live": l3_summary(loads, total / n),
                    "moves": counter_sum(sts, "moves"),
                    "seconds": time.monotonic() - t0,
                }
                steps.append(row)
                print(
                    f"  τ={tau:.2f}: {msgs} messages, live L3 q95 {row['live']['q95']:.1f}% "
                    f"max/mean {row['live']['max_over_mean']:.3f}, moves so far {row['moves']}",
                    flush=True,
                )
        elapsed = time.monotonic() - t0
        cpu = cluster_cpu(cluster) - cpu0
        alive = len(cluster.live())
    finally:
        await cluster.close()
    held = {t["topic"]: t["size"] for s in sts for t in s["topics"] if t["role"] in ("primary", "delegate")}
    sizes_final = [float(held.get(nm, 0)) for nm in names]
    sim = run_sim("combined", coords, names, sizes_final, _sim_args(args))
    sim_none = run_sim("none", coords, names, sizes_final, _sim_args(args))
    moved = counter_sum(sts, "moved_bytes")
    total = float(sum(sizes_final))
    return {
        "topics": m,
        "steps": steps,
        "live": steps[-1]["live"],
        "sim_combined": l3_summary(sim["loads"][2], sim["norm"]),
        "sim_unbalanced": l3_summary(sim_none["loads"][2], sim_none["norm"]),
        "moves": counter_sum(sts, "moves"),
        "r_ml_live": moved / total if total else 0.0,
        "r_ml_sim": sim["r_ml"],
        "signalling_per_dtau_per_broker": signalling(base, sts, elapsed / args.delta_tau, n),
        "seconds": elapsed,
        "cpu_cores": cpu / elapsed,
        "alive": alive,
    }


def _sim_args(args: argparse.Namespace) -> argparse.Namespace:
    return argparse.Namespace(
        seed=args.seed, selection=args.selection, queries=args.queries, scan=1, ties="random", sim_rounds=50
    )


def _fmt(s: dict[str, float]) -> str:
    return f"{s['q5']:.1f} / {s['mean']:.1f} / {s['q95']:.1f} %, max/mean {s['max_over_mean']:.3f}"


async def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--nodes", type=int, default=100)
    ap.add_argument("--topics-per-node", type=int, default=100, help="static phase (Table III: 100)")
    ap.add_argument("--unit-bytes", type=int, default=2000, help="bytes of one unit of load (static phase)")
    ap.add_argument("--growth-topics-per-node", type=int, default=10)
    ap.add_argument("--growth-unit-bytes", type=int, default=500, help="a growing topic's size at τ = 0")
    ap.add_argument("--lmax", type=float, default=10.0, help="L_T^max at τ = 1 (units)")
    ap.add_argument("--steps", type=int, default=10, help="growth steps from τ = 0 to 1")
    ap.add_argument("--step-rounds", type=float, default=3.0, help="Δτ rounds of balancing after each step")
    ap.add_argument("--delta-tau", type=float, default=2.0, help="the brokers' --balance-interval (s)")
    ap.add_argument("--min-gain", type=float, default=0.05)
    ap.add_argument("--cooldown", type=float, default=10.0)
    ap.add_argument("--selection", default="bestlocal")
    ap.add_argument("--queries", type=int, default=10)
    ap.add_argument("--seed", type=int, default=11)
    ap.add_argument("--sim-runs", type=int, default=3, help="runs of `sedax sim static --coords` (random homes)")
    ap.add_argument("--phases", default="static,growth")
    ap.add_argument("--state", default="/tmp/sedax-bench-scale")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    rng = np.random.default_rng(args.seed)
    coords = [(float(x), float(y)) for x, y in UNIT_SQUARE.uniform(rng, args.nodes)]
    state = Path(args.state)
    out: dict[str, Any] = {"nodes": args.nodes, "load_average_start": os.getloadavg()[0]}
    if "static" in args.phases:
        r = await static_phase(coords, args, state)
        out["static"] = r
        print(f"static: {r['topics']} topics ({r['messages']} messages) in {r['load_seconds']:.0f} s, "
              f"{r['cpu_cores_while_loading']:.2f} cores for the brokers, {r['delegations']} delegations, "
              f"{r['alive']} brokers alive", flush=True)  # fmt: skip
        print(f"  L3 live {_fmt(r['live'])}", flush=True)
        print(f"  L3 sim  {_fmt(r['sim'])}   (q95 live/sim {r['live']['q95'] / r['sim']['q95']:.3f})", flush=True)
        cli = r["sedax_sim"]["L3"]
        runs = args.sim_runs
        print(f"  L3 sedax sim --coords, {runs} runs: {cli['q5']:.1f} / {cli['mean']:.1f} / {cli['q95']:.1f} %")
    if "growth" in args.phases:
        r = await growth_phase(coords, args, state)
        out["growth"] = r
        sig = r["signalling_per_dtau_per_broker"]
        print(f"growth: {r['topics']} topics, {r['moves']} moves, R_ML live {r['r_ml_live']:.3f} sim "
              f"{r['r_ml_sim']:.3f}, {r['cpu_cores']:.2f} cores for the brokers over {r['seconds']:.0f} s, "
              f"{r['alive']} alive", flush=True)  # fmt: skip
        print(f"  L3 live (τ = 1)     {_fmt(r['live'])}")
        print(f"  L3 sim, balanced    {_fmt(r['sim_combined'])}")
        print(f"  L3 sim, unbalanced  {_fmt(r['sim_unbalanced'])}")
        print(
            f"  per Δτ and broker: {sig['load_reports_sent']:.2f} load reports ({sig['load_report_bytes']:.0f} B), "
            f"{sig['balance_queries']:.2f} queries ({sig['balance_query_bytes']:.0f} B), "
            f"{sig['balance_offers']:.2f} offers ({sig['balance_offer_bytes']:.0f} B)"
        )
    out["load_average_end"] = os.getloadavg()[0]
    if args.json:
        print(json.dumps(out, indent=1, default=float))
    return 0


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
