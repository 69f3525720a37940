"""`sedax sim --coords FILE`: the simulator on given node coordinates (a live cluster's), the same in every run."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from cli.sim import main


def _write(path: Path, coords: list[tuple[float, float]]) -> Path:
    path.write_text(json.dumps([list(c) for c in coords]))
    return path


def _run(argv: list[str], capsys: pytest.CaptureFixture[str]) -> dict[str, object]:
    assert main([*argv, "--json"]) == 0
    out: dict[str, object] = json.loads(capsys.readouterr().out)
    return out


def test_static_runs_on_the_given_coordinates(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rng = np.random.default_rng(9)
    coords = [(float(x), float(y)) for x, y in rng.random((15, 2))]
    path = _write(tmp_path / "coords.json", coords)
    argv = ["sim", "static", "--coords", str(path), "--topics-per-node", "4", "--balance", "addition",
            "--selection", "bestlocal", "--queries", "3"]  # fmt: skip
    one = _run([*argv, "--seed", "1"], capsys)
    two = _run([*argv, "--seed", "2"], capsys)
    # The cells are the coordinates' own (the topics differ by seed, the nodes do not); --nodes follows the file.
    assert one["cell_area"] == two["cell_area"]
    assert one["L3"] != two["L3"]
    assert one["config"]["nodes"] == 15 and one["config"]["coords"] == str(path)  # type: ignore[index]
    uniform = _run(["sim", "static", "--nodes", "15", "--topics-per-node", "4", "--seed", "1"], capsys)
    assert uniform["cell_area"] != one["cell_area"]


def test_growth_takes_coordinates_too(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "coords.txt"
    path.write_text("# x,y\n0.1,0.1\n0.9,0.2\n0.5,0.8\n0.4,0.4\n")
    res = _run(["sim", "growth", "--coords", str(path), "--topics-per-node", "3", "--delta-tau", "0.25"], capsys)
    assert res["config"]["nodes"] == 4  # type: ignore[index]


@pytest.mark.parametrize(
    ("text", "message"),
    [("0.5,0.5\n1.5,0.5\n", "outside the unit square"), ("0.5,0.5\n0.5,0.5\n", "share a coordinate"), ("", "no coord")],
)
def test_unusable_coordinates_exit_2(
    tmp_path: Path, text: str, message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "coords.txt"
    path.write_text(text)
    with pytest.raises(SystemExit) as exc:
        main(["sim", "static", "--coords", str(path), "--topics-per-node", "2"])
    assert exc.value.code == 2
    assert message in capsys.readouterr().err
