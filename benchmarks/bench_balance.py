"""Live load balancing against the simulator (not a test): the same coordinates, topics and sizes.

    .venv/bin/python benchmarks/bench_balance.py [--nodes 20] [--topics 200] [--unit-bytes 5000] [--seed 7]

For each balancing mode (none, addition = Alg. 1, continuous = Alg. 2 every Δτ) a fresh cluster of real broker
processes at resilience 3 is started at the same seeded coordinates; `sedax load` creates the topics one after
another and fills them to the paper's heterogeneous sizes (Sec. VII-A).  With continuous balancing the brokers
then balance until no topic has moved for a while.  The L1/L2/L3 loads of every broker (bytes, from STATUS)
are normalised as in the paper (100% = total topic bytes / nodes) and compared with what the simulator
(`sim.world.SimNetwork`, the same `overlay/` decision code) predicts for the same brokers, topic names
(hence homes h(t)) and sizes.  Printed: max/mean and q95 of L3 for both, their ratio, signalling cost per Δτ
and the moved load V_ML, R_ML (eqs. 13-14).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from cli.balance import run_load
from cli.cluster import LocalCluster
from client.admin import AdminClient, status_json
from overlay.balance import BalanceParams, Goal, Selection
from overlay.geometry import UNIT_SQUARE, geohash
from sim.experiments import LoadModel, ccdf_quantile
from sim.world import SimNetwork

REPORT_INTERVAL = 0.5  # --load-report-interval of the brokers
BASE_ARGS = ("--heartbeat-interval", "0.5", "--heartbeat-misses", "6", "--log-level", "WARNING")


def summarise(loads: np.ndarray, norm: float) -> dict[str, float]:
    rel = loads / norm * 100.0
    return {
        "max_over_mean": float(loads.max() / loads.mean()),
        "q95": ccdf_quantile([rel], 0.95),
        "max": float(rel.max()),
    }


async def statuses(cluster: LocalCluster) -> list[dict[str, Any]]:
    out = []
    for bp in cluster.nodes:
        a = await AdminClient.connect(bp.listen, credentials=cluster.credentials("bench"))
        try:
            out.append(status_json(await a.status()))
        finally:
            await a.aclose()
    return out


def live_loads(sts: list[dict[str, Any]]) -> np.ndarray:
    return np.array([[float(s["loads"][k]) for s in sts] for k in ("L1", "L2", "L3")])


def counter_sum(sts: list[dict[str, Any]], name: str) -> int:
    return sum(int(s["counters"].get(name, 0)) for s in sts)


async def run_live(
    mode: str, coords: list[tuple[float, float]], args: argparse.Namespace, state: Path
) -> dict[str, Any]:
    flags = (
        *BASE_ARGS, "--balance", mode, "--goal", "L3", "--selection", args.selection, "--queries", str(args.queries),
        "--balance-interval", str(args.delta_tau), "--min-gain", str(args.min_gain),
        "--move-cooldown", str(args.cooldown), "--balance-scan", str(args.scan), "--ties", args.ties,
        "--load-report-interval", str(REPORT_INTERVAL), "--query-timeout", "1.0",
    )  # fmt: skip
    base: list[dict[str, Any]] = []
    async with LocalCluster(len(coords), coords=coords, resilience=3, state_dir=state, broker_args=flags) as c:
        await c.wait_converged(60.0)
        await asyncio.sleep(1.5)  # first load reports (the brokers' region knowledge) before Alg. 1 runs
        base = await statuses(c)  # signalling is counted from here on
        started = time.monotonic()
        summary = await run_load(
            [bp.listen for bp in c.nodes], args.topics, LoadModel.HETEROGENEOUS, args.unit_bytes, args.seed,
            None, "bench", 1024, 120.0, c.credentials("bench"),
        )  # fmt: skip
        load_s = time.monotonic() - started
        t0 = time.monotonic()
        # The last topics' load reports and tertiary notes (L3) go out with the next reports: measure after them.
        await asyncio.sleep(3 * REPORT_INTERVAL)
        sts = await statuses(c)
        if mode in ("continuous", "combined"):
            last, quiet = counter_sum(sts, "moves"), 0
            while quiet < 4 and time.monotonic() - t0 < args.settle:
                await asyncio.sleep(2 * args.delta_tau)
                sts = await statuses(c)
                moves = counter_sum(sts, "moves")
                quiet = quiet + 1 if moves == last else 0
                last = moves
        elapsed = time.monotonic() - t0 + load_s
    loads = live_loads(sts)
    held = {t["topic"]: t["size"] for s in sts for t in s["topics"] if t["role"] in ("primary", "delegate")}
    rounds = elapsed / args.delta_tau
    n = len(coords)
    signalling = {
        name: (counter_sum(sts, name) - counter_sum(base, name)) / rounds / n
        for name in ("load_reports_sent", "load_report_bytes", "balance_queries", "balance_query_bytes",
                     "balance_offers", "balance_offer_bytes")
    }  # fmt: skip
    moved = counter_sum(sts, "moved_bytes")
    total = float(loads[0].sum())
    return {
        "loads": loads,
        "norm": total / n,
        "sizes": held,
        "moves": counter_sum(sts, "moves"),
        "delegations": counter_sum(sts, "delegations"),
        "moved_bytes": moved,
        "r_ml": moved / total if total else 0.0,
        "per_dtau_per_node": signalling,
        "seconds": elapsed,
        "load_summary": summary,
    }


def run_sim(
    mode: str, coords: list[tuple[float, float]], names: list[str], sizes: list[float], args: argparse.Namespace
) -> dict[str, Any]:
    rng = np.random.default_rng(args.seed)
    points = np.asarray(coords, dtype=float)
    net = SimNetwork(points, UNIT_SQUARE, rng)
    params = BalanceParams(
        goal=Goal.L3,
        selection=Selection(args.selection),
        n_queries=args.queries,
        scan=args.scan,
        random_ties=args.ties == "random",
    )
    moved = 0.0
    for name, size in zip(names, sizes, strict=True):
        home = np.asarray(geohash(name), dtype=float)
        if mode in ("addition", "combined"):
            net.add_balanced(home, size, params, rng)
        else:
            net.add_topic(home, size, None, net.triple(home))
    if mode in ("continuous", "combined"):
        for _ in range(args.sim_rounds):
            moves = 0
            for v in rng.permutation(len(coords)):
                mv = net.balance_step(int(v), params, rng)
                if mv is not None:
                    moves += 1
                    moved += mv.load
            if moves == 0:
                break
    loads = np.stack([net.ledger.node_loads(level) for level in (1, 2, 3)])
    total = float(sum(sizes))
    return {"loads": loads, "norm": total / len(coords), "moved_bytes": moved, "r_ml": moved / total}


async def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--nodes", type=int, default=20)
    ap.add_argument("--topics", type=int, default=200)
    ap.add_argument("--unit-bytes", type=int, default=5000)
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--selection", default="bestlocal")
    ap.add_argument("--queries", type=int, default=10)
    ap.add_argument("--delta-tau", type=float, default=0.5)
    ap.add_argument("--settle", type=float, default=90.0, help="longest continuous balancing phase (s)")
    ap.add_argument("--sim-rounds", type=int, default=50)
    ap.add_argument("--min-gain", type=float, default=0.05, help="hysteresis of the live brokers (fraction)")
    ap.add_argument("--cooldown", type=float, default=5.0, help="seconds before a topic may move again")
    ap.add_argument("--scan", type=int, default=1, help="smallest topics one Alg. 2 round may try (1 = the paper's)")
    ap.add_argument("--ties", choices=("random", "first"), default="random", help="Tiebreaker(C*) of both sides")
    ap.add_argument("--modes", default="none,addition,continuous")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--state", default="/tmp/sedax-bench-balance")
    args = ap.parse_args()
    rng = np.random.default_rng(args.seed)
    coords = [(float(x), float(y)) for x, y in UNIT_SQUARE.uniform(rng, args.nodes)]
    names = [f"bench/{i:04d}" for i in range(args.topics)]
    rows = []
    for mode in args.modes.split(","):
        live = await run_live(mode, coords, args, Path(args.state) / mode)
        # The simulator gets the sizes the brokers actually stored (payload + per-message overhead).
        sizes = [float(live["sizes"].get(nm, 0)) for nm in names]
        sim = run_sim(mode, coords, names, sizes, args)
        lv = {f"L{i + 1}": summarise(live["loads"][i], live["norm"]) for i in range(3)}
        sm = {f"L{i + 1}": summarise(sim["loads"][i], sim["norm"]) for i in range(3)}
        row = {
            "mode": mode,
            "live": lv,
            "sim": sm,
            "ratio_L3_max_over_mean": lv["L3"]["max_over_mean"] / sm["L3"]["max_over_mean"],
            "ratio_L3_q95": lv["L3"]["q95"] / sm["L3"]["q95"],
            "moves_live": live["moves"],
            "delegations_live": live["delegations"],
            "r_ml_live": live["r_ml"],
            "r_ml_sim": sim["r_ml"],
            "v_ml_live_bytes": live["moved_bytes"],
            "signalling_per_dtau_per_node": live["per_dtau_per_node"],
            "seconds": round(live["seconds"], 1),
        }
        rows.append(row)
        print(
            f"{mode:<11} L3 max/mean live {lv['L3']['max_over_mean']:.3f} sim {sm['L3']['max_over_mean']:.3f} "
            f"(ratio {row['ratio_L3_max_over_mean']:.3f}); q95 live {lv['L3']['q95']:.1f}% sim {sm['L3']['q95']:.1f}% "
            f"(ratio {row['ratio_L3_q95']:.3f}); moves {live['moves']}, delegations {live['delegations']}, "
            f"R_ML live {live['r_ml']:.3f} sim {sim['r_ml']:.3f}",
            flush=True,
        )
        sig = live["per_dtau_per_node"]
        print(
            f"{'':<11} per Δτ and broker: {sig['load_reports_sent']:.1f} load reports "
            f"({sig['load_report_bytes']:.0f} B), "
            f"{sig['balance_queries']:.2f} queries ({sig['balance_query_bytes']:.0f} B), "
            f"{sig['balance_offers']:.2f} offers ({sig['balance_offer_bytes']:.0f} B)",
            flush=True,
        )
    if args.json:
        print(json.dumps(rows, indent=1))


if __name__ == "__main__":
    asyncio.run(main())
