"""The arbiter alone: readiness, stream order, backpressure, and deadlock freedom."""

from __future__ import annotations

import math
import random

import pytest

from rrfp.core.actions import _Action, B, Edge, F, I, INPUT_GRAD_KINDS, W, WEIGHT_GRAD_KINDS
from rrfp.core.arbiter import Arbiter, check_deadlock_free
from rrfp.core.hints import build_hint, HINT_NAMES
from rrfp.core.limits import MemoryLimits, resolve_buffer_limits
from rrfp.core.policy import make_policy, POLICIES
from rrfp.sim.engine import simulate
from rrfp.testing.probes import held_from_order
from tests.test_hints import microbatches_of

FITTING = {"1F1B": (1, "loop"), "GPipe": (1, "loop"), "Interleaved1F1B": (2, "loop"),
           "LoopedBFS": (2, "loop"), "InterleavedZeroBubble": (2, "loop"),
           "ZBVZeroBubble": (2, "v"), "DualPipeV": (2, "v"), "BF": (2, "loop"), "BFW": (2, "v")}


def _hint(name="1F1B", num_ranks=2, per_rank=1, M=4, layout="loop"):
    return build_hint(name, num_ranks=num_ranks, num_stages=num_ranks * per_rank,
                      n_microbatches=M, layout=layout)


def test_a_forward_waits_for_its_activation_and_then_runs():
    arbiter = Arbiter(_hint(), rank=1, policy=make_policy("hint"))
    assert arbiter.choose() is None
    (wait,) = [w for w in arbiter.waits() if w.action == _Action(1, F, 0)]
    assert wait.peer_rank == 0 and "input activation from stage 0" in wait.reason
    arbiter.deliver(Edge(0, 1), 0)
    assert arbiter.choose() == _Action(1, F, 0)


def test_streams_keep_hint_order_even_when_later_inputs_arrive_first():
    hint = _hint()
    arbiter = Arbiter(hint, rank=0, limits=resolve_buffer_limits("hint", hint),
                      policy=make_policy("hint"))
    for _ in range(2):
        arbiter.record_launch(arbiter.choose())  # 0F0, 0F1
    arbiter.deliver(Edge(1, 0), 1)  # gradient of microbatch 1 before that of 0
    assert arbiter.choose() is None  # 0B1 must wait for 0B0; 0F2 for backpressure
    arbiter.deliver(Edge(1, 0), 0)
    assert arbiter.choose() == _Action(0, B, 0)


def test_backpressure_holds_forwards_until_a_backward_runs():
    hint = _hint()
    arbiter = Arbiter(hint, rank=0, limits=MemoryLimits({0: 1, 1: 1}, {0: 1, 1: 1}),
                      policy=make_policy("hint"))
    arbiter.record_launch(arbiter.choose())  # 0F0
    assert arbiter.choose() is None
    assert any("backpressure" in w.reason for w in arbiter.waits())
    assert arbiter.backpressure_entries[0] == 1
    arbiter.deliver(Edge(1, 0), 0)
    arbiter.record_launch(arbiter.choose())  # 0B0
    assert arbiter.choose() == _Action(0, F, 1)
    with pytest.raises(RuntimeError, match="launched out of turn"):
        arbiter.record_launch(_Action(0, F, 3))


def test_ready_lower_ranked_action_runs_when_the_next_one_is_not_ready():
    # Rank 1 of GPipe: F0..F3 then B0..B3. B0 is ready as soon as F0 ran (last stage).
    arbiter = Arbiter(_hint("GPipe"), rank=1, policy=make_policy("hint"))
    arbiter.deliver(Edge(0, 1), 0)
    arbiter.record_launch(arbiter.choose())  # 1F0
    assert arbiter.choose() == _Action(1, B, 0)
    arbiter.record_launch(_Action(1, B, 0))
    assert arbiter.out_of_order == 1


@pytest.mark.parametrize("spec,expected", [
    ("hint", ({0: 2, 1: 1}, {0: 2, 1: 1})), ("hint+2", ({0: 4, 1: 3}, {0: 4, 1: 3})),
    ("HINT + 1", ({0: 3, 1: 2}, {0: 3, 1: 2})), (3, ({0: 3, 1: 3}, {0: 3, 1: 3})),
    ("busiest", ({0: 2, 1: 2}, {0: 2, 1: 2})), (" Busiest", ({0: 2, 1: 2}, {0: 2, 1: 2})),
])
def test_buffer_limit_specs(spec, expected):
    assert resolve_buffer_limits(spec, _hint()) == MemoryLimits(*expected)


