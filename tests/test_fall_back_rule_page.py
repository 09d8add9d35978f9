"""``benchmarks/fall_back_rule.py`` replays step times through the tuner: a setting as fast
as the fixed order is kept, one much slower is dropped within a few pairs."""

from __future__ import annotations

import random

from benchmarks.fall_back_rule import fall_back_step
from rrfp.core.tuning import TuningRules


def made_up_times(steps: int, seed: int) -> list[float]:
    rng = random.Random(seed)
    return [0.3 * rng.lognormvariate(0, 0.02) for _ in range(steps)]


def test_a_setting_as_fast_as_the_fixed_order_is_kept_and_a_slow_one_dropped():
    times = made_up_times(600, 0)
    assert fall_back_step(times, 3, 1.0, TuningRules()) is None
    dropped = fall_back_step(times, 3, 0.8, TuningRules())
    assert dropped is not None and dropped <= 8 * 6  # the A/B's 4th to 6th pair
    stricter = fall_back_step(times, 3, 0.8, TuningRules(min_pairs=16))
    assert stricter is not None and stricter > dropped
