"""What the benchmark drivers share: their workers as child processes, the machine's load, the code they measured
and the results section of a docs page.

Each driver (bench_pubsub, bench_storage, bench_latency, bench_fanin, bench_tls) runs its publishers and
subscribers as copies of its own script (`script --worker SPEC`), so that the workers' CPU and scheduling are
their own and not the driver's; these helpers are the one place that spawns them and reports around them.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import pstats
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final

if TYPE_CHECKING:
    import cProfile

    from client.client import Client, Subscription

_ROOT: Final = Path(__file__).resolve().parent.parent

# The sources whose uncommitted changes a report names beside the commit (what the brokers and clients run).
_MEASURED: Final = ("broker", "client", "overlay", "net")


def cpu_seconds(*pids: int) -> float:
    """User + system CPU seconds the processes pids have used so far, summed (from /proc; a process gone counts 0)."""
    tick = os.sysconf("SC_CLK_TCK")
    total = 0.0
    for pid in pids:
        with contextlib.suppress(OSError):
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            total += (int(fields[11]) + int(fields[12])) / tick  # utime and stime (fields 14 and 15)
    return total


def pct(sorted_vals: Sequence[float], q: float) -> float:
    """The q-quantile of sorted_vals (the value at index floor(q * n)); NaN if there is none."""
    return sorted_vals[min(len(sorted_vals) - 1, int(q * len(sorted_vals)))] if sorted_vals else float("nan")


def program_output(argv: list[str]) -> str:
    """A program's standard output, stripped; "" if it cannot be run or takes over 10 s."""
    try:
        return subprocess.run(argv, capture_output=True, text=True, check=False, timeout=10).stdout.strip()
    except (OSError, subprocess.TimeoutExpired):
        return ""


def uptime() -> str:
    """`uptime`'s line (the load averages a report shows at its start and end); "?" where there is none."""
    return program_output(["uptime"]) or "?"


def code_state() -> str:
    """The commit and the uncommitted SeDAX sources (with their modification times) the run measured."""
    head = program_output(["git", "-C", str(_ROOT), "rev-parse", "--short", "HEAD"])
    if not head:  # an exported tree (git archive): its commit is named where the run is reported
        return "an exported tree, not a git checkout"
    dirty = program_output(["git", "-C", str(_ROOT), "status", "--short", "--", *_MEASURED])
    # (the path after the status letters: program_output strips the first line's leading blank, " M path")
    files = [line.split(None, 1)[1] for line in dirty.splitlines() if line.strip()]
    stamps = [
        f"{f} ({time.strftime('%H:%M:%S', time.gmtime((_ROOT / f).stat().st_mtime))})" if (_ROOT / f).is_file() else f
        for f in files
    ]
    return f"commit {head}" + (f" + uncommitted {', '.join(stamps)}" if stamps else "")


async def spawn_worker(
    script: str,
    spec: Mapping[str, Any],
    err: Path | None = None,
    env: Mapping[str, str | None] | None = None,
) -> asyncio.subprocess.Process:
    """Start `python script --worker JSON(spec)` with this checkout importable, its stdout a pipe (workers
    print a ready line and their results there) and its stderr in err (or inherited). env adds variables to
    the child's environment; a None value removes one."""
    child = dict(os.environ, PYTHONPATH=os.pathsep.join([str(_ROOT), os.environ.get("PYTHONPATH", "")]))
    for key, value in (env or {}).items():
        if value is None:
            child.pop(key, None)
        else:
            child[key] = value
    stderr = err.open("wb") if err is not None else None
    try:
        return await asyncio.create_subprocess_exec(
            sys.executable, script, "--worker", json.dumps(dict(spec)),
            stdout=asyncio.subprocess.PIPE, stderr=stderr, stdin=asyncio.subprocess.DEVNULL, env=child,
        )  # fmt: skip
    finally:
        if stderr is not None:
            stderr.close()  # the child has its own descriptor


def add_sub_iterate(parser: argparse.ArgumentParser) -> None:
    """The `--sub-iterate` flag of the drivers whose SeDAX subscribers take messages by on_message."""
    parser.add_argument(
        "--sub-iterate",
        action="store_true",
        help="the SeDAX subscribers iterate (async for) instead of taking messages by on_message (rounds 1-8)",
    )


async def sedax_consume(
    client: Client,
    topic: str,
    take: Callable[[bytes], None],
    subscribed: Callable[[], None],
    until: Callable[[], Awaitable[None]],
    *,
    iterate: bool = False,
) -> Subscription:
    """A SeDAX worker's subscriber: subscribe to topic, call subscribed(), and hand every payload to take until
    until() returns.  By on_message, as the peers' subscribers take their messages in a callback; with iterate,
    by a task iterating the subscription (`async for`: rounds 1-8, and bench_storage beside JetStream's
    iterating consumer).  Returns the subscription, for its counters."""
    if not iterate:
        sub = await client.subscribe(topic, on_message=lambda m: take(m.payload))
        subscribed()
        await until()
        return sub
    sub = await client.subscribe(topic)
    subscribed()

    async def consume() -> None:
        async for m in sub:
            take(m.payload)

    task = asyncio.create_task(consume())
    try:
        await until()
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
    return sub


RESULTS_PREFIX: Final = "<!-- bench_"


def write_section(path: Path, mark: str, report: str, title: str) -> None:
    """Replace the text between mark and the next results marker (or the end) of path with report, keeping the
    hand-written text around it; a page without mark gets it appended (a new page starts with title)."""
    text = path.read_text() if path.exists() else f"# {title}\n\n"
    if mark not in text:
        text = text.rstrip("\n") + "\n\n" + mark + "\n"
    head, rest = text.split(mark, 1)
    nxt = rest.find(RESULTS_PREFIX, 1)
    tail = rest[nxt:] if nxt >= 0 else ""
    path.write_text(head + mark + "\n\n" + report + ("\n" + tail if tail else ""))


def print_profile(prof: cProfile.Profile, messages: int, top: int) -> None:
    """A cProfile run's `top` costliest functions, and its Python calls per message: what a layer costs is mostly
    how many calls it makes (bench_broker, bench_client)."""
    stats = pstats.Stats(prof)
    stats.sort_stats("tottime").print_stats(top)
    calls = sorted(((v[1] / messages, k) for k, v in stats.stats.items()), reverse=True)  # type: ignore[attr-defined]
    print(f"Python calls per message: {sum(c for c, _ in calls):.0f}; the most frequent:")
    for c, (file, line, func) in calls[:top]:
        print(f"  {c:6.2f}  {Path(file).name}:{line}({func})")
