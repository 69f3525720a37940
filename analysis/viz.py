"""`sedax viz`: one picture of the overlay: brokers, Delaunay links, Voronoi cells shaded by load, topic moves.

The drawing works on `OverlayPicture`, a plain data structure, so every source is a thin adapter: the log
directory adapter (`picture_from_logs`, the last snapshot step of the newest run) and the live adapter
(`picture_from_statuses`, the STATUS of every broker reachable from one, crawled by client/crawl.py).  SVG is
written by hand (deterministic: sorted nodes, fixed number formatting) so a test can check it draws every broker
and every link; PNG goes through matplotlib's Agg canvas.
"""

from __future__ import annotations

import itertools
import json
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final
from xml.sax.saxutils import escape, quoteattr

import numpy as np

from overlay.geometry import Coord, delaunay_neighbours, voronoi_cells

LEVELS: Final = ("L1", "L2", "L3")
# SVG canvas: the unit square maps to SIZE x SIZE pixels inside a MARGIN, plus a legend strip on the right.
SIZE: Final = 600
MARGIN: Final = 30
LEGEND_W: Final = 110
# Sequential colour ramp (viridis stops): light = lightly loaded, dark = heavily loaded would invert the
# usual reading, so low load is dark purple and high load yellow, as in matplotlib's default map.
RAMP: Final = (
    (0.0, (68, 1, 84)),
    (0.25, (59, 82, 139)),
    (0.5, (33, 145, 140)),
    (0.75, (94, 201, 98)),
    (1.0, (253, 231, 37)),
)


class VizError(ValueError):
    """The picture cannot be drawn from the given source (no logs, no snapshots, no broker status API)."""


@dataclass(frozen=True, slots=True)
class VizNode:
    """One live broker: id, coordinate C(v), reported Delaunay neighbours and loads L1/L2/L3."""

    node: str
    coord: Coord
    loads: dict[str, float] = field(default_factory=dict)
    neighbours: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class VizMove:
    """A topic's home-to-delegate arrow: from its first `from` coordinate to its latest `to` coordinate."""

    topic: str
    src: Coord
    dst: Coord


@dataclass(frozen=True, slots=True)
class OverlayPicture:
    """What `draw_svg`/`draw_png` draw; adapters build it from logs or from live brokers."""

    nodes: tuple[VizNode, ...]
    moves: tuple[VizMove, ...] = ()
    failed: dict[str, Coord] = field(default_factory=dict)  # failed broker -> last known coordinate
    title: str = ""

    def links(self) -> list[tuple[str, str]]:
        """Delaunay links of the live brokers' coordinates, as sorted (a, b) id pairs with a < b."""
        nodes = sorted(self.nodes, key=lambda n: n.node)
        pts = np.array([n.coord for n in nodes], dtype=np.float64).reshape(-1, 2)
        out = set()
        for i, nb in enumerate(delaunay_neighbours(pts)):
            for j in nb:
                a, b = nodes[i].node, nodes[j].node
                out.add((a, b) if a < b else (b, a))
        return sorted(out)

    def cells(self) -> dict[str, list[Coord]]:
        """Voronoi cells of the live brokers clipped to the unit square, by node id."""
        nodes = sorted(self.nodes, key=lambda n: n.node)
        pts = np.array([n.coord for n in nodes], dtype=np.float64).reshape(-1, 2)
        return {n.node: c for n, c in zip(nodes, voronoi_cells(pts), strict=True)}

    def normalised(self, level: str) -> dict[str, float]:
        """Loads of one level in % of the mean L1 (the paper's 100%); raw loads when L1 sums to zero."""
        if level not in LEVELS:
            raise VizError(f"level must be one of {', '.join(LEVELS)}, got {level!r}")
        l1 = [n.loads.get("L1", 0.0) for n in self.nodes]
        unit = sum(l1) / len(l1) if l1 else 0.0
        scale = 100.0 / unit if unit > 0 else 1.0
        return {n.node: n.loads.get(level, 0.0) * scale for n in self.nodes}


