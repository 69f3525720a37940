"""Benchmark `sedax analyze` (analysis/job.py) on 10^6 and 10^7 synthetic log records.

Logs are generated first (compact records: no topics/neighbours/counters; timed separately), then the whole
analysis runs once per size and master in a fresh Spark session, outputs included.  Results go to stdout as
a table and to a JSON file.

    .venv/bin/python benchmarks/bench_analysis.py --sizes 1e6 1e7 --json /tmp/bench_analysis.json

`--masters local[2] standalone` runs every size on both: `standalone` is a Spark standalone cluster this
script starts on 127.0.0.1 from the pyspark installation (analysis/standalone.py: a master and `--workers`
workers of `--worker-cores` cores and `--worker-memory` each, 2 x 1 core x 1g by default) and stops at the
end; any other value is passed to Spark as the master URL.

    .venv/bin/python benchmarks/bench_analysis.py --sizes 1e6 1e7 --masters local[2] standalone
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from analysis.job import LOCAL_MAX_PARTITION_BYTES, is_local_master, run_analysis
from analysis.standalone import StandaloneSpark
from analysis.synth import SynthStats, generate_logs

STANDALONE = "standalone"
# The standalone executors get the heap a local[2] run has (1 GiB); with Spark's 128 MiB input splits a
# 10^7-record run of local mode died reading a cached block back into such a heap (docs/benchmarks-analysis.md),
# so cluster runs use the split size local mode uses.
CLUSTER_CONF = {"spark.sql.files.maxPartitionBytes": str(LOCAL_MAX_PARTITION_BYTES)}

# Shape per size: runs x nodes x steps snapshots plus a few move events per step (the paper's 100-node
# overlays for 10^6; 1000 nodes for 10^7 so per-step groups grow too).
SHAPES = {
    10**6: {"runs": 10, "nodes": 100, "steps": 1000},
    10**7: {"runs": 10, "nodes": 1000, "steps": 1000},
}


def shape_for(n: int) -> dict[str, int]:
    """Runs/nodes/steps for about n snapshot records."""
    if n in SHAPES:
        return SHAPES[n]
    nodes = 100 if n < 5 * 10**6 else 1000
    return {"runs": 10, "nodes": nodes, "steps": max(1, n // (10 * nodes))}


def generate(n: int, workdir: Path, reuse: bool) -> tuple[Path, SynthStats, float]:
    """Generate about n records below workdir (or reuse an earlier generation); returns logs, stats, seconds."""
    logs = workdir / f"logs-{n}"
    done = workdir / f"logs-{n}.json"  # written after a complete generation, so reuse never reads a partial one
    if reuse and done.exists():
        saved = json.loads(done.read_text())
        return logs, SynthStats(**saved["stats"]), float(saved["generate_s"])
    shutil.rmtree(logs, ignore_errors=True)
    t = time.monotonic()
    stats = generate_logs(
        logs,
        compact=True,
        moves_per_step=2,
        topics_per_node=10,
        seed=1,
        corrupt_lines=3,
        truncate_last=True,
        **shape_for(n),
    )
    gen_s = time.monotonic() - t
    done.write_text(json.dumps({"stats": dataclasses.asdict(stats), "generate_s": gen_s}))
    return logs, stats, gen_s


def bench(
    n: int, masters: dict[str, str], workdir: Path, driver_memory: str, keep: bool, reuse: bool
) -> list[dict[str, object]]:
    """Generate about n records (timed apart), analyse them once per master, and return timings.

    masters maps a label (`local[2]`, `standalone`) to the Spark master URL.
    """
    shape = shape_for(n)
    logs, stats, gen_s = generate(n, workdir, reuse)
    results: list[dict[str, object]] = []
    for label, master in masters.items():
        out = workdir / f"out-{n}-{label.replace('[', '').replace(']', '')}"
        conf = {} if is_local_master(master) else CLUSTER_CONF
        t = time.monotonic()
        summary = run_analysis([str(logs)], str(out), master=master, driver_memory=driver_memory, conf=conf)
        ana_s = time.monotonic() - t
        assert summary.records == stats.records, (summary.records, stats.records)
        assert summary.bad_total == stats.bad_lines, (summary.bad_total, stats.bad_lines)
        if not keep:
            shutil.rmtree(out, ignore_errors=True)
        r: dict[str, object] = {
            "records": stats.records,
            "bad_lines": stats.bad_lines,
            "bytes": stats.bytes,
            **shape,
            "generate_s": round(gen_s, 1),
            "analyze_s": round(ana_s, 1),
            "records_per_s": round(stats.records / ana_s),
            "mib_per_s": round(stats.bytes / 2**20 / ana_s, 1),
            "master": label,
            "conf": conf,
            "driver_memory": driver_memory,
            "load_avg_after": round(os.getloadavg()[0], 1),
        }
        results.append(r)
        print(json.dumps(r), flush=True)
    if not keep:
        shutil.rmtree(logs, ignore_errors=True)
        (workdir / f"logs-{n}.json").unlink(missing_ok=True)
    return results


def main() -> int:
    """Run the benchmark sizes given on the command line."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", nargs="+", type=float, default=[1e6, 1e7], help="record counts (default 1e6 1e7)")
    ap.add_argument(
        "--masters",
        "--master",
        nargs="+",
        default=["local[2]"],
        help=f"Spark masters to compare on each size; '{STANDALONE}' starts a standalone cluster (default local[2])",
    )
    ap.add_argument("--workers", type=int, default=2, help=f"workers of the '{STANDALONE}' cluster (default 2)")
    ap.add_argument("--worker-cores", type=int, default=1, help="cores per worker (default 1)")
    ap.add_argument("--worker-memory", default="1g", help="memory per worker = per executor (default 1g)")
    ap.add_argument("--driver-memory", default="1g")
    ap.add_argument("--workdir", default=None, help="where logs go (default a temporary directory)")
    ap.add_argument("--keep", action="store_true", help="keep generated logs and outputs")
    ap.add_argument("--reuse", action="store_true", help="reuse logs a previous --keep run generated in --workdir")
    ap.add_argument("--json", default=None, help="also write the results to this JSON file")
    args = ap.parse_args()
    workdir = Path(args.workdir) if args.workdir else Path(tempfile.mkdtemp(prefix="bench-analysis-"))
    workdir.mkdir(parents=True, exist_ok=True)
    # Driver, executors and daemons talk over 127.0.0.1 only.
    os.environ["SPARK_LOCAL_IP"] = "127.0.0.1"
    cluster: StandaloneSpark | None = None
    results: list[dict[str, object]] = []
    try:
        masters: dict[str, str] = {}
        for m in args.masters:
            if m == STANDALONE:
                cluster = StandaloneSpark(workdir / "standalone", args.workers, args.worker_cores, args.worker_memory)
                cluster.start()
                cluster.wait_workers(180.0)
                masters[m] = cluster.url
            else:
                masters[m] = m
        for size in args.sizes:
            results += bench(int(size), masters, workdir, args.driver_memory, args.keep, args.reuse)
            if args.json:
                Path(args.json).write_text(json.dumps(results, indent=2) + "\n")
    finally:
        if cluster is not None:
            left = cluster.stop()
            if left:
                print(f"processes of the standalone cluster still running: {left}", file=sys.stderr)
    print(f"{'records':>10} {'MiB':>8} {'master':>10} {'generate s':>11} {'analyze s':>10} {'records/s':>10}")
    for r in results:
        mib = int(r["bytes"]) / 2**20  # type: ignore[call-overload]
        print(
            f"{r['records']:>10} {mib:>8.0f} {r['master']:>10} {r['generate_s']:>11} {r['analyze_s']:>10} "
            f"{r['records_per_s']:>10}"
        )
    if not args.workdir and not args.keep:
        shutil.rmtree(workdir, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
