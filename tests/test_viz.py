"""`sedax viz`: the picture built from logs and from a live overlay (real brokers), as SVG and PNG."""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
from pathlib import Path

import numpy as np
import pytest
from scipy.spatial import Delaunay

from analysis.synth import generate_logs
from analysis.viz import (
    OverlayPicture,
    VizError,
    VizNode,
    draw_svg,
    picture_from_logs,
    picture_from_statuses,
    render,
)
from cli import analysis as cli_analysis
from cli.cluster import LocalCluster
from client.admin import BrokerUnavailable
from client.crawl import crawl

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.fixture
def logs(tmp_path: Path) -> Path:
    d = tmp_path / "logs"
    generate_logs(
        d, nodes=30, steps=6, runs=1, seed=11, failures=3, moves_per_step=4, corrupt_lines=2, truncate_last=True
    )
    return d


def scipy_edges(coords: dict[str, tuple[float, float]]) -> set[tuple[str, str]]:
    ids = sorted(coords)
    tri = Delaunay(np.array([coords[i] for i in ids]))
    edges = set()
    for simplex in tri.simplices:
        for a in range(3):
            for b in range(a + 1, 3):
                u, v = ids[simplex[a]], ids[simplex[b]]
                edges.add((min(u, v), max(u, v)))
    return edges


def last_step_snapshots(d: Path) -> dict[str, dict[str, object]]:
    recs = []
    for f in d.rglob("*.jsonl"):
        for line in f.read_text().splitlines():
            try:
                rec = json.loads(line)
            except ValueError:
                continue
            if isinstance(rec, dict) and rec.get("type") == "snapshot" and rec.get("run"):
                recs.append(rec)
    last = max(r["step"] for r in recs)
    return {r["node"]: r for r in recs if r["step"] == last}


def test_svg_draws_every_broker_and_every_delaunay_link(logs: Path, tmp_path: Path) -> None:
    pic = picture_from_logs([str(logs)])
    snaps = last_step_snapshots(logs)
    svg = render(pic, tmp_path / "o.svg", "L2").read_text()
    brokers = re.findall(r'<circle class="broker" data-node="([^"]+)"', svg)
    assert sorted(brokers) == sorted(snaps)  # every live broker once
    links = {tuple(sorted(m)) for m in re.findall(r'<line class="link" data-a="([^"]+)" data-b="([^"]+)"', svg)}
    assert len(re.findall(r'<line class="link"', svg)) == len(links)  # no link drawn twice
    coords = {n: (float(r["coord"][0]), float(r["coord"][1])) for n, r in snaps.items()}  # type: ignore[index]
    assert links == scipy_edges(coords)
    # Failed brokers are marked, not drawn as live ones; each moved topic has one arrow.
    failed = re.findall(r'<path class="failed" data-node="([^"]+)"', svg)
    assert len(failed) == 3 and not set(failed) & set(brokers)
    assert len(re.findall(r'<line class="move"', svg)) == len(pic.moves) > 0
    assert len(re.findall(r'<polygon class="cell"', svg)) == len(brokers)
    assert draw_svg(pic, "L2") == svg  # deterministic


def test_cells_are_shaded_by_normalised_load(logs: Path) -> None:
    pic = picture_from_logs([str(logs)])
    svg = draw_svg(pic, "L1")
    loads = {n: float(v) for n, v in re.findall(r'<polygon class="cell" data-node="([^"]+)" data-load="([^"]+)"', svg)}
    # 100% is the mean L1, so the shaded L1 values average to 100 (up to the 2-decimal rounding in the SVG).
    assert np.mean(list(loads.values())) == pytest.approx(100.0, abs=0.01)
    fills = dict(
        re.findall(r'<polygon class="cell" data-node="([^"]+)" data-load="[^"]+" points="[^"]+" fill="([^"]+)"', svg)
    )
    lo, hi = min(loads, key=loads.__getitem__), max(loads, key=loads.__getitem__)
    assert fills[lo] == "#440154" and fills[hi] == "#fde725"  # the two ends of the colour ramp


def test_png_is_written(logs: Path, tmp_path: Path) -> None:
    out = render(picture_from_logs([str(logs)]), tmp_path / "o.png", "L3")
    data = out.read_bytes()
    assert data[:8] == PNG_MAGIC and len(data) > 10_000


