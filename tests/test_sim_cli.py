"""`sedax sim`: argument errors, the --json shape, determinism, --jobs, --log-dir and --plot."""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from cli.main import closed_pipe
from cli.sim import main

SMALL_STATIC = ["sim", "static", "--nodes", "12", "--topics-per-node", "5", "--seed", "3"]
SMALL_GROWTH = ["sim", "growth", "--nodes", "6", "--topics-per-node", "5", "--delta-tau", "0.1", "--seed", "3"]


def run_json(argv: list[str], capsys: pytest.CaptureFixture[str]) -> dict[str, object]:
    assert main([*argv, "--json"]) == 0
    out = capsys.readouterr().out
    assert out.count("\n") == 1  # exactly one JSON object, nothing else on stdout
    result: dict[str, object] = json.loads(out)
    return result


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["sim", "static", "--nodes", "0"], "--nodes"),
        (["sim", "static", "--runs", "0"], "--runs"),
        (["sim", "static", "--topics-per-node", "-1"], "--topics-per-node"),
        (["sim", "static", "--balance", "addition", "--selection", "bestlocal", "--queries", "0"], "--queries"),
        (["sim", "static", "--jobs", "0"], "--jobs"),
        (["sim", "static", "--goal", "L2"], "--goal needs balancing"),
        (["sim", "static", "--selection", "indcoord"], "--selection needs balancing"),
        (["sim", "static", "--balance", "addition", "--goal", "L4"], "--goal"),
        (["sim", "static", "--balance", "addition", "--selection", "bestlocal", "--hops", "2"], "bestregional"),
        (["sim", "static", "--balance", "addition", "--selection", "bestglobal", "--queries", "5"], "bestglobal"),
        (["sim", "static", "--balance", "continuous"], "--balance"),
        (["sim", "static", "--ties", "first"], "--ties needs balancing"),
        (["sim", "static", "--balance", "addition", "--ties", "lowest"], "--ties"),
        (["sim", "growth", "--delta-tau", "0"], "--delta-tau"),
        (["sim", "growth", "--delta-tau", "1.5"], "--delta-tau"),
        (["sim", "growth", "--delta-tau", "0.3"], "divide"),
        (["sim", "growth", "--lmax", "0.5"], "--lmax"),
        (["sim", "growth", "--nodes", "x"], "--nodes"),
        (["sim", "growth", "--scan", "3"], "--scan applies to continuous"),
        (["sim", "growth", "--balance", "addition", "--scan", "3"], "--scan applies to continuous"),
        (["sim", "growth", "--balance", "combined", "--scan", "0"], "--scan"),
    ],
)
def test_impossible_arguments_exit_2(argv: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


def test_static_json_shape(capsys: pytest.CaptureFixture[str]) -> None:
    res = run_json([*SMALL_STATIC, "--runs", "2"], capsys)
    for key in ("L1", "L2", "L3", "cell_area"):
        q = res[key]
        assert isinstance(q, dict)
        assert set(q) == {"q5", "mean", "q95"}
        assert q["q5"] <= q["mean"] <= q["q95"]
    corr = res["correlation"]
    assert isinstance(corr, dict)
    assert set(corr) == {"L1", "L2", "L3"}
    assert "eq11_violations" not in res  # only for BestGlobalCoord with goal L3
    assert res["runs"] == 2


def test_growth_json_shape(capsys: pytest.CaptureFixture[str]) -> None:
    res = run_json([*SMALL_GROWTH, "--balance", "combined"], capsys)
    for phase in ("before", "after"):
        levels = res[phase]
        assert isinstance(levels, dict)
        assert set(levels) == {"L1", "L2", "L3"}
    assert res["L3"] == res["after"]["L3"]  # type: ignore[index]
    moved = res["moved"]
    assert isinstance(moved, dict)
    assert len(moved["tau"]) == 11 and moved["tau"][-1] == 1.0
    assert len(moved["v_ml"]) == len(moved["v_ml_cum"]) == len(moved["r_ml"]) == 10
    assert set(moved["q95"]) == {"L1", "L2", "L3"} and len(moved["q95"]["L3"]) == 11
    assert res["eq11_violations"] == 0  # the default addition is BestGlobalCoord for goal L3


def test_same_seed_same_result_and_jobs_do_not_matter(capsys: pytest.CaptureFixture[str]) -> None:
    argv = [*SMALL_STATIC, "--runs", "3", "--balance", "addition", "--selection", "bestlocal", "--queries", "2"]
    one = run_json(argv, capsys)
    again = run_json(argv, capsys)
    two = run_json([*argv, "--jobs", "2"], capsys)
    assert one == again == two
    other = run_json([*argv[:-6], "--seed", "4", *argv[-6:]], capsys)
    assert other != one


def test_unbalanced_l1_and_l2_means_are_exact(capsys: pytest.CaptureFixture[str]) -> None:
    # Every topic is on exactly one N1 and one N2, so the means are 100% and 200% whatever the seed.
    for loads in ("homogeneous", "heterogeneous", "exponential"):
        res = run_json([*SMALL_STATIC, "--runs", "3", "--loads", loads], capsys)
        assert res["L1"]["mean"] == pytest.approx(100.0, abs=1e-9)  # type: ignore[index]
        assert res["L2"]["mean"] == pytest.approx(200.0, abs=1e-9)  # type: ignore[index]


def test_balanced_addition_checks_eq11_and_lowers_q95(capsys: pytest.CaptureFixture[str]) -> None:
    base = ["sim", "static", "--nodes", "15", "--topics-per-node", "10", "--loads", "heterogeneous", "--runs", "2"]
    plain = run_json(base, capsys)
    balanced = run_json([*base, "--balance", "addition", "--selection", "bestglobal", "--goal", "L3"], capsys)
    assert balanced["eq11_violations"] == 0
    assert balanced["L3"]["q95"] < plain["L3"]["q95"]  # type: ignore[index]
    assert balanced["cell_area"] == plain["cell_area"]  # same seed, same overlay


def test_continuous_balancing_lowers_final_q95(capsys: pytest.CaptureFixture[str]) -> None:
    base = ["sim", "growth", "--runs", "4", "--seed", "11", "--delta-tau", "0.01"]
    plain = run_json(base, capsys)
    balanced = run_json([*base, "--balance", "continuous"], capsys)
    assert balanced["L3"]["q95"] < plain["L3"]["q95"]  # type: ignore[index]
    assert balanced["before"] == plain["before"]  # balancing starts only after the addition
    # Going on to the next-smallest topic when the smallest cannot move moves more and balances better.
    scanning = run_json([*base, "--balance", "continuous", "--scan", "50"], capsys)
    moved, scan_moved = balanced["moved"], scanning["moved"]
    assert isinstance(moved, dict) and isinstance(scan_moved, dict)
    assert scan_moved["moves_mean"] > moved["moves_mean"]
    assert scanning["L3"]["q95"] < balanced["L3"]["q95"]  # type: ignore[index]
    assert scanning["config"]["scan"] == 50 and balanced["config"]["scan"] == 1  # type: ignore[index]


REQUIRED = {"schema": int, "type": str, "run": str, "source": str, "ts": float, "step": int, "node": str}
SNAPSHOT = {"coord": list, "loads": dict, "unit": str, "cell_area": float, "neighbours": list}
EVENT = {"event": str, "topic": str, "load": float, "from": list, "to": list}


def read_records(directory: Path) -> list[dict[str, object]]:
    files = sorted(directory.glob("*.jsonl"))
    assert files
    return [json.loads(line) for f in files for line in f.read_text(encoding="utf-8").splitlines()]


def check_schema(rec: dict[str, object]) -> None:
    fields = {**REQUIRED, **(SNAPSHOT if rec["type"] == "snapshot" else EVENT)}
    for name, typ in fields.items():
        assert isinstance(rec[name], typ), (name, rec)
    assert rec["schema"] == 1 and rec["source"] == "sim"


def test_static_log_dir_writes_schema_1(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    argv = [*SMALL_STATIC, "--runs", "2", "--balance", "addition", "--log-dir", str(tmp_path)]
    run_json(argv, capsys)
    assert (tmp_path / "sim-static-3.jsonl").exists()
    recs = read_records(tmp_path)
    for r in recs:
        check_schema(r)
    snaps = [r for r in recs if r["type"] == "snapshot"]
    assert len(snaps) == 2 * 12 and {r["run"] for r in snaps} == {"static-seed3", "static-seed4"}
    assert all(r["unit"] == "topic" and r["step"] == 0 for r in snaps)
    for run in ("static-seed3", "static-seed4"):
        total = sum(r["loads"]["L1"] for r in snaps if r["run"] == run)  # type: ignore[index]
        assert total == pytest.approx(12 * 5)  # homogeneous: the total topic load
        assert sum(r["cell_area"] for r in snaps if r["run"] == run) == pytest.approx(1.0)  # type: ignore[misc]
    assert all(r["event"] == "delegation" for r in recs if r["type"] == "event")


def test_growth_log_dir_and_moved_load(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    res = run_json([*SMALL_GROWTH, "--balance", "continuous", "--log-dir", str(tmp_path)], capsys)
    recs = read_records(tmp_path)
    for r in recs:
        check_schema(r)
    snaps = [r for r in recs if r["type"] == "snapshot"]
    assert len(snaps) == 6 * 11  # every node at τ = 0, 0.1, .., 1
    assert sorted({r["step"] for r in snaps}) == list(range(11))  # type: ignore[type-var]
    moves = [r for r in recs if r["type"] == "event"]
    assert all(r["event"] == "move" for r in moves)
    moved = res["moved"]
    assert isinstance(moved, dict)
    # eq. (13): V_ML summed over the run is the summed load of the moved topics
    assert sum(moved["v_ml"]) == pytest.approx(sum(r["load"] for r in moves))  # type: ignore[misc]
    last = [r for r in snaps if r["step"] == 10]
    assert sum(r["counters"]["moved_load"] for r in last) == pytest.approx(sum(moved["v_ml"]))  # type: ignore[index]


def test_log_rotation(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run_json([*SMALL_STATIC, "--runs", "2", "--log-dir", str(tmp_path), "--log-max-bytes", "2000"], capsys)
    names = sorted(p.name for p in tmp_path.iterdir())
    assert "sim-static-3.jsonl" in names and "sim-static-3.1.jsonl" in names
    assert all((tmp_path / n).stat().st_size <= 2000 for n in names)


def test_plots(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("matplotlib")
    run_json([*SMALL_STATIC, "--plot", str(tmp_path / "ccdf.png")], capsys)
    run_json([*SMALL_GROWTH, "--balance", "combined", "--plot", str(tmp_path / "growth.png")], capsys)
    for name in ("ccdf.png", "growth.png"):
        assert (tmp_path / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_text_output(capsys: pytest.CaptureFixture[str]) -> None:
    assert main([*SMALL_STATIC, "--balance", "addition"]) == 0
    out = capsys.readouterr().out
    assert "L3" in out and "cell_area" in out and "eq. (11) violations: 0" in out


def test_readme_sim_commands_run(capsys: pytest.CaptureFixture[str]) -> None:
    # The experiment commands users copy from the README must at least run (with one run each, to stay quick).
    text = (Path(__file__).resolve().parent.parent / "README.md").read_text(encoding="utf-8")
    commands = [
        shlex.split(line.split("sedax ", 1)[1])
        for line in text.replace("\\\n", " ").splitlines()
        if line.startswith(".venv/bin/sedax sim ")
    ]
    assert len(commands) >= 3
    for argv in commands:
        if "--runs" in argv:
            argv[argv.index("--runs") + 1] = "1"
        assert "--json" in argv
        result = run_json(argv, capsys)
        assert result["runs"] == 1, argv


def test_closed_stdout_ends_quietly() -> None:
    """`sedax sim ... | head` must not end in a traceback when the reader goes away before the JSON is written."""
    argv = [sys.executable, "-m", "cli.sim", *SMALL_STATIC, "--runs", "2", "--json"]
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert proc.stdout is not None and proc.stderr is not None
    proc.stdout.close()  # the reader is gone before anything is written
    err = proc.stderr.read().decode()
    proc.stderr.close()
    assert proc.wait(timeout=120) == 141, err
    assert "Traceback" not in err


def test_closed_pipe_detects_a_reader_that_left() -> None:
    r, w = os.pipe()
    try:
        assert not closed_pipe(w)
        os.close(r)
        assert closed_pipe(w)
    finally:
        os.close(w)
