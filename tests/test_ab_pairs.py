"""The in-run A/B's pairs and the fall-back's bound over every look (``rrfp.core.ab_pairs``;
seeded random pairs, no timing of this machine is read)."""

from __future__ import annotations

import math
import random
import statistics

import pytest

from benchmarks.fall_back_rule import EACH_LOOK, heavy_tailed, looks_below, normal, OVER_LOOKS
from rrfp.core.ab_pairs import ab_speedups, PairLogs, t_quantile, upper_bound

def test_the_a_b_pairs_each_fixed_step_with_its_neighbours():
    assert ab_speedups([(False, 1.0), (True, 1.5), (False, 2.0), (True, 3.0)]) == [1.0, 1.5]


@pytest.mark.parametrize("seed", range(3))
def test_the_pairs_taken_step_by_step_are_the_a_b_s_pairs(seed):
    rng = random.Random(seed)
    steps, pairs = [], PairLogs()
    for _ in range(400):
        # fixed-order steps now and then, twice in a row at times; a step of 0 s at times
        steps.append((rng.random() < 0.3, rng.choice([0.0, *[rng.uniform(0.5, 2)] * 9])))
        pairs.add(*steps[-1])
        sums = pairs.sums()
        logs = [math.log(r) for r in ab_speedups(steps) if r > 0]
        assert sums.count == len(logs)
        if len(logs) >= 1:
            assert sums.mean() == pytest.approx(statistics.mean(logs), abs=1e-12)
        if len(logs) >= 2:
            assert (sums.upper_bound(t_quantile(0.99, len(logs) - 1))
                    == pytest.approx(upper_bound(logs, 0.99), abs=1e-9))


def test_the_upper_bound_is_students():
    # Student's t at 0.99, 3 degrees of freedom: 4.541.
    values = [0.0, 1.0, 2.0, 3.0]
    exact = 1.5 + 4.541 * (5 / 3) ** 0.5 / 2
    assert exact * 0.97 < upper_bound(values, 0.99) <= exact


@pytest.mark.parametrize("draw", [normal, heavy_tailed])
def test_the_fall_back_s_bound_holds_over_every_look(draw):
    """Pairs of a setting as fast as the fixed order (mean log 0), looked at after every
    pair for 1,500 pairs: the bound over every look falls below 0 in at most 5% of the runs
    (its confidence, 0.95), where a bound at 0.95 each look does in a third or more."""
    over_looks = looks_below(1.0, draw, OVER_LOOKS)
    each_look = looks_below(1.0, draw, EACH_LOOK)
    assert sum(n is not None for n in over_looks) <= 0.05 * len(over_looks)
    assert sum(n is not None for n in each_look) >= 0.3 * len(each_look)


def test_the_bound_over_every_look_finds_a_slower_setting():
    """0.92x and 0.96x the fixed order at the documents job's spread: every run
    falls back, the 0.92x one within ~100 pairs."""
    slower = looks_below(0.92, normal, OVER_LOOKS, runs=100)
    slightly = looks_below(0.96, normal, OVER_LOOKS, runs=100)
    assert all(n is not None for n in slower + slightly)
    assert statistics.median(slower) < 60 and max(slower) < 150
    assert statistics.median(slower) < statistics.median(slightly) < 200
