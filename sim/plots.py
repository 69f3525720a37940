"""Figures of the simulator: CCDFs like Figs. 4/5 and the moved-load panels of Fig. 7 (matplotlib, Agg)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from overlay.geometry import FloatArray
from sim.experiments import averaged_ccdf


def _pyplot() -> Any:
    # Imported here so the simulator runs without matplotlib unless a plot is asked for; Agg needs no display.
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_ccdf(path: Path, levels: Mapping[str, Sequence[FloatArray]], title: str) -> None:
    """CCDFs of relative node loads averaged over runs: x = load in %, y = % of nodes with larger load."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6.0, 4.0))
    for name, samples in levels.items():
        xs, ys = averaged_ccdf(samples)
        # start each curve at (0, 100%) so it reads as the figure's line, then step through the observations
        ax.plot([0.0, *xs.tolist()], [100.0, *ys.tolist()], label=f"{name}$_N$", drawstyle="steps-post")
    ax.set_xlabel("relative node load x (%)")
    ax.set_ylabel("nodes with load > x (%)")
    ax.set_ylim(0, 100)
    ax.set_xlim(left=0)
    ax.grid(True, alpha=0.3)
    ax.legend()
    ax.set_title(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_growth(
    path: Path,
    tau: Sequence[float],
    q95: Mapping[str, Sequence[float]],
    v_ml_cum: Sequence[float],
    r_ml: Sequence[float],
    title: str,
) -> None:
    """The three panels of Fig. 7 for one run: q95 of L^i over τ, cumulative V_ML, and R_ML (eq. 14)."""
    plt = _pyplot()
    fig, axes = plt.subplots(1, 3, figsize=(14.0, 4.0))
    pct = [100.0 * t for t in tau]
    for name, series in q95.items():
        axes[0].plot(pct, series, label=f"{name}$_N$")
    axes[0].set_ylabel("95% quantile of node load (%)")
    axes[0].legend()
    axes[1].plot(pct[1:], v_ml_cum)
    axes[1].set_ylabel("cumulative moved load $V_{ML}^{cum}$ (topic units)")
    axes[2].plot(pct[1:], r_ml)
    axes[2].set_ylabel("moved load rate $R_{ML}$ (topic units per D)")
    for ax in axes:
        ax.set_xlabel("time τ (% of D)")
        ax.grid(True, alpha=0.3)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
