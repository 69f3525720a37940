"""The `sedax` command: one entry point, one subcommand per job.

Subcommands live beside what they drive (`client/cli_overlay.py`, `client/cli_pubsub.py`, `overlay/sim/cli.py`,
`client/cli_analysis.py`, `client/cli_certs.py`, `client/demo.py`); this module only assembles them, so
`sedax --help` stays cheap.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Sequence

from client import cli_analysis, cli_balance, cli_certs, cli_overlay, cli_pubsub, demo
from overlay.sim import cli as sim_cli


def build_parser() -> argparse.ArgumentParser:
    """The full argument parser of `sedax`."""
    parser = argparse.ArgumentParser(
        prog="sedax",
        description="SeDAX: a geo-addressed publish/subscribe broker overlay with topic delegation and "
        "distributed load balancing.",
    )
    parser.add_argument(
        "--log-level",
        default=os.environ.get("SEDAX_LOG_LEVEL", "WARNING"),
        help="stderr log level of client commands (brokers log at INFO; default WARNING)",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    demo.register(sub)
    cli_overlay.register(sub)
    cli_pubsub.register(sub)
    cli_balance.register(sub)
    sim_cli.register(sub)
    cli_analysis.register(sub)
    cli_certs.register(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run `sedax` with argv (default: the process arguments); returns the exit code."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command != "broker":
        logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    code: int = args.func(args)
    return code


if __name__ == "__main__":
    sys.exit(main())
