"""Microbatch sizes: the duration fits, what the policies make of them, and the simulated
workloads whose variability comes from the data."""

from __future__ import annotations

import math
import random
import statistics

import pytest

from rrfp.core.hints import build_hint
from rrfp.core.limits import resolve_buffer_limits
from rrfp.core.sizes import DurationFit, DurationModels, fit_durations, MicrobatchSize

# Sizes, fits and policies in the simulator: torch enters only through the hints (see
# tests/test_sim.py).
pytestmark = pytest.mark.simulator


def _documents(rng: random.Random, count: int) -> list[MicrobatchSize]:
    sizes = []
    for _ in range(count):
        lengths = [rng.randint(1, 4000) for _ in range(rng.randint(1, 5))]
        sizes.append(MicrobatchSize(tokens=sum(lengths), attention=sum(n * n for n in lengths),
                                    images=rng.randint(0, 8)))
    return sizes


def test_the_fit_is_exact_on_noiseless_data_linear_in_tokens_and_quadratic_in_lengths():
    sizes = _documents(random.Random(0), 40)

    def true(size: MicrobatchSize) -> float:  # MLP per token, attention per length squared
        return 0.003 + 2e-6 * size.tokens + 5e-10 * size.attention + 1e-4 * size.images

    fit = fit_durations([(size, true(size)) for size in sizes])
    assert fit.intercept == pytest.approx(0.003, rel=1e-7)
    assert fit.slopes == pytest.approx((2e-6, 5e-10, 1e-4), rel=1e-7)
    for size in _documents(random.Random(1), 10):  # sizes it was not fitted on
        assert fit.predict(size) == pytest.approx(true(size), rel=1e-9)


def test_a_number_that_does_not_vary_gets_no_slope_and_no_size_falls_back_to_the_mean():
    sizes = [MicrobatchSize(tokens=t, attention=t * 512) for t in (100, 300, 700, 1500)]
    # attention is a multiple of tokens and images never vary: tokens explain it all.
    samples = [(size, 1.0 + 0.01 * size.tokens) for size in sizes] + [(None, 40.0)]
    fit = fit_durations(samples)
    assert fit.predict(MicrobatchSize(tokens=1000, attention=512_000)) == pytest.approx(11.0)
    assert fit.slopes[2] == 0.0
    assert fit.mean == pytest.approx(statistics.mean(seconds for _, seconds in samples))
    assert fit.predict(None) == fit.mean
    unsized = fit_durations([(None, 1.0), (None, 3.0)])
    assert unsized.predict(MicrobatchSize(tokens=5)) == 2.0 == unsized.predict(None)


def test_models_fit_a_window_of_recent_steps_and_keep_their_own_over_shared_fits():
    models = DurationModels(window=2)
    sizes = [MicrobatchSize(tokens=t) for t in (1, 2, 3, 4)]
    for per_token in (5.0, 1.0, 1.0):  # the first step leaves the window
        models.record_step(sizes, [(0, "F", m, per_token * s.tokens) for m, s in enumerate(sizes)])
    assert models.predict(0, "F", MicrobatchSize(tokens=10)) == pytest.approx(10.0)
    assert models.predict(1, "F", sizes[0]) is None
    models.adopt({(0, "F"): DurationFit(mean=99.0, intercept=99.0),
                  (1, "F"): DurationFit(mean=7.0, intercept=7.0)})
    assert models.predict(0, "F", MicrobatchSize(tokens=10)) == pytest.approx(10.0)
    assert models.predict(1, "F", sizes[0]) == 7.0
    assert set(models.own_fits()) == {(0, "F")}


def test_the_prediction_error_is_per_stage_the_median_relative_error_before_learning():
    from rrfp.core.history import History

    history = History()
    sizes = [MicrobatchSize(tokens=t) for t in (1, 2, 4)]
    history.expect_sizes(sizes)
    assert history.prediction_errors([(0, "F", 0, 1.0)]) is None  # no fit yet
    history.record_step([(0, "F", m, 0.01 * t) for m, t in enumerate((1, 2, 4))])
    history.expect_sizes(sizes)
    # Stage 0's forwards were fitted at 0.01 s a token; measured now: 1x, 1.5x and 2x the
    # prediction; the gradient reduction (no microbatch) and stage 1 (no fit) are not
    # predicted.
    runs = [(0, "F", 0, 0.01), (0, "F", 1, 0.03), (0, "F", 2, 0.08), (0, "W", None, 1.0),
            (1, "F", 0, 0.5)]
    errors = history.prediction_errors(runs)
    assert list(errors) == [0]
    assert errors[0] == pytest.approx(statistics.median([0.0, 1 / 3, 0.5]), rel=1e-9)
    history.record_step(runs)  # learns from the step only after its error was taken
    history.expect_sizes([MicrobatchSize(tokens=1)] * 3)  # a packed batch: as without sizes
    assert history.prediction_errors(runs) is None


