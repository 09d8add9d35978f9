"""The self-driving tuner's decision paths, each forced with emulated step times
(``rrfp.core.tuning``; no timing of this machine is read)."""

from __future__ import annotations

import random
import statistics
import time

import pytest

from rrfp.core.tuning import (Candidate, FIXED_ORDER, OWN, Predicted, SettingTimes, Tuner,
                              TuningRules)

FAST = Candidate("hint+2")
FASTER_ON_PAPER = Candidate("hint+2", "critical")
NEXT = Candidate("hint+1")


def drive(tuner: Tuner, steps: int, seconds, predictions=None) -> None:
    """Run ``steps`` steps; ``seconds(step, run)`` is each one's time; predictions are
    handed over as soon as the tuner wants them."""
    for _ in range(steps):
        run = tuner.next_run()
        tuner.observe(run, seconds(tuner.steps, run))
        if tuner.wants_predictions is not None:
            tuner.choose(predictions or [])


def times_by_setting(table: dict, noise: float = 0.0, seed: int = 0):
    """Step times from a table {setting: seconds} (the A/B's steps: FIXED_ORDER's), each
    times a seeded lognormal-ish noise factor."""
    rng = random.Random(seed)

    def seconds(step: int, run) -> float:
        setting = FIXED_ORDER if run.ab_fixed else run.setting
        return table[setting] * (1 + rng.uniform(-noise, noise))
    return seconds


def test_measures_at_the_hints_own_setting_then_switches_to_the_best_prediction():
    tuner = Tuner()
    first = tuner.rules.measure_steps
    measured = []
    for _ in range(first):
        measured.append(tuner.next_run())
        tuner.observe(tuner.next_run(), 1.0)
    assert {run.setting for run in measured} == {OWN}
    assert tuner.wants_predictions == range(0, first)
    decision = tuner.choose([Predicted(NEXT, 1.05), Predicted(FAST, 1.15)])
    assert (decision.step, decision.setting, decision.reason) == (first, FAST, "switch")
    assert tuner.next_run().setting == FAST
    assert "predicted 1.150x" in decision.line()


def test_the_a_b_checks_the_hints_own_setting_while_the_first_decision_waits():
    # A first prediction that waits for its CPU share: the hint's own setting runs, one
    # step in ab_every runs the fixed order; the decision starts pairs of its own.
    tuner = Tuner()
    every = tuner.rules.ab_every
    late = 3 * every
    runs = []
    for _ in range(late):
        runs.append(tuner.next_run())
        tuner.observe(runs[-1], 1.0)
    assert {run.setting for run in runs} == {OWN}
    assert [i for i, run in enumerate(runs) if run.ab_fixed] == [every - 1, 2 * every - 1,
                                                                3 * every - 1]
    decision = tuner.choose([Predicted(FAST, 1.15)])
    assert decision.step == late
    for _ in range(every):
        runs.append(tuner.next_run())
        tuner.observe(runs[-1], 1.0)
    assert [i for i, run in enumerate(runs) if run.ab_fixed][3:] == [late + every - 1]


def test_the_hints_own_setting_found_slower_before_any_prediction_falls_back():
    # No prediction ever comes (its CPU share not granted): the A/B alone finds the hint's
    # own setting slower, the fixed order runs, and a prediction coming later does not
    # bring the rejected setting back.
    tuner = Tuner()
    table = times_by_setting({OWN: 1.25, FIXED_ORDER: 1.0}, noise=0.05)
    for _ in range(80):
        run = tuner.next_run()
        tuner.observe(run, table(tuner.steps, run))
    assert [d.reason for d in tuner.decisions] == ["measure", "fall back"]
    assert tuner.setting == FIXED_ORDER and tuner.decisions[-1].measured < 0.9
    tuner.choose([Predicted(OWN, 1.004), Predicted(FAST, 1.015)])
    assert (tuner.setting, tuner.decisions[-1].reason) == (FIXED_ORDER, "no gain")


def test_the_steps_are_measured_only_until_the_last_prediction_has_all_it_reads():
    # Predictions that come late (waiting for their CPU share) read steps that ran: the
    # steps after the last round's are not measured (not shared among the ranks).
    tuner = Tuner()
    last = tuner.rules.refine_at[-1]
    measured = []
    for _ in range(3 * last):
        measured.append(tuner.measuring)
        tuner.observe(tuner.next_run(), 1.0)
    assert measured == [True] * last + [False] * (2 * last)
    assert tuner.wants_predictions == range(0, tuner.rules.measure_steps)


