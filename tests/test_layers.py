"""The layering contract of pyproject.toml ([tool.importlinter]) holds, and it would catch an upward import."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("overlay", "net", "broker", "client", "sim", "analysis", "cli")
LINT = Path(sys.executable).with_name("lint-imports")


def _lint(root: Path) -> subprocess.CompletedProcess[str]:
    # lint-imports finds the packages on sys.path: the checkout it is pointed at comes first.
    return subprocess.run(
        [str(LINT), "--config", str(root / "pyproject.toml"), "--no-cache"],
        cwd=root,
        env={"PYTHONPATH": str(root), "PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def test_layers_point_down() -> None:
    res = _lint(ROOT)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "1 kept, 0 broken" in res.stdout


@pytest.mark.parametrize(
    ("module", "upward"),
    [
        ("overlay/geometry.py", "import broker.store"),
        ("broker/store.py", "from client import client"),
        ("analysis/quantiles.py", "import broker.acl"),
        ("client/admin.py", "import cli.main"),
    ],
)
def test_an_upward_import_breaks_the_contract(tmp_path: Path, module: str, upward: str) -> None:
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    for pkg in PACKAGES:
        shutil.copytree(ROOT / pkg, tmp_path / pkg, ignore=shutil.ignore_patterns("__pycache__"))
    target = tmp_path / module
    target.write_text(target.read_text() + f"\n{upward}  # noqa\n")
    res = _lint(tmp_path)
    assert res.returncode == 1, res.stdout + res.stderr
    assert "BROKEN" in res.stdout or "broken" in res.stdout