@pytest.mark.parametrize("bad", [dict(tokens=-1), dict(tokens=math.nan),
                                 dict(tokens=1, attention=math.inf), dict(tokens="8")])
def test_a_size_that_is_not_a_finite_non_negative_number_is_refused(bad):
    with pytest.raises(ValueError, match="finite number >= 0"):
        MicrobatchSize(**bad)


def test_lookahead_expects_the_duration_a_microbatch_size_predicts():
    from rrfp.core.arbiter import Arbiter
    from rrfp.core.policy import History, Lookahead

    hint = build_hint("1F1B", num_ranks=2, num_stages=2, n_microbatches=4)
    history = History()
    sizes = [MicrobatchSize(tokens=t) for t in (10, 20, 30, 40)]
    history.expect_sizes(sizes)
    history.record_step([(0, "F", m, 0.1 * s.tokens) for m, s in enumerate(sizes)])
    nodes = Arbiter(hint, 0, policy=Lookahead(history, lambda: 0.0)).nodes
    forward = next(n for n in nodes if n.kind == "F" and n.microbatch == 2)
    policy = Lookahead(history, lambda: 0.0)
    assert policy.duration(forward) == pytest.approx(2.5)  # no sizes: the stage's mean
    history.expect_sizes([MicrobatchSize(tokens=t) for t in (5, 5, 70, 5)])
    assert policy.duration(forward) == pytest.approx(7.0)


def test_critical_ranks_by_the_sizes_of_the_step_on_every_stage():
    """Rank 0 of 1F1B (4 ranks, hint+2) after its warm-up and one forward of slack: the
    stream heads are F(0, 5) and B(0, 0). Each stage costs in proportion to tokens (fits
    the other ranks shared). With the big microbatch last, B(0, 0) leads: the backwards
    free the memory microbatch 7's forward waits for, and its chain is the longest; with
    the big microbatch first (whose own backward is B(0, 0)), F(0, 5)'s chain is longer."""
    from rrfp.core.arbiter import Arbiter
    from rrfp.core.policy import History, make_policy

    hint = build_hint("1F1B", num_ranks=4, num_stages=4, n_microbatches=8)
    limits = resolve_buffer_limits("hint+2", hint)
    history = History()
    sizes = [MicrobatchSize(tokens=t) for t in range(1, 9)]
    history.models.adopt({(s, kind): fit_durations([(size, cost * size.tokens) for size in sizes])
                          for s in range(4) for kind, cost in (("F", 1.0), ("B", 2.0))})

    def most_critical(step_sizes: list[MicrobatchSize]) -> str:
        history.expect_sizes(step_sizes)
        arbiter = Arbiter(hint, 0, limits=limits, policy=make_policy("critical", history=history))
        for _ in range(5):  # F(0, 0..4)
            arbiter.record_launch(arbiter.nodes[arbiter.lead()].action)
        assert {str(n.action) for n in arbiter.stream_heads()} >= {"0F5", "0B0"}
        return str(arbiter.nodes[arbiter.lead()].action)

    small, big = MicrobatchSize(tokens=1), MicrobatchSize(tokens=50)
    assert most_critical([small] * 7 + [big]) == "0B0"
    assert most_critical([big] + [small] * 7) == "0F5"


