"""PNG plots of `sedax analyze` from its (small) CSV tables, with matplotlib's Agg canvas (no display needed).

The figures are drawn on `matplotlib.figure.Figure` objects directly, not through pyplot, so no global
figure state or backend switching leaks into the caller.
"""

from __future__ import annotations

import csv
from collections import defaultdict
from pathlib import Path
from typing import Final

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

LEVEL_COLOURS: Final = {"L1": "tab:blue", "L2": "tab:orange", "L3": "tab:green"}
DPI: Final = 120


def _read(path: Path) -> list[dict[str, str]]:
    if not path.exists():
        return []
    with path.open(newline="") as fh:
        return list(csv.DictReader(fh))


def _num(x: str) -> float:
    return float(x) if x not in ("", "null", "None") else float("nan")


def _save(fig: Figure, path: Path) -> str:
    FigureCanvasAgg(fig)
    fig.tight_layout()
    fig.savefig(path, dpi=DPI)
    return str(path)


def plot_ccdf(csv_dir: Path, path: Path) -> str:
    """Averaged CCDF of the normalised node loads at the final step, one curve per level (Fig. 4 style)."""
    fig = Figure(figsize=(6.4, 4.2))
    ax = fig.add_subplot()
    by_level: dict[str, list[tuple[float, float]]] = defaultdict(list)
    for r in _read(csv_dir / "ccdf_final.csv"):
        by_level[r["level"]].append((_num(r["load"]), _num(r["ccdf"])))
    for level in sorted(by_level):
        pts = sorted(by_level[level])
        xs = [0.0] + [x for x, _ in pts]
        ys = [1.0] + [y for _, y in pts]
        ax.step(xs, ys, where="post", label=level, color=LEVEL_COLOURS.get(level))
    ax.set_xlabel("normalised node load (%)")
    ax.set_ylabel("P(load > x)")
    ax.set_ylim(0.0, 1.02)
    ax.set_title("CCDF of node load at the final step (averaged over runs)")
    ax.grid(alpha=0.3)
    if by_level:
        ax.legend()
    else:
        ax.text(0.5, 0.5, "no snapshots", ha="center", transform=ax.transAxes)
    return _save(fig, path)


def plot_quantiles(csv_dir: Path, path: Path) -> str:
    """q5, mean and q95 of the normalised loads per step (pooled over runs), one panel per level."""
    rows = _read(csv_dir / "quantiles_step.csv")
    levels = sorted({r["level"] for r in rows}) or ["L1"]
    fig = Figure(figsize=(6.4, 2.2 * len(levels) + 0.6))
    for i, level in enumerate(levels):
        ax = fig.add_subplot(len(levels), 1, i + 1)
        pts = sorted(
            (int(r["step"]), _num(r["q05"]), _num(r["mean"]), _num(r["q95"])) for r in rows if r["level"] == level
        )
        colour = LEVEL_COLOURS.get(level)
        if pts:
            steps = [p[0] for p in pts]
            ax.fill_between(steps, [p[1] for p in pts], [p[3] for p in pts], color=colour, alpha=0.25, label="q5–q95")
            ax.plot(steps, [p[2] for p in pts], color=colour, label="mean")
            ax.plot(steps, [p[3] for p in pts], color=colour, linestyle="--", linewidth=0.8)
            ax.plot(steps, [p[1] for p in pts], color=colour, linestyle="--", linewidth=0.8)
            ax.legend(loc="upper left", fontsize="small")
        ax.set_ylabel(f"{level} (%)")
        ax.grid(alpha=0.3)
    fig.axes[-1].set_xlabel("step")
    fig.axes[0].set_title("normalised node load over time (pooled over runs)")
    return _save(fig, path)


def plot_moved_load(csv_dir: Path, path: Path) -> str:
    """V_ML^cum and R_ML over time per run (Fig. 7 b/c style); one column per source, as τ and seconds differ."""
    rows = _read(csv_dir / "moved_load.csv")
    by_source: dict[str, dict[str, list[tuple[float, float, float]]]] = defaultdict(lambda: defaultdict(list))
    for r in rows:
        by_source[r["source"] or "?"][r["run"]].append((_num(r["t_end"]), _num(r["v_ml_cum"]), _num(r["r_ml"])))
    sources = sorted(by_source) or ["sim"]
    fig = Figure(figsize=(4.2 * len(sources) + 1.0, 5.0))
    for col, source in enumerate(sources):
        ax_cum = fig.add_subplot(2, len(sources), col + 1)
        ax_rate = fig.add_subplot(2, len(sources), len(sources) + col + 1, sharex=ax_cum)
        runs = by_source.get(source, {})
        for run in sorted(runs):
            pts = sorted(runs[run])
            ax_cum.step([p[0] for p in pts], [p[1] for p in pts], where="post", label=run)
            ax_rate.plot([p[0] for p in pts], [p[2] for p in pts], label=run)
        unit = "τ" if source == "sim" else "s"
        ax_cum.set_ylabel("V_ML^cum (load units)")
        ax_rate.set_ylabel(f"R_ML (load units / {unit})")
        ax_rate.set_xlabel(f"time since run start ({unit})")
        ax_cum.set_title(f"moved load, {source} runs (eqs. 13–14)")
        for ax in (ax_cum, ax_rate):
            ax.grid(alpha=0.3)
        if not runs:
            ax_cum.text(0.5, 0.5, "no move/delegation events", ha="center", transform=ax_cum.transAxes)
        elif len(runs) <= 10:  # a legend with more runs hides the curves
            ax_cum.legend(fontsize="small")
    return _save(fig, path)


def write_plots(out: Path) -> list[str]:
    """Write ccdf.png, quantiles_over_time.png and moved_load.png from out/csv; return their paths."""
    csv_dir = out / "csv"
    return [
        plot_ccdf(csv_dir, out / "ccdf.png"),
        plot_quantiles(csv_dir, out / "quantiles_over_time.png"),
        plot_moved_load(csv_dir, out / "moved_load.png"),
    ]
