"""`sedax sim`: the simulation experiments of Sec. VII and VIII from the command line.

`register(subparsers)` adds the `sim` command with two experiments:

* `sedax sim static`: n_nodes x n_topics/node topics with static loads, unbalanced or with load-balanced
  addition (Alg. 1); Tables I-IV and Figs. 4/5.
* `sedax sim growth`: topics grow by eq. (12); balanced addition and/or continuous balancing every Δτ
  (Alg. 2); Fig. 6, Table V and Fig. 7.

Run r uses seed `--seed + r`, so results do not depend on `--jobs`.  `--json` prints one JSON object on
stdout; progress goes to stderr.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Final, Generic, TypeVar

from broker.flags import Parser
from overlay.balance import DEFAULT_HOPS, DEFAULT_QUERIES, BalanceMode, BalanceParams, Goal, Selection
from overlay.logschema import DEFAULT_KEEP, DEFAULT_MAX_BYTES, JsonlWriter
from sim.experiments import (
    GrowthConfig,
    GrowthRun,
    LoadModel,
    Order,
    QuantileRule,
    StaticConfig,
    StaticRun,
    relative_loads,
    run_growth,
    run_static,
    summarise_growth,
    summarise_static,
)
from sim.simlog import move_record, snapshot_records

R = TypeVar("R")
C = TypeVar("C")

# Progress lines at most this often: a line per run would flood the terminal for 100 fast runs.
PROGRESS_INTERVAL_S: Final = 2.0


# ---- argument types -------------------------------------------------------------------------------------
def _int_at_least(low: int) -> Callable[[str], int]:
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from exc
        if value < low:
            raise argparse.ArgumentTypeError(f"must be at least {low}, got {value}")
        return value

    return parse


def _delta_tau(text: str) -> float:
    try:
        value = float(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from exc
    if not 0.0 < value <= 1.0:
        raise argparse.ArgumentTypeError(f"must be in (0, 1], got {value}")
    # The run ends exactly at τ = D = 1 only if Δτ divides D.
    steps = round(1.0 / value)
    if abs(steps * value - 1.0) > 1e-9:
        raise argparse.ArgumentTypeError(f"must divide D = 1 (1/Δτ an integer), got {value}")
    return value


def _lmax(text: str) -> float:
    try:
        value = float(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from exc
    if not value >= 1.0:  # also rejects NaN
        raise argparse.ArgumentTypeError(f"L_T^max must be at least 1 (topics start at size 1), got {value}")
    return value


# ---- parser ---------------------------------------------------------------------------------------------
def _common(p: argparse.ArgumentParser, nodes: int, per_node: int) -> None:
    p.add_argument("--nodes", type=_int_at_least(1), default=nodes, help=f"n_nodes (default {nodes})")
    p.add_argument(
        "--topics-per-node", type=_int_at_least(1), default=per_node, help=f"n_topics/node (default {per_node})"
    )
    p.add_argument("--runs", type=_int_at_least(1), default=1, help="independent runs (default 1)")
    p.add_argument("--seed", type=int, default=0, help="run r uses seed SEED + r (default 0)")
    p.add_argument("--goal", choices=[g.value for g in Goal], default=None, help="balancing goal L1/L2/L3 (default L3)")
    p.add_argument(
        "--selection",
        choices=[s.value for s in Selection],
        default=None,
        help="coordinate selection algorithm, Sec. V (default bestglobal)",
    )
    p.add_argument("--queries", type=_int_at_least(1), default=None, help=f"n_queries (default {DEFAULT_QUERIES})")
    p.add_argument(
        "--hops", type=_int_at_least(0), default=None, help=f"n_hops for bestregional (default {DEFAULT_HOPS})"
    )
    p.add_argument(
        "--ties",
        choices=["random", "first"],
        default=None,
        help="Tiebreaker(C*) among several best coordinates: a random one (default) or the first",
    )
    p.add_argument(
        "--quantile",
        choices=[q.value for q in QuantileRule],
        default=QuantileRule.INTERPOLATED.value,
        help="how quantiles are read off the averaged CCDF (default interpolated, as the paper)",
    )
    p.add_argument("--json", action="store_true", help="print one JSON object with the results")
    p.add_argument("--plot", type=Path, default=None, metavar="FILE.png", help="draw the figure to FILE.png")
    p.add_argument("--log-dir", type=Path, default=None, help="write schema-1 JSON-lines logs (docs/logs.md)")
    p.add_argument("--log-max-bytes", type=_int_at_least(1), default=DEFAULT_MAX_BYTES, help=argparse.SUPPRESS)
    p.add_argument("--log-keep", type=_int_at_least(1), default=DEFAULT_KEEP, help=argparse.SUPPRESS)
    p.add_argument("--jobs", type=_int_at_least(1), default=1, help="worker processes for the runs (default 1)")
    p.add_argument(
        "--coords",
        metavar="FILE",
        default=None,
        help="the nodes' coordinates (X,Y lines or a JSON list, as `sedax cluster up --coords`), the same in every "
        "run; sets --nodes",
    )


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> argparse.ArgumentParser:
    """Add the `sim` command (with `static` and `growth`) to a CLI's subparsers; returns its parser.

    Each experiment parser sets `func`, a callable taking the parsed namespace and returning the exit code.
    """
    sim = subparsers.add_parser("sim", help="simulate SeDAX load balancing (paper Sec. VII and VIII)")
    exps = sim.add_subparsers(
        dest="experiment", required=True, metavar="{static,growth}", help="static: Tables I-IV; growth: Fig. 6, Table V"
    )

    st = exps.add_parser("static", help="static topic loads: Tables I-IV, Figs. 4/5")
    _common(st, nodes=100, per_node=100)
    st.add_argument("--loads", choices=[m.value for m in LoadModel], default=LoadModel.HOMOGENEOUS.value)
    st.add_argument("--balance", choices=["none", "addition"], default="none", help="default none")
    st.add_argument("--order", choices=[o.value for o in Order], default=Order.RANDOM.value, help="addition order")
    st.set_defaults(func=_run_static_cmd, sim_parser=st)

    gr = exps.add_parser("growth", help="growing topics with balancing every Δτ: Fig. 6, Table V, Fig. 7")
    _common(gr, nodes=10, per_node=10)
    gr.add_argument("--lmax", type=_lmax, default=10.0, help="L_T^max, the largest size at τ = D (default 10)")
    gr.add_argument("--delta-tau", type=_delta_tau, default=0.01, help="Δτ in units of D (default 0.01)")
    gr.add_argument(
        "--balance", choices=[b.value for b in BalanceMode], default="none", help="when to balance (default none)"
    )
    gr.add_argument(
        "--scan",
        type=_int_at_least(1),
        default=None,
        help="Alg. 2 tries up to SCAN of the node's smallest topics until one moves (default 1: the paper's)",
    )
    gr.set_defaults(func=_run_growth_cmd, sim_parser=gr)
    return sim


def _params(args: argparse.Namespace, balancing: bool) -> BalanceParams:
    parser: argparse.ArgumentParser = args.sim_parser
    if not balancing:
        given = [f"--{n}" for n in ("goal", "selection", "queries", "hops", "ties") if getattr(args, n) is not None]
        if given:
            parser.error(f"{', '.join(given)} {'needs' if len(given) == 1 else 'need'} balancing; add --balance")
    selection = Selection(args.selection or Selection.BESTGLOBAL.value)
    if args.hops is not None and selection is not Selection.BESTREGIONAL:
        parser.error("--hops applies only to --selection bestregional")
    if args.queries is not None and selection is Selection.BESTGLOBAL:
        parser.error("--queries does not apply to bestglobal, which asks every node")
    scan = getattr(args, "scan", None)
    if scan is not None and not BalanceMode(args.balance).continuous:
        parser.error("--scan applies to continuous balancing (Alg. 2): use --balance continuous or combined")
    try:
        return BalanceParams(
            goal=Goal(args.goal or Goal.L3.value),
            selection=selection,
            n_queries=args.queries if args.queries is not None else DEFAULT_QUERIES,
            n_hops=args.hops if args.hops is not None else DEFAULT_HOPS,
            scan=scan if scan is not None else 1,
            random_ties=args.ties != "first",
        )
    except ValueError as exc:
        parser.error(str(exc))


# ---- running --------------------------------------------------------------------------------------------
def _mp_context() -> multiprocessing.context.BaseContext:
    # spawn: workers start clean (no copied locks or threads of the parent); its start-up cost is small
    # next to a run.
    return multiprocessing.get_context("spawn")


def run_all(
    fn: Callable[[C, int], R],
    cfg: C,
    seeds: Sequence[int],
    jobs: int = 1,
    progress: Callable[[int, int], None] | None = None,
) -> list[R]:
    """fn(cfg, seed) for every seed, in seed order, in `jobs` processes; progress(done, total) after each."""
    out: list[R] = []
    if jobs <= 1 or len(seeds) <= 1:
        for s in seeds:
            out.append(fn(cfg, s))
            if progress is not None:
                progress(len(out), len(seeds))
        return out
    with _mp_context().Pool(min(jobs, len(seeds))) as pool:
        # imap keeps seed order, so the result is the same for any number of jobs
        for res in pool.imap(_Call(fn, cfg), seeds, chunksize=1):
            out.append(res)
            if progress is not None:
                progress(len(out), len(seeds))
    return out


class _Call(Generic[C, R]):
    """A picklable fn(cfg, seed) with cfg bound (lambdas do not pickle for spawn workers)."""

    def __init__(self, fn: Callable[[C, int], R], cfg: C) -> None:
        self.fn = fn
        self.cfg = cfg

    def __call__(self, seed: int) -> R:
        return self.fn(self.cfg, seed)


class _Progress:
    """A compact progress line on stderr at most every PROGRESS_INTERVAL_S, and one at the end."""

    def __init__(self, label: str) -> None:
        self.label = label
        self.start = time.monotonic()
        self.last = self.start

    def __call__(self, done: int, total: int) -> None:
        now = time.monotonic()
        if done < total and now - self.last < PROGRESS_INTERVAL_S:
            return
        if done == total and now - self.start < PROGRESS_INTERVAL_S:
            return  # a short experiment needs no progress report
        self.last = now
        elapsed = now - self.start
        left = elapsed / done * (total - done)
        print(f"{self.label}: {done}/{total} runs, {elapsed:.1f} s elapsed, ~{left:.0f} s left", file=sys.stderr)


def _coords(args: argparse.Namespace) -> tuple[tuple[float, float], ...] | None:
    """--coords FILE read (and --nodes set to their number); None without it.  Exits 2 if the file is unusable."""
    if args.coords is None:
        return None
    from cli.overlay import CoordsFileError, read_coords  # only this option needs the file reader

    parser: argparse.ArgumentParser = args.sim_parser
    try:
        coords = tuple(read_coords(args.coords))
    except CoordsFileError as exc:
        parser.error(str(exc))
    args.nodes = len(coords)
    return coords


def _run_static_cmd(args: argparse.Namespace) -> int:
    balance = BalanceMode(args.balance)
    params = _params(args, balance is not BalanceMode.NONE)
    coords = _coords(args)
    cfg = _config(
        args,
        StaticConfig,
        nodes=args.nodes,
        topics_per_node=args.topics_per_node,
        loads=LoadModel(args.loads),
        balance=balance,
        params=params,
        order=Order(args.order),
        keep_moves=args.log_dir is not None,
        coords=coords,
    )
    seeds = [args.seed + r for r in range(args.runs)]
    runs = run_all(run_static, cfg, seeds, args.jobs, _Progress("sim static"))
    rule = QuantileRule(args.quantile)
    summary = summarise_static(runs, cfg, rule)
    summary["config"] = _config_dict(args, cfg.params, balance)
    if args.log_dir is not None:
        _log_static(args, runs, seeds)
    if args.plot is not None:
        from sim.plots import plot_ccdf

        rel = relative_loads([r.loads for r in runs], [r.norm for r in runs])
        title = f"{args.nodes} nodes x {args.topics_per_node} {args.loads} topics, balance {args.balance}"
        plot_ccdf(args.plot, {f"L{i + 1}": rel[i] for i in range(3)}, title)
    _emit(args, summary)
    return 0


def _run_growth_cmd(args: argparse.Namespace) -> int:
    balance = BalanceMode(args.balance)
    params = _params(args, balance is not BalanceMode.NONE)
    coords = _coords(args)
    cfg = _config(
        args,
        GrowthConfig,
        nodes=args.nodes,
        topics_per_node=args.topics_per_node,
        l_max=args.lmax,
        delta_tau=args.delta_tau,
        balance=balance,
        params=params,
        keep_steps=args.log_dir is not None,
        coords=coords,
    )
    seeds = [args.seed + r for r in range(args.runs)]
    runs = run_all(run_growth, cfg, seeds, args.jobs, _Progress("sim growth"))
    summary = summarise_growth(runs, cfg, QuantileRule(args.quantile))
    summary["config"] = _config_dict(args, cfg.params, balance)
    if args.log_dir is not None:
        _log_growth(args, runs, seeds, cfg)
    if args.plot is not None:
        from sim.plots import plot_growth

        mv = summary["moved"]
        assert isinstance(mv, dict)
        title = f"run 0 of {args.runs}: {args.nodes} nodes, balance {args.balance}, Δτ = {args.delta_tau}"
        plot_growth(args.plot, mv["tau"], mv["q95"], mv["v_ml_cum"], mv["r_ml"], title)
    _emit(args, summary)
    return 0


def _config(args: argparse.Namespace, kind: Callable[..., C], **fields: object) -> C:
    """The experiment's config; a value the config refuses (a coordinate outside the square) exits 2."""
    try:
        return kind(**fields)
    except ValueError as exc:
        parser: argparse.ArgumentParser = args.sim_parser
        parser.error(f"--coords {args.coords}: {exc}" if args.coords else str(exc))