def test_critical_scales_each_kind_cost_halfway_to_its_size_prediction_and_keeps_stages_alike():
    """Stage 0's forwards take twice stage 1's, each in proportion to tokens (1..8, mean
    4.5): an action costs its kind's cost, scaled SIZE_WEIGHT of the way from one to its
    size's prediction over its stage's mean; so one microbatch costs the same on either
    stage (the sizes rank a stage's microbatches, they do not reweigh the stages)."""
    from rrfp.core.policy import _size_scaled_costs, DEFAULT_COSTS, History, SIZE_WEIGHT
    from rrfp.core.actions import _Action, F, B

    hint = build_hint("1F1B", num_ranks=2, num_stages=2, n_microbatches=8)
    sizes = [MicrobatchSize(tokens=t) for t in range(1, 9)]
    history = History()
    history.models.adopt({(s, kind): fit_durations([(size, scale * size.tokens)
                                                     for size in sizes])
                          for s, scale in ((0, 2.0), (1, 1.0)) for kind in ("F", "B")})
    history.expect_sizes(sizes)
    costs = _size_scaled_costs(history, hint, DEFAULT_COSTS)
    for stage in (0, 1):
        for mb, size in enumerate(sizes):
            for kind, computation in (("F", F), ("B", B)):
                expected = DEFAULT_COSTS[kind] * (SIZE_WEIGHT * size.tokens / 4.5
                                                  + 1 - SIZE_WEIGHT)
                assert costs[_Action(stage, computation, mb)] == pytest.approx(expected)
    assert 0 < SIZE_WEIGHT < 1


def test_the_simulated_policy_is_told_sizes_and_predicts_from_earlier_steps_only():
    """Every rank predicts every stage's durations from the step's sizes and the fits of
    earlier steps (its own stages' and those the other ranks shared); never from the
    durations of the step it is deciding."""
    from rrfp.core.policy import HintOrder, register_policy
    from rrfp.core.settings import policy_names
    from rrfp.sim.engine import simulate
    from rrfp.sim.workloads import make_timing

    hint = build_hint("1F1B", num_ranks=4, num_stages=4, n_microbatches=8)
    limits = resolve_buffer_limits("hint+2", hint)
    seen: list[dict] = []

    def spy(history, clock):
        seen.append({(s, kind, m): history.predicted(s, kind, m)
                     for s in range(4) for kind in ("F", "B") for m in range(8)})
        return HintOrder()
    if "size-spy" not in policy_names():
        register_policy("size-spy", spy)
    earlier = make_timing("documents", 4, 8, 1)
    histories = simulate(hint, earlier.duration, policy="critical", limits=limits,
                         sizes=earlier.sizes).histories
    step = make_timing("documents", 4, 8, 2)
    simulate(hint, step.duration, policy="size-spy", limits=limits, histories=histories,
             sizes=step.sizes)
    assert len(seen) == 4
    for predicted in seen:
        for (s, kind, m), seconds in predicted.items():
            fit = fit_durations([(earlier.sizes[k], earlier.duration(a))
                                 for k in range(8)
                                 for a in hint.orders[s] if a.microbatch_index == k
                                 and a.computation_type.value == kind])
            assert seconds == pytest.approx(fit.predict(step.sizes[m]), rel=1e-9)
            truth = next(step.duration(a) for a in hint.orders[s]
                         if a.microbatch_index == m and a.computation_type.value == kind)
            assert abs(seconds - truth) > 1e-6  # the noise sizes do not explain


def test_without_sizes_that_tell_microbatches_apart_decisions_are_as_without_sizes():
    """A packed step (every microbatch alike) and a step without sizes after steps with
    them run exactly as if no size had ever been known."""
    from rrfp.sim.engine import simulate
    from rrfp.sim.workloads import make_timing

    hint = build_hint("1F1B", num_ranks=8, num_stages=8, n_microbatches=32)
    limits = resolve_buffer_limits("hint+2", hint)
    sized = make_timing("documents", 8, 32, 3)
    plain = simulate(hint, sized.duration, policy="critical", limits=limits).histories
    learned = simulate(hint, sized.duration, policy="critical", limits=limits,
                       sizes=sized.sizes).histories
    step = make_timing("jitter", 8, 32, 4)
    unsized = simulate(hint, step.duration, policy="critical", limits=limits, histories=plain)
    packed = simulate(hint, step.duration, policy="critical", limits=limits, histories=learned,
                      sizes=[MicrobatchSize(tokens=4096)] * 32)
    forgotten = simulate(hint, step.duration, policy="critical", limits=limits,
                         histories=learned)
    told = simulate(hint, step.duration, policy="critical", limits=limits, histories=learned,
                    sizes=sized.sizes)
    assert packed.realized == unsized.realized == forgotten.realized
    assert told.realized != unsized.realized  # sizes that differ do change the decisions