# ---- the log-directory adapter ----------------------------------------------------------------------------


def _coord(v: object) -> Coord | None:
    if isinstance(v, list) and len(v) == 2 and all(isinstance(x, int | float) for x in v):
        return (float(v[0]), float(v[1]))
    return None


def _records(files: Iterable[Path]) -> Iterable[dict[str, object]]:
    for f in files:
        with f.open(encoding="utf-8", errors="replace") as fh:
            for line in fh:
                try:
                    rec = json.loads(line)
                except ValueError:
                    continue  # truncated or corrupt line: skipped, as docs/logs.md requires
                if isinstance(rec, dict) and all(k in rec for k in ("schema", "type", "run", "node")):
                    yield rec


def _num(v: object, default: float = 0.0) -> float:
    return float(v) if isinstance(v, int | float) else default


def picture_from_logs(log_dirs: Sequence[str]) -> OverlayPicture:
    """The overlay at the last snapshot step of the newest run found below log_dirs.

    The newest run is the one with the latest `ts`.  Moves are that run's move/delegation events (one arrow
    per topic, from its first recorded `from` to its latest `to`); failed brokers are peers of its `failure`
    events with no snapshot after the failure.

    Raises:
        VizError: no `*.jsonl` files or no snapshots.
    """
    files: list[Path] = []
    for d in log_dirs:
        p = Path(d)
        if not p.exists():
            raise VizError(f"log directory not found: {d}")
        files.extend(sorted(p.rglob("*.jsonl")) if p.is_dir() else [p])
    if not files:
        raise VizError(f"no *.jsonl logs found below {', '.join(log_dirs)}")
    # One pass; per run keep only what the picture needs, so memory is bounded by one step of each run.
    newest: dict[str, float] = {}
    last_step: dict[str, int] = {}
    at_last: dict[str, dict[str, dict[str, object]]] = {}
    seen: dict[str, dict[str, tuple[float, Coord]]] = {}  # run -> node -> (ts of latest snapshot, coord)
    failures: dict[str, dict[str, float]] = {}  # run -> peer -> ts of its latest failure event
    moves: dict[str, dict[str, list[Coord | None]]] = {}  # run -> topic -> [home, current]
    for rec in _records(files):
        run = str(rec["run"])
        ts = _num(rec.get("ts"))
        newest[run] = max(newest.get(run, -math.inf), ts)
        if rec["type"] == "snapshot":
            step = rec.get("step")
            coord = _coord(rec.get("coord"))
            if not isinstance(step, int) or coord is None:
                continue
            node = str(rec["node"])
            prev = seen.setdefault(run, {}).get(node)
            if prev is None or ts >= prev[0]:
                seen[run][node] = (ts, coord)
            if step > last_step.get(run, -1):
                last_step[run] = step
                at_last[run] = {}
            if step == last_step[run]:
                at_last[run][node] = rec
        elif rec["type"] == "event":
            kind = rec.get("event")
            if kind == "failure" and isinstance(rec.get("peer"), str):
                peer = str(rec["peer"])
                fr = failures.setdefault(run, {})
                fr[peer] = max(fr.get(peer, -math.inf), ts)
            elif kind in ("move", "delegation") and isinstance(rec.get("topic"), str):
                entry = moves.setdefault(run, {}).setdefault(str(rec["topic"]), [None, None])
                src, dst = _coord(rec.get("from")), _coord(rec.get("to"))
                if entry[0] is None:
                    entry[0] = src
                entry[1] = dst if dst is not None else entry[1]
    if not at_last:
        raise VizError(f"no snapshots in the logs below {', '.join(log_dirs)}")
    run = max(at_last, key=lambda r: (newest[r], r))
    nodes = []
    for node, rec in sorted(at_last[run].items()):
        loads = rec.get("loads")
        nb = rec.get("neighbours")
        nodes.append(
            VizNode(
                node=node,
                coord=_coord(rec["coord"]) or (0.0, 0.0),
                loads={lv: _num(loads.get(lv)) for lv in LEVELS} if isinstance(loads, dict) else {},
                neighbours=tuple(sorted(str(x) for x in nb)) if isinstance(nb, list) else (),
            )
        )
    live = {n.node for n in nodes}
    failed = {
        peer: seen[run][peer][1]
        for peer, t_fail in sorted(failures.get(run, {}).items())
        if peer in seen.get(run, {}) and peer not in live and seen[run][peer][0] <= t_fail
    }
    arrows = tuple(
        VizMove(topic, src, dst)
        for topic, (src, dst) in sorted(moves.get(run, {}).items())
        if src is not None and dst is not None and src != dst
    )
    return OverlayPicture(nodes=tuple(nodes), moves=arrows, failed=failed, title=f"run {run}, step {last_step[run]}")


