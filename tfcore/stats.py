"""Two small statistics of chapter 8 (§8.9), shared with chapter 25: the 95% Wilson score interval of an
accuracy and the two-sided exact McNemar test of two classifiers scored on the same items.

Both definitions are copied character for character from chapter 8's notebook (the sync test compares them).
"""

import math

__all__ = ["wilson_interval", "mcnemar_exact"]


def wilson_interval(correct, n, z=1.96):
    """95% Wilson score interval (low, high) for an accuracy of `correct` out
    of `n` (n >= 1, 0 <= correct <= n)."""
    if n < 1:
        raise ValueError(f"wilson_interval needs n >= 1 trials, got n={n}")
    if not 0 <= correct <= n:
        raise ValueError(f"wilson_interval needs 0 <= correct <= n, "
                         f"got correct={correct} of n={n}")
    p = correct / n
    centre = (p + z**2 / (2 * n)) / (1 + z**2 / n)
    half_width = z / (1 + z**2 / n) * math.sqrt(p * (1 - p) / n + z**2 / (4 * n**2))
    return centre - half_width, centre + half_width


def mcnemar_exact(only_first, only_second):
    """Two-sided exact McNemar test: p-value for `only_first` vs `only_second`
    discordant items (two counts >= 0)."""
    if min(only_first, only_second) < 0:
        raise ValueError(f"mcnemar_exact needs counts >= 0, got only_first="
                         f"{only_first}, only_second={only_second}")
    n = only_first + only_second
    tail = sum(math.comb(n, k) for k in range(min(only_first, only_second) + 1)) / 2**n
    return min(1.0, 2 * tail)