def test_size_driven_workloads_cost_what_their_sizes_say():
    from rrfp.sim.workloads import make_timing, WorkloadParams

    params = WorkloadParams()
    forwards, docs = [], make_timing("documents", 8, 64, 0)
    for seed in range(3):
        docs = make_timing("documents", 8, 64, seed)
        assert docs.activation_latency == make_timing("uniform", 8, 64, 0).activation_latency
        for s in range(8):
            work = [size.tokens + size.attention / params.attention_length
                    for size in docs.sizes]
            assert statistics.correlation(work, docs.forward[s]) > 0.99  # noise 5%
            forwards += docs.forward[s]
    cv = statistics.pstdev(forwards) / statistics.mean(forwards)
    assert 0.7 < cv < 1.3 and 0.9 < statistics.mean(forwards) < 1.1  # unpacked, mean 1
    assert docs.backward_input == docs.forward == docs.backward_weight
    vlm = make_timing("multimodal-unpacked-latency", 8, 64, 0)
    images = [size.images for size in vlm.sizes]
    assert statistics.correlation(images, vlm.forward[0]) > 0.95  # the vision encoder
    # Image tokens enter the language stages' sequences.
    assert all(size.tokens >= 576 * size.images for size in vlm.sizes)
    assert statistics.correlation([s.tokens for s in vlm.sizes], vlm.forward[7]) > 0.9
    assert statistics.median(x for row in vlm.activation_latency[:-1] for x in row) > 0.05


def test_sizes_survive_a_replay_file(tmp_path):
    from rrfp.sim.workloads import make_timing, Timing

    timing = make_timing("multimodal-unpacked", 4, 6, 0)
    timing.save(tmp_path / "t.json")
    assert Timing.load(tmp_path / "t.json") == timing
    unsized = make_timing("jitter", 4, 6, 0)
    unsized.save(tmp_path / "u.json")
    assert Timing.load(tmp_path / "u.json").sizes is None


def test_knowing_sizes_gains_where_costs_follow_them():
    """1F1B 8 x 32 at hint+2, unpacked multimodal (seeds 0-2): told the sizes, the default
    ranks by what each microbatch will cost on every stage and takes more."""
    from rrfp.sim.study import compare

    hint = build_hint("1F1B", num_ranks=8, num_stages=8, n_microbatches=32)

    def mean_speedup(sizes_known: bool) -> float:
        return statistics.mean(compare(hint, "multimodal-unpacked", seed, limit="hint+2",
                                       sizes_known=sizes_known).speedup for seed in range(3))
    assert mean_speedup(True) > mean_speedup(False) + 0.005


def test_the_simulator_cli_tells_the_ranks_sizes_when_asked(capsys):
    from rrfp.sim.__main__ import main

    argv = ["--pp", "4", "--microbatches", "16", "--workload", "multimodal-unpacked",
            "--limit", "hint+2", "--seeds", "1"]

    def rrfp_makespan(extra: list[str]) -> str:
        main(argv + extra)
        out = capsys.readouterr().out
        assert ("sizes known" in out) == bool(extra)
        return out.splitlines()[2].split()[2]
    assert rrfp_makespan(["--sizes-known"]) != rrfp_makespan([])


def test_the_default_told_the_sizes_is_never_slower_than_not_told_and_still_gains_by_them():
    """Simulated, 1F1B at hint+2 (the default there reads sizes): where one stage's cost
    follows the images and that stage is the pipeline's bottleneck (first or middle),
    telling the default the sizes must not make it slower than not telling it; on
    documents of variable length the sizes still buy time."""
    from rrfp.core.tuning import Candidate
    from rrfp.sim.families import drawn, sized_stage
    from rrfp.sim.selfdriving import predict

    hint = build_hint("1F1B", num_ranks=4, num_stages=4, n_microbatches=16)
    told, not_told = Candidate("hint+2", None, True), Candidate("hint+2", None, False)

    def speedups(timings) -> tuple[float, float]:
        with_sizes, without = predict(hint, timings, [told, not_told])
        return with_sizes.speedup, without.speedup
    for stage in (0, 2):
        family = sized_stage(4, 16, stage=stage, balanced=False)
        for seed in (0, 1):
            with_sizes, without = speedups(family(seed, 8))
            assert with_sizes >= without * (1 - 1e-6), (stage, seed, with_sizes, without)
    with_sizes, without = speedups(drawn("documents", 4, 16)(0, 6))
    assert with_sizes > without * 1.001