def picture_from_statuses(statuses: Mapping[str, Any], unreachable: Mapping[str, Coord], title: str) -> OverlayPicture:
    """The live adapter: a picture of the STATUS answers of a crawl (client/crawl.py, run by the CLI).

    analysis/ never imports the client or the broker (the layering contract in pyproject.toml): the command
    line crawls and hands the answers over.  Reported brokers that did not answer are drawn as failed; STATUS
    carries no topic move history, so a live picture has no move arrows.
    """
    nodes = tuple(
        VizNode(
            node=nid,
            coord=(float(st.node.coord[0]), float(st.node.coord[1])),
            loads={k: float(v) for k, v in st.loads.items()},
            neighbours=tuple(sorted(n.id for n in st.neighbours)),
        )
        for nid, st in sorted(statuses.items())
    )
    failed = {nid: unreachable[nid] for nid in sorted(unreachable) if nid not in statuses}
    return OverlayPicture(nodes=nodes, failed=failed, title=title)


# ---- drawing --------------------------------------------------------------------------------------------


def colour(t: float) -> str:
    """Hex colour of t in [0, 1] on the RAMP (clamped)."""
    t = min(1.0, max(0.0, t)) if math.isfinite(t) else 0.0
    for (t0, c0), (t1, c1) in itertools.pairwise(RAMP):
        if t <= t1:
            f = (t - t0) / (t1 - t0)
            rgb = [round(a + (b - a) * f) for a, b in zip(c0, c1, strict=True)]
            return "#{:02x}{:02x}{:02x}".format(*rgb)
    return "#{:02x}{:02x}{:02x}".format(*RAMP[-1][1])


def _scale(values: Iterable[float]) -> tuple[float, float]:
    vals = list(values)
    lo = min(vals, default=0.0)
    hi = max(vals, default=1.0)
    return (lo, hi) if hi > lo else (lo, lo + 1.0)


def _xy(c: Sequence[float]) -> tuple[str, str]:
    # Unit square to pixels, y up (SVG's y axis points down).
    return f"{MARGIN + c[0] * SIZE:.2f}", f"{MARGIN + (1.0 - c[1]) * SIZE:.2f}"


