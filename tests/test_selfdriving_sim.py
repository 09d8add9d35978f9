"""Self-driving in the simulator (``rrfp.sim.selfdriving``): runs over any ``Timing``
sequence a caller builds, every step counted, against the best single setting."""

from __future__ import annotations

import pytest

from rrfp.core.hints import build_hint
from rrfp.core.tuning import FIXED_ORDER, OWN, TuningRules
from rrfp.sim import selfdriving
from rrfp.sim.families import encoder, FAMILIES, regime_change
from rrfp.sim.workloads import make_timing

pytestmark = pytest.mark.simulator

HINT = build_hint("1F1B", num_ranks=2, num_stages=2, n_microbatches=8)


def steps(workload: str, count: int, seed: int = 0) -> list:
    return [make_timing(workload, 2, 8, seed * 1000 + k) for k in range(count)]


def test_uniform_steps_keep_the_hints_own_setting_and_lose_nothing():
    run = selfdriving.run(HINT, steps("uniform", 40))
    assert [d.reason for d in run.decisions] == ["measure", "no gain"]
    assert all(setting == OWN for setting in run.settings[8:]
               if setting != FIXED_ORDER)  # the A/B's steps run the fixed order
    assert run.speedup == pytest.approx(1.0, abs=1e-9)


def test_a_caller_built_sequence_is_run_step_by_step_and_every_step_counts():
    # The caller's own sequence: bursty link latency.
    timings = steps("bursty", 48)
    run = selfdriving.run(HINT, timings)
    assert len(run.step_times) == len(run.fixed_times) == 48
    assert run.decisions[1].reason == "switch"
    assert run.decisions[1].step == TuningRules().measure_steps
    # The A/B's steps ran the fixed order: their times are the fixed schedule's.
    assert run.ab_steps and all(run.step_times[s] == run.fixed_times[s] for s in run.ab_steps)
    assert run.speedup == sum(run.fixed_times) / sum(run.step_times)
    best = selfdriving.hindsight(HINT, timings, selfdriving.candidates(HINT, "hint+2"))
    assert 1.0 < run.speedup <= best.speedup


def test_candidates_stay_within_the_budget_and_run_alike_only_once():
    found = selfdriving.candidates(HINT, "hint+1", sizes=True)
    assert {c.buffer_limit for c in found} == {"hint", "hint+1"}
    assert len(found) == len(set(found))
    with pytest.raises(ValueError, match="in microbatches"):
        selfdriving.candidates(HINT, "12GiB")


def test_interchangeable_hints_are_candidates_only_where_asked_and_within_the_budget():
    found = selfdriving.candidates(HINT, "hint+1", hints=True)
    ranked = {c.hint for c in found}
    assert ranked == {None, "GPipe", "Interleaved1F1B", "BF"}
    assert {c.buffer_limit for c in found if c.hint} == {"hint", "hint+1"}
    assert all(c.hint is None for c in selfdriving.candidates(HINT, "hint+1"))
    # Ranked by GPipe at 1F1B's own limits: its order, held to 1F1B's peaks.
    gpipe = next(c for c in found if c.hint == "GPipe" and c.buffer_limit == "hint")
    timings = steps("bursty", 6)
    [predicted] = selfdriving.predict(HINT, timings, [gpipe])
    assert predicted.speedup > 0.9
    assert selfdriving.setting_times(HINT, timings, gpipe) != selfdriving.setting_times(
        build_hint("GPipe", num_ranks=2, num_stages=2, n_microbatches=8), timings, OWN)


def test_the_families_build_the_steps_they_name():
    assert len(FAMILIES) >= 8
    bottleneck = encoder(2, 8, balanced=False)(0, 3)
    balanced = encoder(2, 8, balanced=True)(0, 3)
    assert all(t.sizes is not None for t in bottleneck)
    mean = lambda ts, s: sum(sum(t.forward[s]) for t in ts) / sum(len(t.forward[s]) for t in ts)
    assert mean(bottleneck, 0) > 2 * mean(bottleneck, 1)
    assert mean(balanced, 0) < 1.5 * mean(balanced, 1)
    changed = regime_change(lambda seed, n: steps("uniform", n),
                            lambda seed, n: steps("bursty", n), 5)(0, 8)
    assert changed[:5] == steps("uniform", 5) and changed[5:] == steps("bursty", 8)[5:]