def _config_dict(args: argparse.Namespace, params: BalanceParams, balance: BalanceMode) -> dict[str, object]:
    cfg: dict[str, object] = {
        "experiment": args.experiment,
        "nodes": args.nodes,
        "topics_per_node": args.topics_per_node,
        "runs": args.runs,
        "seed": args.seed,
        "balance": balance.value,
        "quantile": args.quantile,
    }
    if args.coords is not None:
        cfg["coords"] = args.coords
    if balance is not BalanceMode.NONE:
        cfg.update(
            goal=params.goal.value, selection=params.selection.value, ties="random" if params.random_ties else "first"
        )
        if params.selection not in (Selection.BESTGLOBAL,):
            cfg["queries"] = params.n_queries
        if params.selection is Selection.BESTREGIONAL:
            cfg["hops"] = params.n_hops
        if balance.continuous:
            cfg["scan"] = params.scan
    if args.experiment == "static":
        cfg.update(loads=args.loads, order=args.order)
    else:
        cfg.update(lmax=args.lmax, delta_tau=args.delta_tau)
    return cfg


def _log_static(args: argparse.Namespace, runs: Sequence[StaticRun], seeds: Sequence[int]) -> None:
    with JsonlWriter(args.log_dir, f"sim-static-{args.seed}", args.log_max_bytes, args.log_keep) as w:
        for run, seed in zip(runs, seeds, strict=True):
            name = f"static-seed{seed}"
            for mv in run.moves:
                w.write(move_record(name, 0.0, mv))
            # static runs have no time: one picture of the overlay after the last addition
            for rec in snapshot_records(name, 0, 0.0, run.overlay, run.loads):
                w.write(rec)


