"""The real page's paired figures (``benchmarks/self_driving_real.py``) on made-up step
logs whose true speedups are known, under host speed swings larger than the settings'
differences (what the page's sequential runs could not resolve)."""

from __future__ import annotations

import math
import random

import pytest

from benchmarks.self_driving_real import default_pairs, paired_mode, Speedup, stretches

STEPS = 800
SWITCH_AT = 100
"""The torchtitan step the made-up mode's decision takes effect (its line says 99)."""
DECISION = ("from step 99: buffer_limit='hint+1', policy='arrival' (switch; predicted "
            "1.100x the fixed schedule)")


def host_speed(step: int, phase: float) -> float:
    """A shared host's slow swings: up to 30% either way over ~200 steps."""
    return 1 + 0.3 * math.sin(step / 30 + phase)


def fixed_order_seconds(step: int, phase: float, rng: random.Random) -> float:
    documents = 0.3 * rng.lognormvariate(0, 0.1)  # each step's own documents
    return documents * host_speed(step, phase)


def mode_run(speedup: float, phase: float, seed: int):
    """The mode: its own setting (as fast as the fixed order) until ``SWITCH_AT``, then a
    setting ``speedup`` faster; the A/B's fixed-order step every 8th step of a stretch.
    Returns its steps and what the fixed order would have taken on each."""
    rng = random.Random(seed)
    runs, fixed_would = {}, {}
    for step in range(1, STEPS + 1):
        since = 2 if step < SWITCH_AT else SWITCH_AT
        ab = (step - since) % 8 == 7
        fixed = fixed_order_seconds(step, phase, rng)
        fixed_would[step] = fixed
        gain = 1.0 if ab or step < SWITCH_AT else speedup
        runs[step] = (ab, fixed / gain)
    return runs, fixed_would


@pytest.mark.parametrize("seed", range(4))
def test_the_mode_s_paired_estimate_finds_its_true_speedup_through_the_host_s_swings(seed):
    runs, fixed_would = mode_run(1.1, phase=seed, seed=seed)
    truth = (sum(fixed_would[s] for s in runs if s >= 2)
             / sum(seconds for s, (_, seconds) in runs.items() if s >= 2))
    cut = stretches(runs, [DECISION])
    assert [(s.first, s.reason) for s in cut] == [
        (2, "measure"), (SWITCH_AT, "switch; predicted 1.100x the fixed schedule")]
    value, low, high = paired_mode(runs, cut)
    assert low <= truth <= high
    assert abs(value / truth - 1) < 0.04  # about two standard errors of its pairs
    assert low > 1.02  # resolved: the setting ran 1.1x for seven eighths of the run


def test_a_stretch_with_fewer_than_two_pairs_counts_at_its_own_time():
    runs, _ = mode_run(1.1, phase=0.0, seed=1)
    late = "from step 795: the hint's fixed order (fall back; measured 0.950x by the in-run A/B)"
    cut = stretches(runs, [DECISION, late])
    assert [s.steps for s in cut] == [SWITCH_AT - 2, 796 - SWITCH_AT, STEPS - 795]
    assert cut[-1].fixed_order and cut[-1].speedup is None


def test_the_default_s_pairs_share_no_step_and_bound_its_speedup():
    rng = random.Random(7)
    runs = {}
    for step in range(1, 1001):
        fixed = step % 2 == 0  # --rrfp.fixed_every 2
        runs[step] = (fixed, fixed_order_seconds(step, 0.0, rng) / (1.0 if fixed else 1.05))
    pairs = default_pairs(runs)
    assert len(pairs) == 250  # 499 fixed-order steps from step 2, every second pair
    measured = Speedup.of(pairs)
    assert measured is not None and measured.low <= 1.05 <= measured.high
    assert measured.low > 1.0


def test_a_decision_line_the_page_cannot_read_raises():
    runs, _ = mode_run(1.0, phase=0.0, seed=0)
    with pytest.raises(RuntimeError, match="cannot read"):
        stretches(runs, ["switched at some point"])