def test_no_candidate_clearing_the_margins_keeps_the_hints_own_setting():
    tuner = Tuner()
    drive(tuner, 8, lambda step, run: 1.0,
          [Predicted(OWN, 1.004), Predicted(FAST, 1.015)])
    assert tuner.setting == OWN
    assert tuner.decisions[-1].reason == "no gain"
    # A candidate must also beat the hint's own setting's prediction by the refine margin.
    tuner = Tuner()
    drive(tuner, 8, lambda step, run: 1.0, [Predicted(OWN, 1.05), Predicted(FAST, 1.055)])
    assert (tuner.setting, tuner.decisions[-1].reason) == (OWN, "no gain")


def test_the_hints_own_setting_found_slower_falls_back_to_the_fixed_order():
    tuner = Tuner()
    drive(tuner, 80, times_by_setting({OWN: 1.25, FIXED_ORDER: 1.0}),
          [Predicted(OWN, 1.004), Predicted(FAST, 1.015)])
    assert tuner.setting == FIXED_ORDER
    assert tuner.decisions[-1].reason == "fall back"
    # The fixed order needs no A/B against itself.
    assert not any(tuner.plan_block()[k].ab_fixed for k in range(tuner.rules.block))


def test_falls_back_when_the_a_b_says_the_setting_is_slower():
    tuner = Tuner()
    drive(tuner, 200, times_by_setting({OWN: 0.95, FIXED_ORDER: 1.0, FAST: 1.25, NEXT: 0.9},
                                       noise=0.05),
          [Predicted(FAST, 1.2), Predicted(NEXT, 1.1)])
    assert [(d.reason, d.setting) for d in tuner.decisions] == [
        ("measure", OWN), ("switch", FAST), ("fall back", OWN)]
    fall_back = tuner.decisions[-1]
    assert fall_back.measured is not None and fall_back.measured < 0.9
    # It fell back within a few A/B pairs (one every 8 steps, at least 4 of them).
    assert fall_back.step <= 8 + 8 * 6


def test_a_fall_back_does_not_cascade_through_the_candidates_of_the_same_prediction():
    # The real CPU job's case: the replay over-predicts every candidate alike (each runs
    # 0.88x of its prediction). Rejecting the first, the tuner does not run the next ones,
    # predicted no faster by the same replay: the hint's own setting runs from then on.
    table = {OWN: 0.95, FIXED_ORDER: 1.0, FAST: 1 / (1.06 * 0.88),
             NEXT: 1 / (1.05 * 0.88), FASTER_ON_PAPER: 1 / (1.04 * 0.88)}
    predictions = [Predicted(OWN, 1.0), Predicted(FAST, 1.06), Predicted(NEXT, 1.05),
                   Predicted(FASTER_ON_PAPER, 1.04)]
    for seed in range(4):
        tuner = Tuner()
        drive(tuner, 400, times_by_setting(table, noise=0.05, seed=seed), predictions)
        assert [(d.reason, d.setting) for d in tuner.decisions] == [
            ("measure", OWN), ("switch", FAST), ("fall back", OWN)], seed


def test_later_predictions_count_at_the_replays_error_measured_by_a_fall_back():
    # The hint's own setting, predicted 1.0x, measured 0.9x before the first prediction
    # came: each candidate then counts at 0.9 of its prediction.
    def run(predictions: list) -> Tuner:
        tuner = Tuner()
        table = times_by_setting({OWN: 1 / 0.9, FIXED_ORDER: 1.0, FAST: 0.95, NEXT: 0.95},
                                 noise=0.02)
        for _ in range(80):
            step_run = tuner.next_run()
            tuner.observe(step_run, table(tuner.steps, step_run))
        assert tuner.setting == FIXED_ORDER
        drive(tuner, 40, table, [Predicted(OWN, 1.0), *predictions])
        return tuner
    assert run([Predicted(FAST, 1.2)]).setting == FAST  # 1.08 calibrated
    uncleared = run([Predicted(NEXT, 1.1)])  # 0.99 calibrated
    assert (uncleared.setting, uncleared.decisions[-1].reason) == (FIXED_ORDER, "no gain")


