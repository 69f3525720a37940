"""The `sedax` command: one entry point, one subcommand per job.

Subcommands live beside what they drive (`cli/overlay.py`, `cli/pubsub.py`, `cli/sim.py`,
`cli/analysis.py`, `cli/certs.py`, `cli/demo.py`); this module only assembles them, so
`sedax --help` stays cheap.
"""

from __future__ import annotations

import argparse
import logging
import os
import select
import signal
import sys
import threading
from collections.abc import Sequence

from broker.flags import Parser
from broker.version import VERSION
from cli import analysis as cli_analysis
from cli import brokers as cli_brokers
from cli import certs as cli_certs
from cli import completion as cli_completion
from cli import demo
from cli import overlay as cli_overlay
from cli import pubsub as cli_pubsub
from cli import topics as cli_topics
from cli.signals import ENDING_SIGNALS, Terminated, terminated
from client.errors import describe

# Subcommands whose modules import neither numpy nor scipy.  For them the parsers of `sim` and of
# `load`/`move`/`balance` (whose modules import both, ~1 s of CPU) are left out, so `sedax status` as a
# container health check and `sedax pub`/`sub` start in a fraction of the time.
LIGHT_COMMANDS = frozenset({"status", "route", "pub", "sub", "locate", "broker", "cluster", "topics", "brokers"})


class _HandledInterrupt(logging.Filter):
    """Drops asyncio's "Task exception was never retrieved" for a Terminated or KeyboardInterrupt.  Raised by a
    signal inside a task's step (the handler runs wherever the main thread is), it is set on that task and also
    propagates out of asyncio.run, where `_run` reports it in one line; the task, collected later, would log it
    again, traceback and all."""

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        return not isinstance(exc, KeyboardInterrupt)  # (Terminated is one)


class _Version(argparse.Action):
    """`sedax --version`: the release, and what decides whether it can be rolled into a running overlay one
    broker at a time (docs/deploy.md, "A rolling upgrade"): brokers admit only brokers of their own wire protocol
    version, and a release reads the storage formats up to its own.  The storage module is imported only here
    (0.1 s that no other command pays)."""

    def __init__(self, option_strings: list[str], dest: str, help: str | None = None) -> None:
        # As argparse's own version action: no attribute in the namespace of the commands that do run.
        super().__init__(option_strings, argparse.SUPPRESS, nargs=0, default=argparse.SUPPRESS, help=help)

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: object,
        option_string: str | None = None,
    ) -> None:
        from broker.storage import STORAGE_FORMAT
        from overlay.protocol import OLDEST_CLIENT_VERSION, PROTOCOL_VERSION

        print(
            f"sedax {VERSION} (wire protocol {PROTOCOL_VERSION}: brokers of {PROTOCOL_VERSION}, clients of "
            f"{OLDEST_CLIENT_VERSION}-{PROTOCOL_VERSION}; storage format {STORAGE_FORMAT})"
        )
        parser.exit(0)


