"""Simulator speed: one Table III run against its 10 s bound, and how time grows with nodes and topics.

Run:  .venv/bin/python benchmarks/bench_sim.py [--grid] [--budget SECONDS]

The reference run is 100 nodes x 100 heterogeneous topics per node, load-balanced addition with
BestLocalCoord and 10 queries, goal L3 (one cell of Table III), in this process on one core.  `--grid`
then times the same experiment for 100/300/1000 nodes x 10/100/1000 topics per node, one run per cell; a
cell whose time, projected linearly in topics from the largest measured cell with as many nodes, exceeds
`--budget` is reported as projected instead of run.
"""

from __future__ import annotations

import argparse
import time
from typing import Final

from overlay.balance import BalanceMode, BalanceParams, Goal, Selection
from sim.experiments import LoadModel, StaticConfig, run_static

BOUND_S: Final = 10.0  # the bound for one Table III run
NODES: Final = (100, 300, 1000)
PER_NODE: Final = (10, 100, 1000)


def config(nodes: int, per_node: int) -> StaticConfig:
    return StaticConfig(
        nodes=nodes,
        topics_per_node=per_node,
        loads=LoadModel.HETEROGENEOUS,
        balance=BalanceMode.ADDITION,
        params=BalanceParams(goal=Goal.L3, selection=Selection.BESTLOCAL, n_queries=10),
    )


def timed(nodes: int, per_node: int, seed: int = 1) -> float:
    start = time.perf_counter()
    run_static(config(nodes, per_node), seed)
    return time.perf_counter() - start


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--grid", action="store_true", help="also time the nodes x topics grid")
    ap.add_argument("--budget", type=float, default=120.0, help="skip grid cells projected above this (s)")
    ap.add_argument("--repeat", type=int, default=3, help="reference runs (best and median reported)")
    args = ap.parse_args()

    times = sorted(timed(100, 100, seed) for seed in range(1, args.repeat + 1))
    best, median = times[0], times[len(times) // 2]
    print(f"Table III run (100 nodes x 100 het. topics/node, BestLocalCoord, 10 queries, L3), {args.repeat} runs:")
    print(f"  best {best:.2f} s, median {median:.2f} s; bound {BOUND_S:.0f} s; median/bound = {median / BOUND_S:.2f}")
    if not args.grid:
        return
    print(f"\n{'nodes':>6} {'topics/node':>12} {'topics':>9} {'seconds':>10} {'us/topic':>9}")
    for nodes in NODES:
        per_topic: float | None = None
        for per_node in PER_NODE:
            m = nodes * per_node
            if per_topic is not None and per_topic * m > args.budget:
                print(f"{nodes:>6} {per_node:>12} {m:>9} {per_topic * m:>9.0f}* {per_topic * 1e6:>9.0f}")
                continue
            t = timed(nodes, per_node)
            per_topic = t / m
            print(f"{nodes:>6} {per_node:>12} {m:>9} {t:>10.2f} {per_topic * 1e6:>9.0f}")
    print("* projected from the previous cell's time per topic, not run")


if __name__ == "__main__":
    main()