def _log_growth(args: argparse.Namespace, runs: Sequence[GrowthRun], seeds: Sequence[int], cfg: GrowthConfig) -> None:
    import numpy as np

    with JsonlWriter(args.log_dir, f"sim-growth-{args.seed}", args.log_max_bytes, args.log_keep) as w:
        for run, seed in zip(runs, seeds, strict=True):
            name = f"growth-seed{seed}"
            assert run.step_loads is not None
            moved = np.zeros(cfg.nodes)
            by_step: dict[int, list[int]] = {}
            for i, mv in enumerate(run.moves):
                by_step.setdefault(mv.step, []).append(i)
            for k in range(cfg.steps + 1):
                ts = min(1.0, k * cfg.delta_tau)
                for i in by_step.get(k, []):
                    mv = run.moves[i]
                    w.write(move_record(name, ts, mv))
                    if mv.kind == "move":
                        moved[mv.node] += mv.load
                for rec in snapshot_records(name, k, ts, run.overlay, run.step_loads[k], moved):
                    w.write(rec)


def _emit(args: argparse.Namespace, summary: dict[str, object]) -> None:
    if args.json:
        print(json.dumps(summary, allow_nan=False))
        return
    cfgd = summary["config"]
    assert isinstance(cfgd, dict)
    print(" ".join(f"{k}={v}" for k, v in cfgd.items()))

    def row(name: str, q: object) -> str:
        assert isinstance(q, dict)
        return f"  {name:<10} q5 {q['q5']:7.1f}%  mean {q['mean']:7.1f}%  q95 {q['q95']:7.1f}%"

    if args.experiment == "static":
        for key in ("L1", "L2", "L3", "cell_area"):
            print(row(key, summary[key]))
        corr = summary["correlation"]
        assert isinstance(corr, dict)
        print("  corr(A, L):  " + "  ".join(f"{k} {v:.4f}" if v is not None else f"{k} -" for k, v in corr.items()))
    else:
        for phase in ("before", "after"):
            levels = summary[phase]
            assert isinstance(levels, dict)
            print(f" {phase} growth:")
            for key in ("L1", "L2", "L3"):
                print(row(key, levels[key]))
        mv = summary["moved"]
        assert isinstance(mv, dict)
        print(f"  moved load per run: {mv['total_mean']:.1f} topic units in {mv['moves_mean']:.1f} moves (mean)")
    if "eq11_violations" in summary:
        print(f"  eq. (11) violations: {summary['eq11_violations']}")


def main(argv: Sequence[str] | None = None) -> int:
    """Run `sim` as a stand-alone program (the `sedax` CLI mounts the same parser via register)."""
    parser: argparse.ArgumentParser = Parser(prog="sedax")
    sub = parser.add_subparsers(dest="command", required=True)
    register(sub)
    args = parser.parse_args(argv)
    code: int = args.func(args)
    return code


if __name__ == "__main__":
    # `python -m cli.sim sim ...` is `sedax sim ...`, with the same handling of a closed stdout
    from cli.main import main as sedax

    sys.exit(sedax())