def test_a_setting_measured_slower_keeps_its_a_b_frequent_until_it_falls_back():
    # 6% slower than the fixed order, under noise that often needs well over settle_pairs
    # pairs for the fall-back's bound: they keep coming every ab_every steps meanwhile,
    # where one in ab_every_settled would leave it running to the end.
    rules = TuningRules()
    pairs_needed = []
    for seed in range(8):
        tuner = Tuner(rules)
        runs = []

        def seconds(step: int, run, table=times_by_setting(
                {OWN: 1.0, FIXED_ORDER: 1.0, FAST: 1.064}, noise=0.15, seed=seed)) -> float:
            runs.append(run)
            return table(step, run)
        drive(tuner, 1200, seconds, [Predicted(FAST, 1.1)])
        fall_back = next(d for d in tuner.decisions if d.reason == "fall back")
        assert fall_back.step <= 1200 - rules.ab_every_settled, seed
        pairs_needed.append(sum(run.ab_fixed for run in runs[:fall_back.step]))
    assert sum(n > rules.settle_pairs + 2 for n in pairs_needed) >= 4, pairs_needed


def test_a_setting_measured_faster_verifies_rarely_after_settle_pairs():
    rules = TuningRules()
    tuner = Tuner(rules)
    runs = []

    def seconds(step: int, run, table=times_by_setting(
            {OWN: 1.0, FIXED_ORDER: 1.0, FAST: 0.9}, noise=0.05)) -> float:
        runs.append(run)
        return table(step, run)
    drive(tuner, 300, seconds, [Predicted(FAST, 1.1)])
    at_fast = [i for i, run in enumerate(runs) if run.ab_fixed]
    gaps = [later - earlier for earlier, later in zip(at_fast, at_fast[1:])]
    assert gaps[:rules.settle_pairs - 1] == [rules.ab_every] * (rules.settle_pairs - 1)
    assert set(gaps[rules.settle_pairs:]) == {rules.ab_every_settled}
    assert [d.reason for d in tuner.decisions] == ["measure", "switch"]


def test_falls_back_to_the_hints_own_setting_when_no_candidate_is_left():
    tuner = Tuner()
    drive(tuner, 120, times_by_setting({OWN: 1.0, FIXED_ORDER: 1.0, FAST: 1.25}),
          [Predicted(FAST, 1.2)])
    assert tuner.setting == OWN
    assert tuner.decisions[-1].reason == "fall back"


def test_one_unlucky_step_does_not_make_it_fall_back():
    tuner = Tuner()
    table = times_by_setting({OWN: 1.0, FIXED_ORDER: 1.0, FAST: 0.9}, noise=0.05)

    def seconds(step: int, run) -> float:
        return 5.0 if step == 24 else table(step, run)  # next to the A/B step at 23
    drive(tuner, 200, seconds, [Predicted(FAST, 1.1)])
    assert [d.reason for d in tuner.decisions] == ["measure", "switch"]


def test_a_drift_in_the_step_times_measures_again_and_chooses_anew():
    tuner = Tuner()

    def seconds(step: int, run) -> float:
        slow = 1.0 if step < 100 else 1.5  # the data mix changes at step 100
        return slow * (1.0 if run.ab_fixed else 0.9)
    drive(tuner, 160, seconds, [Predicted(FAST, 1.1)])
    drift = [d for d in tuner.decisions if d.reason == "drift"]
    assert len(drift) == 1 and 100 < drift[0].step <= 100 + 24
    again = tuner.decisions[tuner.decisions.index(drift[0]) + 1]
    assert again.reason == "switch" and again.step <= drift[0].step + 16


def test_noise_alone_does_not_make_it_flap():
    tuner = Tuner()
    drive(tuner, 400, times_by_setting({OWN: 1.0, FIXED_ORDER: 1.0, FAST: 0.9}, noise=0.3,
                                       seed=3),
          [Predicted(FAST, 1.1)])
    assert [d.reason for d in tuner.decisions] == ["measure", "switch"]