def test_limits_count_until_the_last_backward_piece_and_per_rank():
    # ZBV on 2 ranks x 2 stages, 4 microbatches: rank 0 holds stages 0 and 3.
    hint = _hint("ZBVZeroBubble", 2, 2, 4, "v")
    limits = resolve_buffer_limits("hint", hint)
    assert limits.per_stage == hint.plan.stage_peaks
    assert limits.per_rank == hint.plan.rank_peaks()
    # The per-rank peak is the most held at once, below the sum of the stages' peaks.
    assert hint.plan.rank_peaks()[0] <= sum(hint.plan.stage_peaks[s] for s in (0, 3))
    # A split backward holds its microbatch until W, not until I: run rank 0's fixed order.
    arbiter = Arbiter(hint, rank=0, limits=limits, policy=make_policy("fixed"))
    for node in list(arbiter.nodes):
        if node.message is not None:
            arbiter.deliver(*node.message)
        held = arbiter.held
        arbiter.record_launch(node.action)
        change = {F: 1, I: 0, W: -1, B: -1}.get(node.action.computation_type, 0)
        assert arbiter.held == held + change, node.action
    assert arbiter.peak_held == hint.plan.rank_peaks()[0]


def test_limits_below_the_rank_peak_of_a_multi_stage_rank_are_refused():
    hint = _hint("Interleaved1F1B", 2, 2, 4)
    with pytest.raises(ValueError, match="holds stages .* needs to be deadlock-free"):
        resolve_buffer_limits(1, hint)
    resolve_buffer_limits(max(hint.plan.rank_peaks().values()), hint)


@pytest.mark.parametrize("spec", [0, -1, "hint-1", "twice", 2.5, True, None])
def test_bad_buffer_limit_specs(spec):
    with pytest.raises(ValueError, match="buffer_limit"):
        resolve_buffer_limits(spec, _hint())


def test_a_hint_whose_ranks_wait_on_each_other_is_rejected():
    hint = build_hint({0: ["0F0", "0B0", "0F1", "0B1"], 1: ["1F1", "1F0", "1B0", "1B1"]},
                      num_ranks=2, num_stages=2, n_microbatches=2)
    with pytest.raises(ValueError, match="deadlocks when run in its own order"):
        check_deadlock_free(hint)


@pytest.mark.parametrize("name", HINT_NAMES)
def test_no_deadlock_and_memory_bound_under_random_timings(name):
    """Every limit the constructor accepts, every policy, random durations, latencies and
    launch depths: the step completes, holds within its limits per stage and per rank, and
    keeps every stream in hint order (hundreds of random timings per hint)."""
    per_rank, layout = FITTING[name]
    runs, deep = 0, [0]
    for num_ranks, M in ((2, 4), (4, 8)):
        hint = _hint(name, num_ranks, per_rank, M, layout)
        at_hint = resolve_buffer_limits("hint", hint)
        for limit in (1, 2, 3, "hint", "hint+1", "hint+2", 32):
            try:
                limits = resolve_buffer_limits(limit, hint)
            except ValueError:
                # Refused only below the hint's peaks, where that is not deadlock-free.
                assert isinstance(limit, int)
                assert (not hint.plan.streams_share_one_order()
                        or any(len(hint.stages_on(r)) > 1 and limit < peak
                               for r, peak in hint.plan.rank_peaks().items()))
                continue
            for policy in POLICIES:
                if policy == "fixed" and any(
                        limits.per_stage[s] < at_hint.per_stage[s] for s in at_hint.per_stage):
                    continue  # the fixed order needs its own peaks (ScheduleRRFP refuses)
                histories = None
                for seed in range(5):
                    rng = random.Random(f"{name}/{limit}/{policy}/{seed}")
                    durations = {}

                    def duration(action):
                        return durations.setdefault(action, rng.expovariate(1.0))

                    launch_depth = rng.choice((1, 2, math.inf))
                    result = simulate(
                        hint, duration, latency=lambda e, m: rng.expovariate(2.0),
                        policy=policy, limits=limits, histories=histories,
                        launch_depth=launch_depth, launch_cost=rng.random() / 5,
                        reorder_ahead=rng.random() < 0.3)
                    runs += 1
                    histories = result.histories
                    # Held counts recomputed from the realized order, not the arbiter's.
                    for rank, realized in result.realized.items():
                        stage_peaks, rank_peak = held_from_order(realized)
                        for stage, peak in stage_peaks.items():
                            assert peak <= limits.per_stage[stage]
                            assert peak == result.peak_in_flight[stage]
                        assert rank_peak <= limits.per_rank[rank]
                        assert rank_peak == result.rank_peaks[rank]
                        # A launch never finds launch_depth actions ahead of it.
                        assert result.most_behind[rank] < launch_depth
                        if launch_depth > 1:
                            deep[0] += result.most_behind[rank] > 0
                    for rank, realized in result.realized.items():
                        for stage in hint.stages_on(rank):
                            for kinds in (frozenset({F}), INPUT_GRAD_KINDS, WEIGHT_GRAD_KINDS):
                                ran = [a.microbatch_index for a in realized
                                       if a.stage_index == stage and a.computation_type in kinds]
                                assert ran == microbatches_of(hint, stage, kinds)
    assert runs >= 200
    assert deep[0] > 0  # launches behind earlier ones happened where the depth allowed them


