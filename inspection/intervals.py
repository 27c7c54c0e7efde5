"""Binomial uncertainty of success rates, for the tables and plots that show them.

A success rate of n rollouts is a binomial proportion: its 95 % interval is Wilson's score
interval (it stays inside [0, 1] and is sound for small n or rates near 0 and 1, unlike
p ± 1.96·√(p(1−p)/n)). A change between two rates is reported with the half-width of the
normal 95 % interval of the difference of two independent proportions; rollouts of the
same held-out tasks are positively correlated, so that half-width is, if anything, wide.
"""

from __future__ import annotations

import math

Z95 = 1.959963984540054  # the standard normal's 97.5 % quantile


def wilson(successes: float, n: int, z: float = Z95) -> tuple[float, float]:
    """Wilson score interval (low, high) of `successes` out of `n`; (0, 1) when n is 0."""
    if n <= 0:
        return 0.0, 1.0
    p = float(successes) / n
    denom = 1.0 + z * z / n
    centre = (p + z * z / (2 * n)) / denom
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / denom
    return max(0.0, centre - half), min(1.0, centre + half)


def difference(p0: float, n0: int, p1: float, n1: int, z: float = Z95) -> tuple[float, float]:
    """(p1 − p0, half-width of its 95 % interval) for two independent proportions."""
    if n0 <= 0 or n1 <= 0:
        return p1 - p0, float("nan")
    return p1 - p0, z * math.sqrt(p0 * (1 - p0) / n0 + p1 * (1 - p1) / n1)


def change_line(p0: float, n0: int, p1: float, n1: int) -> str:
    """'+x.x points (±y.y)': the change from p0 to p1 in percentage points, 95 % interval."""
    delta, half = difference(p0, n0, p1, n1)
    return f"{100 * delta:+.1f} points (±{100 * half:.1f})"
