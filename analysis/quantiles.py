"""The one quantile definition of the analysis, on Spark DataFrames.

`exact_quantiles` returns, per group, the same numbers as `numpy.quantile(values, p)` with numpy's default
method "linear" (Hyndman & Fan type 7): sort the n values x_0 <= ... <= x_{n-1}, take the virtual index
h = (n - 1) p, and interpolate linearly between x_floor(h) and x_ceil(h).  It is exact (no sketch, unlike
`percentile_approx`): each group's values are sorted into an array, the two values around each h are
picked by index, and the interpolation is done with numpy's own formula (including its switch to
`b - (b - a)(1 - g)` for g >= 0.5, which keeps the result monotone in p), so the results agree with numpy to
the last bit on the same input doubles.  Each group's values are gathered into one sorted array in one
task, so a group must fit in a task's memory: groups here are at most (nodes x runs) values (10^4 in the
10^7-record benchmark, 80 KB), far below that.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Final

from pyspark.sql import Column, DataFrame, Window
from pyspark.sql import functions as F

# The analysis reports the 5% quantile, the median and the 95% quantile (the paper's q5% and q95%).
DEFAULT_PROBS: Final = (0.05, 0.5, 0.95)


def quantile_column(p: float) -> str:
    """Column name for the p-quantile: 0.05 -> "q05", 0.5 -> "q50", 0.95 -> "q95", 0.999 -> "q99_9"."""
    pct = round(p * 100.0, 6)
    if pct == int(pct):
        return f"q{int(pct):02d}"
    return "q" + f"{pct:g}".replace(".", "_")


def exact_quantiles(
    df: DataFrame, groups: Sequence[str], value: str, probs: Sequence[float] = DEFAULT_PROBS
) -> DataFrame:
    """Exact numpy-"linear" quantiles of `value` per group, plus n, mean, min and max.

    Args:
        df: input rows; null values of `value` are dropped first.
        groups: grouping columns (may be empty for one global group).
        value: the numeric column.
        probs: probabilities in [0, 1].

    Returns:
        One row per group: the group columns, `n`, `mean`, `min`, `max` and one column per probability
        named by `quantile_column`.
    """
    for p in probs:
        if not 0.0 <= p <= 1.0:
            raise ValueError(f"quantile probability must be in [0, 1], got {p}")
    keys = [F.col(g) for g in groups]
    # One aggregation per group: the sorted array of its values.  Exact order statistics come from it by
    # index, without a window over the whole data set (a window costs a full shuffle and sort per table).
    arr = F.array_sort(F.collect_list(F.col(value).cast("double")))
    grouped = (
        df.where(F.col(value).isNotNull())
        .groupBy(*keys)
        .agg(arr.alias("_a"), F.mean(F.col(value).cast("double")).alias("mean"))
        .select(*keys, "_a", F.size("_a").alias("n"), "mean")
    )
    out: list[Column] = [
        *keys,
        F.col("n"),
        F.col("mean"),
        F.element_at("_a", 1).alias("min"),
        F.element_at("_a", -1).alias("max"),
    ]
    for p in probs:
        h = (F.col("n") - 1).cast("double") * F.lit(float(p))
        g = h - F.floor(h)
        # element_at is 1-based: rank r (0-based) is element r + 1.
        lo = F.element_at("_a", (F.floor(h) + 1).cast("int"))
        hi = F.element_at("_a", (F.ceil(h) + 1).cast("int"))
        # numpy's _lerp: a + (b - a) g, evaluated from the upper end when g >= 0.5.
        q = F.when(g >= 0.5, hi - (hi - lo) * (F.lit(1.0) - g)).otherwise(lo + (hi - lo) * g)
        out.append(q.alias(quantile_column(p)))
    return grouped.select(*out)


def averaged_ccdf(df: DataFrame, groups: Sequence[str], value: str, weight: str) -> DataFrame:
    """Weighted empirical CCDF P(X > x) per group, at every distinct value x.

    Weights are normalised per group, so with weight 1 / (nodes of the value's run) every run counts
    equally and this is the paper's averaged CCDF (the mean over runs of each run's CCDF, Sec. VII-A); with
    equal node counts in all runs it equals the CCDF of the pooled values.

    Returns:
        Rows (groups..., `value`, `ccdf`) sorted within each group by `value`.
    """
    keys = [F.col(g) for g in groups]
    part = Window.partitionBy(*keys) if keys else Window.partitionBy(F.lit(0))
    # RANGE frame: ties share the cumulative weight up to and including x, so P(X > x) = 1 - cum.
    cum = F.sum(weight).over(part.orderBy(value).rangeBetween(Window.unboundedPreceding, Window.currentRow))
    total = F.sum(weight).over(part)
    ccdf = F.greatest(F.lit(0.0), F.lit(1.0) - cum / total)
    return (
        df.where(F.col(value).isNotNull())
        .select(*keys, F.col(value), ccdf.alias("ccdf"))
        .dropDuplicates([*groups, value])
    )