def test_the_log_says_what_the_limit_allows_and_where_the_gains_are():
    from rrfp.runtime.limit_plan import GAINS_PAGE, limit_summary

    hint = build_hint("1F1B", num_ranks=4, num_stages=4, n_microbatches=8)
    for spec, says in (("hint", "allows no activation memory beyond the fixed schedule's (4 "
                                "microbatches on this rank), so RRFP mostly follows the hint"),
                       ("hint+2", "allows 6 microbatches of activations on this rank, 2 more "
                                  "than the fixed schedule holds"),
                       (2, "allows 2 microbatches of activations on this rank, fewer than "
                           "the 4 the fixed schedule holds")):
        summary = limit_summary(spec, resolve_buffer_limits(spec, hint), hint, rank=0)
        assert says in summary, summary
        # Where the measured gains are: a page, not figures that would go stale here.
        assert (GAINS_PAGE in summary) == (spec != 2), summary


def test_policies_depend_on_the_arbiter_never_the_other_way():
    """hints <- arbiter <- policy: no module reaches back up the chain, not even for types
    (an import under TYPE_CHECKING counts), so the arbiter and its policies form no cycle."""
    import ast
    import pathlib

    root = pathlib.Path(__file__).resolve().parents[1] / "rrfp" / "core"
    modules = ("settings", "hints", "arbiter", "graph", "policy")

    def imports(name: str) -> set[str]:
        tree = ast.parse((root / f"{name}.py").read_text())
        found = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("rrfp.core."):
                found.add(node.module.split(".")[2])
            elif isinstance(node, ast.Import):
                found.update(a.name.split(".")[2] for a in node.names
                             if a.name.startswith("rrfp.core."))
        return found & set(modules)

    graph = {m: imports(m) for m in modules}
    assert "policy" not in graph["arbiter"] and "graph" not in graph["arbiter"]
    assert graph["settings"] == set()
    # No cycle: every module imports only modules earlier in one order.
    order = {m: i for i, m in enumerate(("settings", "hints", "arbiter", "graph", "policy"))}
    for module, uses in graph.items():
        assert all(order[u] < order[module] for u in uses), (module, uses)


def test_busiest_gives_every_rank_the_busiest_ranks_peak_and_no_more():
    # Interleaved1F1B on 4 ranks: the ranks' own peaks differ; "busiest" lifts every rank
    # to the largest, so no rank holds more than the fixed schedule's busiest one.
    hint = _hint("Interleaved1F1B", 4, 2, 8)
    peaks = hint.plan.rank_peaks()
    assert len(set(peaks.values())) > 1
    limits = resolve_buffer_limits("busiest", hint)
    assert set(limits.per_rank.values()) == {max(peaks.values())}
    assert set(limits.per_stage.values()) == {max(peaks.values())}


@pytest.mark.parametrize("name,per_rank,limit,expected", [
    ("1F1B", 1, "hint", "lookahead"), ("1F1B", 1, "busiest", "lookahead"),
    ("1F1B", 1, 8, "lookahead"), ("1F1B", 1, "hint+1", "lookahead"),
    ("1F1B", 1, "hint+2", "critical"), ("1F1B", 1, "2x hint", "critical"),
    ("1F1B", 1, 32, "critical"), ("Interleaved1F1B", 2, "hint+1", "lookahead"),
    ("Interleaved1F1B", 2, "hint+2", "lookahead"), ("BF", 2, "hint+2", "BF"),
    ("ZBVZeroBubble", 2, "hint+1", "lookahead"), ("ZBVZeroBubble", 2, "2x hint", "drain"),
    ("InterleavedZeroBubble", 2, 32, "hint"), ("DualPipeV", 2, 32, "lookahead"),
])
def test_default_policy_leaves_lookahead_only_with_slack_on_every_rank(
        name, per_rank, limit, expected):
    from rrfp.core.policy import default_policy
    hint = _hint(name, 8, per_rank, 32, layout="v" if name.endswith("V") else "loop")
    assert default_policy(hint, resolve_buffer_limits(limit, hint)) == expected