def test_bad_inputs(tmp_path: Path) -> None:
    with pytest.raises(VizError, match="not found"):
        picture_from_logs([str(tmp_path / "nope")])
    with pytest.raises(VizError, match=r"no \*\.jsonl"):
        picture_from_logs([str(tmp_path)])
    (tmp_path / "x.jsonl").write_text('{"schema":1,"type":"event","run":"r","node":"a","event":"join"}\n')
    with pytest.raises(VizError, match="no snapshots"):
        picture_from_logs([str(tmp_path)])
    pic = OverlayPicture(nodes=(VizNode("a", (0.2, 0.2)), VizNode("b", (0.8, 0.8))))
    with pytest.raises(VizError, match="level"):
        draw_svg(pic, "L4")
    with pytest.raises(VizError, match=r"\.svg or \.png"):
        render(pic, tmp_path / "o.jpg")


def test_cli_viz(
    logs: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    out = tmp_path / "v.svg"
    assert cli_analysis.main(["viz", "--log-dir", str(logs), "--out", str(out), "--level", "L3"]) == 0
    assert out.read_text().startswith("<svg")
    # 3 of the 30 failed halfway; the truncated last line loses one more node's last snapshot.
    live = len(last_step_snapshots(logs))
    assert live == 26
    assert f"{live} brokers, 3 failed" in capsys.readouterr().out
    assert cli_analysis.main(["viz", "--log-dir", str(tmp_path / "missing"), "--out", str(out)]) == 2
    assert "log directory not found" in capsys.readouterr().err
    assert cli_analysis.main(["viz", "--log-dir", str(logs), "--out", str(tmp_path / "v.gif")]) == 2
    assert ".svg or .png" in capsys.readouterr().err
    # A directory that does not exist: one line naming the file and the fix (it was "failed unexpectedly").
    for name in ("v.svg", "v.png"):
        assert cli_analysis.main(["viz", "--log-dir", str(logs), "--out", str(tmp_path / "no" / name)]) == 2
        err = capsys.readouterr().err
        assert f"cannot write {tmp_path / 'no' / name}: No such file or directory" in err, err
        assert err.count("\n") == 1
    # Nothing listens on port 1: the live path fails with a clear message, not a traceback.
    assert cli_analysis.main(["viz", "--broker", "127.0.0.1:1", "--out", str(out), "--timeout", "2"]) == 1
    assert "cannot reach broker" in capsys.readouterr().err
    # Neither --broker nor --log-dir, and no $SEDAX_BROKERS: a usage error naming all three.
    monkeypatch.delenv("SEDAX_BROKERS", raising=False)
    assert cli_analysis.main(["viz", "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert "give --broker HOST:PORT (or set SEDAX_BROKERS), or --log-dir DIR" in err and err.count("\n") == 1


async def test_crawl_a_live_overlay_with_a_hung_broker(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    coords = [(0.1, 0.1), (0.9, 0.1), (0.5, 0.9), (0.5, 0.4), (0.95, 0.95)]
    # Slow failure detection (50 s): the hung broker stays in its neighbours' reports while the crawl runs.
    slow = ("--heartbeat-interval", "5", "--heartbeat-misses", "10")
    async with LocalCluster(5, coords=coords, state_dir=tmp_path / "c", broker_args=slow) as cluster:
        await cluster.wait_converged(20.0)
        creds = cluster.credentials()
        hung = cluster.nodes[4]
        os.kill(hung.pid, signal.SIGSTOP)
        try:
            found = await crawl(cluster.nodes[0].listen, credentials=creds, timeout=1.5)
        finally:
            os.kill(hung.pid, signal.SIGCONT)
        live = {bp.node_id: bp.coord for bp in cluster.nodes[:4]}
        assert set(found.statuses) == set(live)
        assert found.unreachable == {hung.node_id: coords[4]}
        pic = picture_from_statuses(found.statuses, found.unreachable, "t")
        assert [n.node for n in pic.nodes] == sorted(live) and pic.failed == {hung.node_id: coords[4]}
        svg = draw_svg(pic, "L1")
        links = {tuple(sorted(m)) for m in re.findall(r'data-a="([^"]+)" data-b="([^"]+)"', svg)}
        assert links == scipy_edges(live)
        # `sedax viz` takes the brokers from $SEDAX_BROKERS as the other tools do, the first that answers.
        monkeypatch.setenv("SEDAX_BROKERS", f"127.0.0.1:1,{cluster.nodes[1].listen}")
        out = tmp_path / "live.svg"
        assert await asyncio.to_thread(cli_analysis.main, ["viz", "--out", str(out), "--timeout", "2"]) == 0
        assert {tuple(sorted(m)) for m in re.findall(r'data-a="([^"]+)" data-b="([^"]+)"', out.read_text())} == (
            scipy_edges({bp.node_id: bp.coord for bp in cluster.nodes})
        )
    with pytest.raises(BrokerUnavailable, match="cannot reach"):
        await crawl("127.0.0.1:1", credentials=creds, timeout=1.5)