def draw_svg(pic: OverlayPicture, level: str = "L1") -> str:
    """The picture as a standalone SVG document (hand-written, deterministic)."""
    loads = pic.normalised(level)
    lo, hi = _scale(loads.values())
    w, h = SIZE + 2 * MARGIN + LEGEND_W, SIZE + 2 * MARGIN
    out = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}" viewBox="0 0 {w} {h}">',
        f"<title>{escape(pic.title or 'SeDAX overlay')} – {level}</title>",
        '<defs><marker id="arrow" viewBox="0 0 10 10" refX="9" refY="5" markerWidth="6" '
        'markerHeight="6" orient="auto-start-reverse"><path d="M0,0 L10,5 L0,10 z" fill="#d62728"/>'
        "</marker></defs>",
        f'<rect x="{MARGIN}" y="{MARGIN}" width="{SIZE}" height="{SIZE}" fill="#ffffff" stroke="#333333"/>',
    ]
    out.append('<g class="cells">')
    for node, poly in pic.cells().items():
        if len(poly) < 3:
            continue
        pts = " ".join(",".join(_xy(p)) for p in poly)
        fill = colour((loads[node] - lo) / (hi - lo))
        out.append(
            f'<polygon class="cell" data-node={quoteattr(node)} data-load="{loads[node]:.2f}" points="{pts}" '
            f'fill="{fill}" fill-opacity="0.75" stroke="#ffffff" stroke-width="1"/>'
        )
    out.append("</g>")
    coords = {n.node: n.coord for n in pic.nodes}
    out.append('<g class="links" stroke="#222222" stroke-width="1">')
    for a, b in pic.links():
        (x1, y1), (x2, y2) = _xy(coords[a]), _xy(coords[b])
        out.append(
            f'<line class="link" data-a={quoteattr(a)} data-b={quoteattr(b)} x1="{x1}" y1="{y1}" x2="{x2}" y2="{y2}"/>'
        )
    out.append("</g>")
    out.append('<g class="moves" stroke="#d62728" stroke-width="1.2" fill="none">')
    for m in pic.moves:
        (x1, y1), (x2, y2) = _xy(m.src), _xy(m.dst)
        out.append(
            f'<line class="move" data-topic={quoteattr(m.topic)} x1="{x1}" y1="{y1}" x2="{x2}" y2="{y2}" '
            'stroke-dasharray="4,2" marker-end="url(#arrow)"/>'
        )
    out.append("</g>")
    out.append('<g class="brokers">')
    for n in sorted(pic.nodes, key=lambda n: n.node):
        x, y = _xy(n.coord)
        out.append(
            f'<circle class="broker" data-node={quoteattr(n.node)} data-load="{loads[n.node]:.2f}" cx="{x}" '
            f'cy="{y}" r="4" fill="#ffffff" stroke="#000000" stroke-width="1.5">'
            f"<title>{escape(n.node)}: {level} {loads[n.node]:.1f}%</title></circle>"
        )
    out.append("</g>")
    out.append('<g class="failed-brokers" stroke="#d62728" stroke-width="2.5">')
    for node, c in sorted(pic.failed.items()):
        fx, fy = (float(v) for v in _xy(c))
        out.append(
            f'<path class="failed" data-node={quoteattr(node)} d="M{fx - 6:.2f},{fy - 6:.2f} '
            f'L{fx + 6:.2f},{fy + 6:.2f} M{fx - 6:.2f},{fy + 6:.2f} L{fx + 6:.2f},{fy - 6:.2f}">'
            f"<title>{escape(node)}: failed</title></path>"
        )
    out.append("</g>")
    # Legend: the colour ramp with the normalised load at its ends and middle.
    lx, top, bar_h = SIZE + 2 * MARGIN, MARGIN, SIZE // 2
    out.append('<g class="legend" font-family="sans-serif" font-size="11">')
    out.append(f'<text x="{lx}" y="{top - 8}">{level} (% of mean L1)</text>')
    steps = 50
    for i in range(steps):
        t = 1.0 - i / (steps - 1)
        out.append(
            f'<rect x="{lx}" y="{top + i * bar_h / steps:.2f}" width="18" height="{bar_h / steps + 0.5:.2f}" '
            f'fill="{colour(t)}"/>'
        )
    for t in (1.0, 0.5, 0.0):
        ty = top + (1.0 - t) * bar_h
        out.append(f'<text x="{lx + 24}" y="{ty + 4:.2f}">{lo + t * (hi - lo):.0f}%</text>')
    ky = top + bar_h + 30
    out.append(
        f'<circle cx="{lx + 6}" cy="{ky}" r="4" fill="#ffffff" stroke="#000000"/>'
        f'<text x="{lx + 16}" y="{ky + 4}">broker</text>'
    )
    out.append(
        f'<line x1="{lx}" y1="{ky + 20}" x2="{lx + 14}" y2="{ky + 20}" stroke="#d62728" '
        f'stroke-dasharray="4,2" marker-end="url(#arrow)"/><text x="{lx + 16}" y="{ky + 24}">topic move</text>'
    )
    out.append(
        f'<path d="M{lx},{ky + 34} L{lx + 12},{ky + 46} M{lx},{ky + 46} L{lx + 12},{ky + 34}" '
        f'stroke="#d62728" stroke-width="2.5"/><text x="{lx + 16}" y="{ky + 44}">failed</text>'
    )
    out.append("</g>")
    if pic.title:
        out.append(
            f'<text x="{MARGIN}" y="{MARGIN - 10}" font-family="sans-serif" font-size="13">{escape(pic.title)}</text>'
        )
    out.append("</svg>")
    return "\n".join(out) + "\n"


