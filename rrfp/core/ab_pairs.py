"""The in-run A/B's measured speedups, and how far the tuner may trust them.

A fixed-order step of the in-run A/B over the mean of its neighbours at the run's own
setting is one measured speedup (``ab_speedups``): a drift in the machine's speed falls on
both. ``PairStream`` takes them as the steps come and ``PairLogs`` keeps running sums of
their logs (``LogSums``), so that a step costs the same however many ran before it (a job runs a setting
for hundreds of thousands of steps).

``upper_bound`` bounds their mean log at one look (Student's t). The tuner looks after
every pair for as long as a setting runs; at a fixed confidence per look, the chance that
some look falls below a true mean of 0 grows with the looks without end. Its fall-back
takes each look at ``look_quantile`` instead: a normal-mixture confidence sequence
(Robbins 1970), whose bound holds at every count of pairs at once with the confidence
asked for, each look's quantile then taken as Student's t at the pairs' degrees of freedom
(their spread is estimated, not known). ``tests/test_ab_pairs.py`` measures the chance over
1,500 looks.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence

__all__ = ["ab_speedups", "LogSums", "look_quantile", "PairLogs", "PairStream", "t_quantile",
           "upper_bound"]


def ab_speedups(steps: Sequence[tuple[bool, float]]) -> list[float]:
    """The in-run A/B's measured speedups: for each fixed-order step (``(True, seconds)``),
    its time over the mean of the steps at the run's own setting next to it (before and
    after), so that a drift in the machine's speed falls on both (none where they took
    no time)."""
    ratios = []
    for i, (fixed, seconds) in enumerate(steps):
        if not fixed:
            continue
        neighbours = [steps[j][1] for j in (i - 1, i + 1)
                      if 0 <= j < len(steps) and not steps[j][0]]
        if neighbours and statistics.mean(neighbours) > 0:
            ratios.append(seconds / statistics.mean(neighbours))
    return ratios


def upper_bound(values: Sequence[float], confidence: float) -> float:
    """The one-sided upper ``confidence`` bound of the mean of ``values`` at one look
    (Student's t, its quantile ``t_quantile``)."""
    n = len(values)
    return (statistics.mean(values)
            + t_quantile(confidence, n - 1) * statistics.stdev(values) / math.sqrt(n))


def t_quantile(confidence: float, df: int) -> float:
    """Student's t quantile by the Cornish-Fisher expansion, a little below the exact one
    with few degrees of freedom (``tests/test_ab_pairs.py`` bounds the difference)."""
    return _t_of_normal(statistics.NormalDist().inv_cdf(confidence), df)


def _t_of_normal(z: float, df: int) -> float:
    return (z + (z**3 + z) / (4 * df) + (5 * z**5 + 16 * z**3 + 3 * z) / (96 * df**2)
            + (3 * z**7 + 19 * z**5 + 17 * z**3 - 15 * z) / (384 * df**3))


def look_quantile(confidence: float, pairs: int, tightest_at: int) -> float:
    """The quantile (in standard errors) one look at ``pairs`` pairs (at least 2) takes so
    that the bound holds at every count of pairs at once with ``confidence``: the
    normal-mixture boundary, tightest near ``tightest_at`` pairs, as Student's t."""
    wide = (pairs + tightest_at) / tightest_at
    z = math.sqrt(2 * wide * tightest_at / pairs
                  * math.log(math.sqrt(wide) / (1 - confidence)))
    return _t_of_normal(z, pairs - 1)


class PairStream:
    """``ab_speedups`` of a run of steps, taken as each step comes: a fixed-order step's
    pair is ``tail`` (against the step before it only) until the step after it runs and
    completes it."""

    def __init__(self) -> None:
        self._before: float | None = None
        """The last step's seconds, where it ran the setting."""
        self._open: tuple[float, float | None] | None = None
        """The last step, where it ran the fixed order: its seconds, and the step before it
        at the setting (None: none)."""
        self.tail: float | None = None
        """The last step's pair, where it ran the fixed order (None: not, or no pair)."""

    def add(self, fixed: bool, seconds: float) -> float | None:
        """The next step: whether it ran the A/B's fixed order, and its seconds. Returns
        the pair it completed: the last step's, where that one ran the fixed order (None:
        it did not, or it has no pair)."""
        completed = _pair(*self._open, None if fixed else seconds) if self._open else None
        self._open = (seconds, self._before) if fixed else None
        self.tail = _pair(seconds, self._before, None) if fixed else None
        self._before = None if fixed else seconds
        return completed


def _pair(ab: float, before: float | None, after: float | None) -> float | None:
    """``ab_speedups`` of one fixed-order step between the steps beside it (None: no step
    at the setting there)."""
    ratios = ab_speedups([*([(False, before)] if before is not None else []), (True, ab),
                          *([(False, after)] if after is not None else [])])
    return ratios[0] if ratios else None


class LogSums:
    """Running count, sum and sum of squares of logs: their mean, and their upper bound at a
    quantile."""

    __slots__ = ("count", "total", "squares")

    def __init__(self, count: int = 0, total: float = 0.0, squares: float = 0.0) -> None:
        self.count, self.total, self.squares = count, total, squares

    def plus(self, log: float) -> "LogSums":
        """These sums with ``log`` added."""
        return LogSums(self.count + 1, self.total + log, self.squares + log * log)

    def mean(self) -> float:
        """The mean log (at least one)."""
        return self.total / self.count

    def upper_bound(self, quantile: float) -> float:
        """The mean log plus ``quantile`` standard errors (at least two logs)."""
        n, mean = self.count, self.mean()
        spread = math.sqrt(max(0.0, (self.squares - n * mean * mean) / (n - 1)))
        return mean + quantile * spread / math.sqrt(n)


class PairLogs:
    """The logs of the A/B's measured speedups of the steps since a decision, as running
    sums: the last fixed-order step's pair counts against the step before it only until
    the step after it runs."""

    def __init__(self) -> None:
        self._stream = PairStream()
        self._done = LogSums()
        """The completed pairs'."""

    def add(self, fixed: bool, seconds: float) -> None:
        """The next step: whether it ran the A/B's fixed order, and its seconds."""
        log = _log(self._stream.add(fixed, seconds))
        if log is not None:
            self._done = self._done.plus(log)

    def sums(self) -> LogSums:
        """The pairs' sums, the open pair included."""
        tail = _log(self._stream.tail)
        return self._done if tail is None else self._done.plus(tail)


def _log(ratio: float | None) -> float | None:
    return math.log(ratio) if ratio is not None and ratio > 0 else None
