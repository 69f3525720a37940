"""The argument pieces every `sedax` subcommand shares: broker addresses, credentials, numbers, coordinates.

One home for them, so `--broker`, `--timeout` and the credential flags mean the same on every subcommand and a
bad value is an argparse usage error (exit 2, one line naming the fix) before anything connects.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import math
import os
import sys
import time
from collections.abc import Callable
from typing import Final, NoReturn, TypeVar

from broker.flags import EXIT_USAGE as EXIT_USAGE  # (cli.args is where subcommands take their exit codes)
from net.credentials import Credentials, CredentialsError, add_credential_flags, credentials_from_args

T = TypeVar("T")

EXIT_FAILED: Final = 1  # the overlay refused or did not answer, or a file could not be read
ENV_BROKERS: Final = "SEDAX_BROKERS"


class UsageError(ValueError):
    """A value on the command line (or in the environment it stands for) is wrong; exit 2."""


def fail(msg: str, code: int = EXIT_FAILED) -> int:
    """Print one `sedax: error:` line and return the exit code."""
    print(f"sedax: error: {msg}", file=sys.stderr)
    return code


def die(msg: str, code: int) -> NoReturn:
    """fail() and exit at once (for errors found outside a subcommand's own flow)."""
    raise SystemExit(fail(msg, code))


def address(text: str) -> str:
    """HOST:PORT with a port in 1..65535 (argparse type)."""
    host, sep, port = text.strip().rpartition(":")
    if not sep or not host:
        raise argparse.ArgumentTypeError(f"a broker address is HOST:PORT, as in 127.0.0.1:7000; got {text!r}")
    try:
        number = int(port)
    except ValueError:
        raise argparse.ArgumentTypeError(f"the port of {text!r} must be a number 1-65535") from None
    if not 1 <= number <= 65535:
        raise argparse.ArgumentTypeError(f"the port of {text!r} must be 1-65535")
    return f"{host}:{number}"


def _parsed(text: str, convert: Callable[[str], T], ok: Callable[[T], bool], expected: str) -> T:
    """text converted and checked, or argparse's usage error naming what was expected."""
    try:
        value = convert(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected {expected}, got {text!r}") from None
    if not ok(value):
        raise argparse.ArgumentTypeError(f"expected {expected}, got {text!r}")
    return value


def seconds(text: str) -> float:
    """A positive, finite number of seconds (argparse type)."""
    return _parsed(text, float, lambda v: math.isfinite(v) and v > 0, "a positive number of seconds")


# `--since 10m`: a span back from now, in the units journalctl and Prometheus take.
_SPAN_UNITS: Final = {"s": 1, "m": 60, "h": 3600, "d": 86400}


def timestamp(text: str, now: float | None = None) -> float:
    """A point in time (argparse type): a Unix timestamp >= 0 as `sedax sub --json` prints it, a span back from
    now (`90s`, `10m`, `2h`, `1d`), or an ISO 8601 date and time (`2026-11-29T09:00`, local time unless it
    names a zone such as `Z` or `+01:00`)."""
    text = text.strip()
    now = time.time() if now is None else now
    unit = _SPAN_UNITS.get(text[-1:])
    if unit is not None:
        try:
            span = float(text[:-1]) * unit
        except ValueError:
            span = math.nan
        if math.isfinite(span) and span >= 0:
            return max(0.0, now - span)
    else:
        try:
            value = float(text)
        except ValueError:
            value = math.nan
            with contextlib.suppress(ValueError):
                value = datetime.datetime.fromisoformat(text).timestamp()  # (naive: local time, as `date` reads it)
        if math.isfinite(value) and value >= 0:
            return value
    raise argparse.ArgumentTypeError(
        f"a time is a Unix timestamp (0: everything stored), a span back from now such as 10m, 2h or 1d, or an ISO "
        f"date and time such as 2026-11-29T09:00; got {text!r}"
    )


def positive_int(text: str) -> int:
    """An integer >= 1 (argparse type)."""
    return _parsed(text, int, lambda v: v >= 1, "a whole number >= 1")


def rate(text: str) -> float:
    """Messages per second: positive and finite (argparse type)."""
    return _parsed(text, float, lambda v: math.isfinite(v) and v > 0, "a positive rate (messages per second)")


# Coordinates outside this box cannot be in any space a broker accepts; refusing them here gives a clear
# message instead of a route that goes nowhere.
COORD_LIMIT: Final = 1e6


def parse_xy(text: str) -> tuple[float, float]:
    """X,Y as two finite numbers (kept free of overlay.geometry, and so of scipy); ValueError if not."""
    parts = text.split(",")
    if len(parts) != 2:
        raise ValueError(f"a coordinate is written X,Y, as in 0.5,0.25; got {text!r}")
    try:
        x, y = float(parts[0]), float(parts[1])
    except ValueError:
        raise ValueError(f"a coordinate is two numbers X,Y, as in 0.5,0.25; got {text!r}") from None
    if not (math.isfinite(x) and math.isfinite(y)) or max(abs(x), abs(y)) > COORD_LIMIT:
        raise ValueError(f"a coordinate must be two finite numbers within ±{COORD_LIMIT:g}, got {text!r}")
    return (x, y)


def coordinate(text: str) -> tuple[float, float]:
    """X,Y (argparse type)."""
    try:
        return parse_xy(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def add_broker_flag(p: argparse.ArgumentParser, *, what: str = "access broker") -> None:
    """--broker HOST:PORT (repeatable, comma-separated; default $SEDAX_BROKERS) and the credential flags."""
    p.add_argument(
        "--broker",
        action="append",
        metavar="HOST:PORT",
        help=f"{what}; repeat or comma-separate for fail-over (default: ${ENV_BROKERS})",
    )
    add_credential_flags(p)


def brokers(args: argparse.Namespace) -> list[str]:
    """The broker list from --broker (repeatable, comma-separated) or $SEDAX_BROKERS; UsageError if none/bad."""
    raw = args.broker or [os.environ.get(ENV_BROKERS, "")]
    out: list[str] = []
    for item in (a.strip() for v in raw for a in v.split(",")):
        if not item:
            continue
        try:
            out.append(address(item))
        except argparse.ArgumentTypeError as exc:
            source = "--broker" if args.broker else f"${ENV_BROKERS}"
            raise UsageError(f"{source}: {exc}") from None
    if not out:
        raise UsageError(f"give --broker HOST:PORT (or set {ENV_BROKERS})")
    return out


def target(args: argparse.Namespace) -> tuple[list[str], Credentials]:
    """The brokers and the credentials a command connects with (UsageError if either is wrong)."""
    return brokers(args), credentials(args)


def credentials(args: argparse.Namespace) -> Credentials:
    """The credentials of the flags over the environment, with their files loaded now (UsageError if unusable)."""
    try:
        creds = credentials_from_args(args)
        creds.ssl_context()  # loads and checks the CA, certificate and key: a bad file is a usage error
    except CredentialsError as exc:
        raise UsageError(str(exc)) from None
    return creds
