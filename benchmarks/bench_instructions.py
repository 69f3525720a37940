"""Instructions per message through the brokers (not a test): a count that does not move with the machine's load.

    .venv/bin/python benchmarks/bench_instructions.py [--configs l1,l2,l2far,client,client-batched]
        [--messages 2000] [--tree PATH ...]

CPU time per message moves by +-5 % from run to run even in bench_broker.py (one process, no scheduling), so a
change worth 1-3 % cannot be told from the noise by timing it.  This runs bench_broker.py under valgrind's
callgrind, which counts the instructions the process executes (user space only: the interpreter, msgpack,
uvloop, libc; not the kernel's reads and writes) whatever else the machine does.  Each configuration runs
twice, with B and with B + N messages after the same start-up; the difference divided by N is the count per
message, start-up and shut-down cancelled out.  Two runs of the same tree agree to within ~500 instructions
per message, 0.1 % (of ~386,000 at level 1), on a quiet machine; on stop 43's (noisy) one the same tree's
level-2, 3-hop count moved by up to 2.7 % between runs, so give the base tree twice (`--tree base --tree new
--tree base --tree new`: each is measured) and read the difference against that spread.  Run it on a quiet
machine all the same: under valgrind a message takes ~50x longer, and the brokers' timers fire per second of wall
time, so a machine busy with something else adds timer work to every message (a level-2, 3-hop count came out
5.7 % high beside a running test suite, and 2.9 % low against the same base once the machine was quiet).

`client` counts the other end: bench_client.py's publishing and subscribing `Client`s (one PUBLISH per
message, the next once the last is acknowledged and delivered), with the broker in a child process that
callgrind does not follow.  Two runs of one tree agree to ~0.4 % (of ~194,000).  `client-batched` is the same
with the client's batching on: with `--window W` the W publishes of a turn leave as one batched PUBLISH, the
path of bench_pubsub.py's batched row.

With `--tree` given more than once the trees are measured in the same run and compared with the first (a base
worktree: `git worktree add /tmp/base REV`).  Each tree runs with its own directory on PYTHONPATH and this
checkout's interpreter.

What the count weighs differently from time: a memset or memcpy is counted per iteration of its string
instruction, so code that clears or copies buffers (msgpack's unpack context: ~13,000 instructions for one
`unpackb` of a 55-byte ACK, 0.56 µs) weighs more in instructions than in seconds, and a cache miss or a branch
mispredicted weighs nothing.  Use it to compare two versions of the same path, not as a time.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
# client, client-batched: bench_client.py, the client library with the broker untraced
CONFIGS = ("l1", "l2", "l2far", "client", "client-batched")
_IREFS = re.compile(r"I\s+refs:\s+([\d,]+)")


class CountFailed(RuntimeError):
    """A run under valgrind did not end cleanly or printed no instruction count."""


@dataclass(frozen=True)
class Row:
    tree: str
    commit: str
    config: str
    per_message: float


def count(tree: Path, config: str, messages: int, window: int) -> int:
    """Instructions executed by one run of `messages` messages in `tree`: bench_broker.py (the brokers and raw
    clients in one process), or for `client` bench_client.py (two Clients; the broker is a child process, which
    callgrind does not follow)."""
    env = dict(os.environ, OPENBLAS_NUM_THREADS="1", PYTHONHASHSEED="0", PYTHONPATH=str(tree))
    if config == "client":
        script, args = "bench_client.py", ["--window", str(window), "--unbatched"]
    elif config == "client-batched":
        script, args = "bench_client.py", ["--window", str(window)]
    else:
        script, args = "bench_broker.py", ["--configs", config, "--window", str(window)]
    cmd = [
        "valgrind", "--tool=callgrind", "--callgrind-out-file=/dev/null",
        sys.executable, str(tree / "benchmarks" / script), "--messages", str(messages), *args,
    ]  # fmt: skip
    proc = subprocess.run(cmd, cwd=tree, env=env, capture_output=True, text=True, timeout=1800)
    m = _IREFS.search(proc.stderr)
    if proc.returncode != 0 or m is None:
        last = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        raise CountFailed(f"{config} in {tree} (exit {proc.returncode}): {last}")
    return int(m.group(1).replace(",", ""))


def commit_of(tree: Path) -> str:
    out = subprocess.run(["git", "-C", str(tree), "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    dirty = subprocess.run(["git", "-C", str(tree), "status", "--porcelain", "--untracked-files=no"],
                           capture_output=True, text=True).stdout.strip()  # fmt: skip
    return (out.stdout.strip() or "?") + ("+changes" if dirty else "")


def main() -> int:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    p.add_argument("--configs", default="l1,l2", help=f"subset of {','.join(CONFIGS)} (default l1,l2)")
    p.add_argument("--messages", type=int, default=2000, help="N: the messages the count is per (default 2000)")
    p.add_argument("--base", type=int, default=2000, help="B: messages of the shorter run (default 2000)")
    p.add_argument("--window", type=int, default=1, help="PUBLISH frames written at once (default 1)")
    p.add_argument("--tree", action="append", type=Path, help="a checkout to measure (repeatable; default this one)")
    args = p.parse_args()
    configs = args.configs.split(",")
    bad = [c for c in configs if c not in CONFIGS]
    if bad:
        print(f"error: unknown configuration {bad[0]!r}; choose from {', '.join(CONFIGS)}", file=sys.stderr)
        return 2
    if args.messages < 1 or args.base < 1:
        print("error: --messages and --base must be at least 1", file=sys.stderr)
        return 2
    trees = [t.resolve() for t in (args.tree or [HERE.parent])]
    for t in trees:
        for script in {"bench_client.py" if c == "client" else "bench_broker.py" for c in configs}:
            if not (t / "benchmarks" / script).is_file():
                print(f"error: {t} has no benchmarks/{script}: pass a checkout of this project (for an older "
                      "commit, copy the script into its worktree)", file=sys.stderr)  # fmt: skip
                return 2
    if shutil.which("valgrind") is None:
        print("error: valgrind is not installed (apt-get install valgrind)", file=sys.stderr)
        return 1
    # A tree given twice is measured twice (its i tells the runs apart): how far two runs of one tree differ is
    # the noise to judge a comparison by.
    jobs = [(i, c, n) for i in range(len(trees)) for c in configs for n in (args.base, args.base + args.messages)]
    try:
        # Two at a time (one per core): a count does not depend on what runs beside it.
        with ThreadPoolExecutor(max_workers=2) as pool:
            counts = dict(zip(jobs, pool.map(lambda j: count(trees[j[0]], j[1], j[2], args.window), jobs), strict=True))
    except (CountFailed, subprocess.TimeoutExpired) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    hi = args.base + args.messages
    rows = [
        Row(str(t), commit_of(t), c, (counts[(i, c, hi)] - counts[(i, c, args.base)]) / args.messages)
        for i, t in enumerate(trees)
        for c in configs
    ]
    first = {r.config: r.per_message for r in rows[: len(configs)]}
    print(f"Instructions per message, {args.base} and {args.base + args.messages} messages, window {args.window}:\n")
    print("| tree | commit | configuration | instructions per message | vs first tree |")
    print("|---|---|---|---:|---:|")
    for r in rows:
        print(f"| {r.tree} | {r.commit} | {r.config} | {r.per_message:,.0f} | {r.per_message / first[r.config]:.3f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
