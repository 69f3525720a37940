"""The version of the installed `sedax` package: `sedax --version`, a broker's STATUS and its metrics."""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version
from typing import Final


def _installed() -> str:
    try:
        return version("sedax")
    except PackageNotFoundError:
        return "unknown (not installed)"  # run from a checkout that was never installed


VERSION: Final = _installed()  # (read once: importlib.metadata reads files)