def build_parser(*, light: bool = False) -> argparse.ArgumentParser:
    """The argument parser of `sedax`; light leaves out sim, load, move and balance (numpy and scipy)."""
    parser: argparse.ArgumentParser = Parser(
        prog="sedax",
        description="SeDAX: a geo-addressed publish/subscribe broker overlay with topic delegation and "
        "distributed load balancing.",
    )
    parser.add_argument(
        "--version",
        action=_Version,
        help="show the release, the wire protocol and the storage format it speaks, and exit",
    )
    parser.add_argument(
        "--log-level",
        type=_log_level,
        default=os.environ.get("SEDAX_LOG_LEVEL", "WARNING"),
        help="stderr log level of client commands: DEBUG, INFO, WARNING or ERROR (brokers log at INFO; "
        "default WARNING or $SEDAX_LOG_LEVEL)",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    demo.register(sub)
    cli_overlay.register(sub)
    cli_brokers.register(sub)
    cli_pubsub.register(sub)
    cli_topics.register(sub)
    if not light:
        from cli import balance as cli_balance
        from cli import sim as sim_cli

        cli_balance.register(sub)
        sim_cli.register(sub)
    cli_analysis.register(sub)
    cli_certs.register(sub)
    cli_completion.register(sub)
    return parser


LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")


def _log_level(text: str) -> str:
    level = text.strip().upper()
    if level not in LOG_LEVELS:
        raise argparse.ArgumentTypeError(f"log level must be one of {', '.join(LOG_LEVELS)}, got {text!r}")
    return level


def _command(argv: Sequence[str]) -> str | None:
    """The subcommand named in argv, or None (no command, or only help asked for)."""
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--log-level")
    pre.add_argument("command", nargs="?")
    known, _ = pre.parse_known_args(argv)
    command: str | None = known.command
    return command


def main(argv: Sequence[str] | None = None) -> int:
    """Run `sedax` with argv (default: the process arguments); returns the exit code."""
    argv = list(sys.argv[1:] if argv is None else argv)
    env_level = os.environ.get("SEDAX_LOG_LEVEL")
    if env_level is not None and env_level.strip().upper() not in LOG_LEVELS:
        print(
            f"sedax: error: SEDAX_LOG_LEVEL must be one of {', '.join(LOG_LEVELS)}, got {env_level!r}", file=sys.stderr
        )
        return 2
    parser = build_parser(light=_command(argv) in LIGHT_COMMANDS)
    args = parser.parse_args(argv)
    if args.command != "broker":
        logging.basicConfig(level=args.log_level, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    previous = {}
    # The broker handles these itself (SIGTERM a graceful leave, SIGHUP a reload); signal handlers can only be
    # set in the main thread.
    if args.command != "broker" and threading.current_thread() is threading.main_thread():
        previous = {sig: signal.signal(sig, terminated) for sig in ENDING_SIGNALS}
        asyncio_log = logging.getLogger("asyncio")
        if not any(isinstance(f, _HandledInterrupt) for f in asyncio_log.filters):
            asyncio_log.addFilter(_HandledInterrupt())
    try:
        return _run(args)
    finally:
        for sig, handler in previous.items():
            if handler is not None:  # None: set outside Python, and not restorable from here
                signal.signal(sig, handler)


def _run(args: argparse.Namespace) -> int:
    try:
        code: int = args.func(args)
        # Flushed here, inside the handler: a buffered stdout (not a terminal, no PYTHONUNBUFFERED) would
        # otherwise meet a closed reader only at the interpreter's exit, past the BrokenPipeError case below.
        sys.stdout.flush()
    except Terminated as exc:
        print(f"sedax: stopped by {signal.Signals(exc.signum).name}", file=sys.stderr)
        return 128 + exc.signum  # what a shell reports for a tool ended by that signal
    except KeyboardInterrupt:
        print("sedax: interrupted", file=sys.stderr)
        return 128 + 2  # what a shell reports for a tool ended by SIGINT
    except BrokenPipeError:
        try:
            gone = closed_pipe(sys.stdout.fileno())
        except (OSError, ValueError):  # no file descriptor behind stdout (captured or already closed)
            gone = False
        if not gone:
            raise  # a broker connection broke, not our reader: that error is the user's to see
        # Whoever read our output has gone (`sedax sim ... | head`): stop quietly, as other Unix tools do.
        # stdout now points at /dev/null so that the interpreter's last flush does not raise again.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 128 + 13  # what a shell reports for a tool ended by SIGPIPE
    except MemoryError as exc:
        # Asked for more than the machine holds (a simulation or a load of that size): the size, not sedax.
        print(f"sedax: error: {args.command} ran out of memory ({describe(exc)}): ask for less", file=sys.stderr)
        return 1
    except Exception as exc:
        if args.log_level == "DEBUG":
            raise
        if isinstance(exc, OSError) and exc.filename is not None:
            # A directory that does not exist or may not be written (--state-dir, --dir): the machine, not sedax.
            print(
                f"sedax: error: {args.command}: cannot use {exc.filename}: {exc.strerror or exc}: choose another path",
                file=sys.stderr,
            )
            return 1
        print(
            f"sedax: error: {args.command} failed unexpectedly: {type(exc).__name__}: {exc} "
            "(this is a bug in sedax: please report it with the output of --log-level DEBUG)",
            file=sys.stderr,
        )
        return 1
    return code


def closed_pipe(fd: int) -> bool:
    """Whether fd is a pipe whose reading end is closed (poll reports POLLERR for it on Linux and macOS)."""
    poller = select.poll()
    poller.register(fd, select.POLLOUT)
    return any(events & select.POLLERR for _, events in poller.poll(0))


if __name__ == "__main__":
    sys.exit(main())