def draw_png(pic: OverlayPicture, path: str | Path, level: str = "L1") -> None:
    """The same picture as a PNG through matplotlib (Agg canvas, no display)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.cm import ScalarMappable
    from matplotlib.colors import LinearSegmentedColormap, Normalize
    from matplotlib.figure import Figure
    from matplotlib.patches import Polygon

    loads = pic.normalised(level)
    lo, hi = _scale(loads.values())
    cmap = LinearSegmentedColormap.from_list("ramp", [(t, tuple(v / 255 for v in c)) for t, c in RAMP])
    norm = Normalize(lo, hi)
    fig = Figure(figsize=(7.2, 6.0))
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    for node, poly in pic.cells().items():
        if len(poly) >= 3:
            ax.add_patch(
                Polygon(
                    poly, closed=True, facecolor=cmap(norm(loads[node])), alpha=0.75, edgecolor="white", linewidth=1.0
                )
            )
    coords = {n.node: n.coord for n in pic.nodes}
    for a, b in pic.links():
        ax.plot([coords[a][0], coords[b][0]], [coords[a][1], coords[b][1]], color="#222222", linewidth=0.8)
    for m in pic.moves:
        ax.annotate(
            "",
            xy=m.dst,
            xytext=m.src,
            arrowprops={"arrowstyle": "->", "color": "#d62728", "linestyle": "--", "linewidth": 1.0},
        )
    if pic.nodes:
        xs, ys = zip(*(n.coord for n in pic.nodes), strict=True)
        ax.scatter(xs, ys, s=25, facecolor="white", edgecolor="black", zorder=3, label="broker")
    if pic.failed:
        fx, fy = zip(*pic.failed.values(), strict=True)
        ax.scatter(fx, fy, s=60, marker="x", color="#d62728", linewidths=2.5, zorder=4, label="failed")
    if pic.moves:  # annotate() arrows have no legend entry of their own
        ax.plot([], [], color="#d62728", linestyle="--", linewidth=1.0, label="topic home → delegate")
    ax.set_xlim(0.0, 1.0)
    ax.set_ylim(0.0, 1.0)
    ax.set_aspect("equal")
    ax.set_title(f"{pic.title or 'SeDAX overlay'} – {level}")
    ax.legend(loc="upper right", fontsize="small")
    fig.colorbar(ScalarMappable(norm=norm, cmap=cmap), ax=ax, label=f"{level} (% of mean L1)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def render(pic: OverlayPicture, out: str | Path, level: str = "L1") -> Path:
    """Write the picture to out; the format follows the suffix (.svg or .png)."""
    path = Path(out)
    suffix = path.suffix.lower()
    try:
        if suffix == ".svg":
            path.write_text(draw_svg(pic, level), encoding="utf-8")
        elif suffix == ".png":
            draw_png(pic, path, level)
        else:
            raise VizError(f"output must end in .svg or .png, got {path.name!r}")
    except OSError as exc:  # a directory that does not exist, a read-only one, a full disk
        raise VizError(f"cannot write {path}: {exc.strerror or exc}: choose another --out") from None
    return path