def test_a_refined_prediction_takes_over_only_beyond_its_margin():
    tuner = Tuner()
    rounds = iter([[Predicted(FAST, 1.10), Predicted(NEXT, 1.05)],
                   [Predicted(FAST, 1.10), Predicted(NEXT, 1.105)],  # within the margin
                   [Predicted(FAST, 1.10), Predicted(NEXT, 1.108)]])
    for _ in range(48):
        run = tuner.next_run()
        tuner.observe(run, 1.0 if run.ab_fixed else 0.9)
        if tuner.wants_predictions is not None:
            tuner.choose(next(rounds))
    assert [d.reason for d in tuner.decisions] == ["measure", "switch"]

    tuner = Tuner()
    rounds = iter([[Predicted(FAST, 1.10), Predicted(NEXT, 1.05)],
                   [Predicted(FAST, 1.10), Predicted(NEXT, 1.05)],
                   [Predicted(FAST, 1.08), Predicted(FASTER_ON_PAPER, 1.12)]])
    for _ in range(48):
        run = tuner.next_run()
        tuner.observe(run, 1.0 if run.ab_fixed else 0.9)
        if tuner.wants_predictions is not None:
            assert tuner.wants_predictions.start == 0
            tuner.choose(next(rounds))
    assert [(d.reason, d.setting, d.step) for d in tuner.decisions][-1] == (
        "refine", FASTER_ON_PAPER, tuner.rules.refine_at[-1])


def test_decisions_take_effect_at_a_blocks_first_step_and_the_plan_says_each_step():
    tuner = Tuner(TuningRules(block=8, measure_steps=5))
    for _ in range(5):
        tuner.observe(tuner.next_run(), 1.0)
    decision = tuner.choose([Predicted(FAST, 1.2)])
    assert decision.step == 8 and tuner.setting == OWN
    plans = []
    for step in range(5, 40):
        if step % 8 == 0:
            plans += tuner.plan_block()
        run = tuner.next_run()
        if step >= 8:
            assert run == plans[step - 8]
        tuner.observe(run, 1.0 if run.ab_fixed else 0.9)
    assert tuner.setting == FAST
    assert [step for step, run in enumerate(plans, start=8) if run.ab_fixed] == [15, 23, 31, 39]
    with pytest.raises(RuntimeError, match="block"):
        tuner.observe(tuner.next_run(), 1.0)
        tuner.plan_block()


def test_the_drift_s_reference_keeps_the_latest_steps_sorted():
    times, seen = SettingTimes(window=10, reference=50), []
    rng = random.Random(0)
    for _ in range(300):
        seen.append(rng.uniform(0, 1))
        times.add(seen[-1])
        assert list(times.recent) == seen[-10:]
        assert times.earlier == sorted(seen[:-10][-50:])
        if times.earlier:
            assert times.earlier_median() == statistics.median(seen[:-10][-50:])


def test_a_step_costs_the_tuner_the_same_however_many_ran_at_the_setting():
    """A job runs its setting for hundreds of thousands of steps: the tuner's work per
    step must not grow with them (CPU time of the same 400 steps, early and late)."""
    tuner = Tuner()
    seconds = times_by_setting({OWN: 1.0, FAST: 0.8, FIXED_ORDER: 1.0}, noise=0.05)
    predicted = [Predicted(FAST, 1.25), Predicted(OWN, 1.0)]

    def cpu_of_400_steps() -> float:
        start = time.process_time()
        drive(tuner, 400, seconds, predicted)
        return time.process_time() - start

    drive(tuner, 200, seconds, predicted)
    early = cpu_of_400_steps()
    drive(tuner, 6000, seconds, predicted)
    late = cpu_of_400_steps()
    assert tuner.decisions[-1].setting == FAST and tuner.decisions[-1].step < 100
    assert late < 3 * early + 0.05


def test_the_rules_refuse_what_cannot_work():
    with pytest.raises(ValueError, match="multiple of block"):
        TuningRules(ab_every=10)
    with pytest.raises(ValueError, match="refine_at"):
        TuningRules(refine_at=(4,))
    with pytest.raises(ValueError, match="refine_at"):
        TuningRules(refine_at=(40, 16))
    with pytest.raises(ValueError, match="seconds"):
        Tuner().observe(Tuner().next_run(), float("nan"))
    with pytest.raises(RuntimeError, match="predictions"):
        Tuner().choose([])
