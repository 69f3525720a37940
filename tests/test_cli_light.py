"""Client commands of `sedax` parse without importing numpy or scipy (container health checks run them often)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from cli import main as cli

PROBE = """
import sys
from cli import main as cli
argv = sys.argv[1:]
cli.build_parser(light=cli._command(argv) in cli.LIGHT_COMMANDS).parse_args(argv)
heavy = sorted(m for m in ("numpy", "scipy") if m in sys.modules)
print(",".join(heavy) or "none")
"""


@pytest.mark.parametrize(
    "argv",
    [
        ["status", "--broker", "b1:7000", "--json"],
        ["--log-level", "INFO", "pub", "grid/x", "1", "--broker", "b1:7000"],
        ["sub", "grid/x", "--broker", "b1:7000", "--count", "3"],
        ["locate", "grid/x", "--broker", "b1:7000", "--json"],
    ],
)
def test_client_commands_do_not_import_numpy(argv: list[str]) -> None:
    r = subprocess.run([sys.executable, "-c", PROBE, *argv], capture_output=True, text=True, timeout=120, check=False)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "none", f"{argv[0]} imported {r.stdout.strip()}"


def test_command_detection() -> None:
    assert cli._command(["status", "--broker", "x:1"]) == "status"
    assert cli._command(["--log-level", "DEBUG", "sub", "t"]) == "sub"
    assert cli._command(["--log-level=DEBUG", "locate", "t"]) == "locate"
    assert cli._command(["--help"]) is None
    assert cli._command([]) is None


def test_full_parser_still_has_every_command() -> None:
    parser = cli.build_parser()
    args = parser.parse_args(["sim", "static", "--nodes", "10"])
    assert args.command == "sim"
    with pytest.raises(SystemExit):
        cli.build_parser(light=True).parse_args(["sim", "static"])
