"""Topic growth and moved load (Sec. VIII): eq. (12) and eqs. (13)-(14)."""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence

import numpy as np

from overlay.geometry import FloatArray


def max_growth_rate(l_max: float, duration: float) -> float:
    """λ_max, eq. (12): ln(L_T^max) / D, so the fastest topic grows from 1 to L_T^max in D."""
    if l_max < 1.0:
        raise ValueError(f"L_T^max must be at least 1 (topics start at size 1), got {l_max}")
    if duration <= 0.0:
        raise ValueError(f"duration D must be positive, got {duration}")
    return math.log(l_max) / duration


def growth_rates(n_topics: int, l_max: float, duration: float = 1.0) -> FloatArray:
    """Growth rates of n topics linearly spaced in [0, λ_max] (Sec. VIII-A)."""
    if n_topics == 1:
        return np.zeros(1)
    return np.linspace(0.0, max_growth_rate(l_max, duration), n_topics)


def topic_sizes(rates: FloatArray, tau: float) -> FloatArray:
    """L_T(t, τ) = exp(λ_t τ): every topic starts at size 1 (Sec. VIII-A)."""
    out: FloatArray = np.exp(rates * tau)
    return out


def exponential_sizes(n_topics: int, lam: float = math.log(10.0)) -> FloatArray:
    """Exponentially distributed static sizes L_T(i) = exp(λ i / (n - 1)), 0 <= i < n (Sec. VII-A).

    λ = ln 10 makes them equal the grown sizes of the growth model with L_T^max = 10 (Sec. VII-A).
    """
    if n_topics == 1:
        return np.ones(1)
    i = np.arange(n_topics)
    out: FloatArray = np.exp(lam * i / (n_topics - 1))
    return out


def moved_load(delegated_loads: Iterable[float]) -> float:
    """V_ML(τ), eq. (13): the summed load of the topics delegated at τ."""
    return float(sum(delegated_loads))


def moved_load_rate(v_ml: Sequence[float], window: int) -> FloatArray:
    """R_ML(τ), eq. (14), for a series V_ML(1..T) sampled once per step, with a window of W steps.

    R_ML(τ) = 1 / min(τ, W) * sum_{τ' = max(0, τ - W) + 1}^{τ} V_ML(τ'); index 0 of the result is τ = 1.
    """
    if window < 1:
        raise ValueError(f"window W must be at least one step, got {window}")
    v = np.asarray(v_ml, dtype=np.float64)
    csum = np.concatenate(([0.0], np.cumsum(v)))
    tau = np.arange(1, len(v) + 1)
    lo = np.maximum(0, tau - window)
    out: FloatArray = (csum[tau] - csum[lo]) / np.minimum(tau, window)
    return out
