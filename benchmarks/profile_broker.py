"""Run one broker under cProfile, profiling only a window of its life (not a test; used by bench_idle.py).

    .venv/bin/python benchmarks/profile_broker.py OUT.prof DELAY SECONDS -- BROKER FLAGS...

The broker starts and joins as `python -m broker` would (uvloop), the profiler is switched on DELAY seconds
after the start and off SECONDS later, the statistics go to OUT.prof (`python -m pstats OUT.prof`), and the
broker goes on until SIGTERM.  Profiling only the window keeps start-up and joining out of the picture.
"""

from __future__ import annotations

import asyncio
import cProfile
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import uvloop

from broker.config import ConfigError, add_broker_arguments, config_from_args
from broker.main import serve


async def profiled(out: str, delay: float, seconds: float, argv: list[str]) -> int:
    import argparse

    parser = argparse.ArgumentParser(prog="profile_broker")
    add_broker_arguments(parser)
    try:
        config = config_from_args(parser.parse_args(argv))
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    prof = cProfile.Profile()

    async def window() -> None:
        await asyncio.sleep(delay)
        prof.enable()
        await asyncio.sleep(seconds)
        prof.disable()
        prof.dump_stats(out)
        print(f"profile written to {out}", file=sys.stderr, flush=True)

    task = asyncio.ensure_future(window())
    try:
        return await serve(config)
    finally:
        task.cancel()


USAGE = "usage: profile_broker.py OUT.prof DELAY SECONDS -- BROKER FLAGS..."


def main() -> int:
    args = sys.argv[1:]
    if args[:1] in (["-h"], ["--help"]):
        print(__doc__)
        return 0
    if len(args) < 4 or args[3] != "--":
        print(
            f"profile_broker: expected an output file, a delay and a window in seconds, then '--'; {USAGE}",
            file=sys.stderr,
        )
        return 2
    out, delay, seconds, _, *rest = args
    try:
        window = float(delay), float(seconds)
    except ValueError:
        print(
            f"profile_broker: DELAY and SECONDS are numbers of seconds, got {delay!r} {seconds!r}; {USAGE}",
            file=sys.stderr,
        )
        return 2
    return uvloop.run(profiled(out, *window, rest))


if __name__ == "__main__":
    sys.exit(main())
