"""Self-driving RRFP in a job (``Settings(tune_within=...)``): every rank runs what the
deciding rank chose, from the same step, on an emulated device; the gradients stay
torch's fixed schedule's in every step (``rrfp.testing.self_driving_world``)."""

from __future__ import annotations

import dataclasses
import os
import pickle
import signal
import subprocess
import sys
import time

import pytest

from rrfp.advise.cost import CPU_SHARE
from rrfp.advise.tuning import predict_candidates, PredictionProcess
from rrfp.core.limits import resolve_buffer_limits
from rrfp.core.policy import policy_for, SIZE_READING_POLICIES
from rrfp.core.sizes import MicrobatchSize
from rrfp.core.tuning import TuningRules
from rrfp.runtime.self_driving import BlockPlan
from rrfp.testing.self_driving_world import self_driving_world
from rrfp.testing.worlds import run_local_world

pytestmark = pytest.mark.timeout(300)

FIRST = TuningRules().measure_steps
"""The first step a decision can take effect at (its predictions made at once)."""
STEPS = 20
"""Enough for the first choice and some blocks after it."""


def first_change(values: list) -> int | None:
    return next((i for i in range(1, len(values)) if values[i] != values[i - 1]), None)


def test_every_rank_switches_at_the_same_step_within_a_byte_budget_and_stays_bitwise():
    # 1F1B on 2 ranks: each rank's fixed order holds 4096 B at its peak (rank 0: two
    # microbatches of 2048 B; rank 1: one of 4096 B). 12 KiB lets each hold two more.
    # The budget's top setting predicted fastest (forced: the advisor's predictions from
    # the first 4 emulated steps ranged 1.01x-1.10x over runs of this world).
    ranks = run_local_world(2, self_driving_world, "gains", STEPS, "12KiB", 0, 0.002,
                            "top limit", timeout=240)
    decisions = {tuple(r["decisions"]) for r in ranks}
    assert len(decisions) == 1, decisions
    [(first, *_)] = decisions
    assert first.startswith(f"from step {FIRST}: buffer_limit='hint+2'") and "(switch" in first, \
        first
    for rank, r in enumerate(ranks):
        assert r["fixed_bytes"] == 4096
        assert first_change(r["limits"]) == FIRST, r["limits"]
        assert r["limits"][FIRST] == r["limits"][0] + 2
        assert all(r["bitwise"]), rank
        # Metered on the tensors in every step: never above the budget.
        assert max(r["bytes"]) <= 12 * 1024, r["bytes"]
    assert max(max(r["bytes"][FIRST:]) for r in ranks) > 4096  # the slack was used
    # The plans and shared traces are deleted once read: the keys the run leaves (its
    # groups', its board's) do not grow with the steps, where each step's trace per rank
    # alone would leave more than one key per rank and step.
    assert ranks[0]["keys_added"] < 2 * STEPS, ranks[0]["keys_added"]


def test_where_nothing_is_predicted_to_gain_every_rank_keeps_the_hints_own_setting():
    ranks = run_local_world(2, self_driving_world, "uniform", STEPS, "hint+2", 0, 0.002,
                            "no gain", timeout=240)
    for r in ranks:
        assert r["decisions"] == [f"from step {FIRST}: buffer_limit='hint', the default policy (no "
                                  "gain; predicted 1.000x the fixed schedule)"]
        assert set(r["limits"]) == {r["limits"][0]}
        # The in-run A/B keeps running against the fixed order.
        assert r["policy"][FIRST:].count("fixed") >= 1
        assert all(r["bitwise"])


def test_a_setting_without_sizes_keeps_them_from_the_policy_of_every_step_it_runs():
    # Every step is given its microbatch sizes; the measured steps' traces carry them to
    # the prediction, which (forced where they arrived) picks the critical policy without.
    ranks = run_local_world(2, self_driving_world, "gains", STEPS, "hint+2", 0, 0.002,
                            "without sizes", CPU_SHARE, True, timeout=240)
    for rank, r in enumerate(ranks):
        assert r["decisions"] == [
            f"from step {FIRST}: buffer_limit='hint+2', policy='critical', sizes not used "
            "(switch; predicted 1.500x the fixed schedule)"], r["decisions"]
        assert all(r["bitwise"]), rank
        assert set(r["policy"][FIRST:]) == {"critical", "fixed"}, r["policy"]
        # Each step's stats record the sizes it was given, told to its policy or not.
        assert all(sizes is not None and len(sizes) == 8 for sizes in r["sizes"])
        assert r["sizes_used"] == [True] * FIRST + [False] * (STEPS - FIRST), r["sizes_used"]
        # Told them (once a step fitted durations to them), the policy predicts from them
        # (the prediction's error is said); not told, it cannot.
        assert all(error is not None for error in r["size_error"][1:FIRST]), r["size_error"]
        assert all(error is None for error in r["size_error"][FIRST:]), r["size_error"]


def test_with_tune_hints_every_rank_switches_to_an_interchangeable_hint_and_stays_bitwise():
    # 1F1B's interchangeable hints (GPipe first) rank at the budget's limits, counted on
    # 1F1B; the first, at the top limit, predicted fastest (forced).
    ranks = run_local_world(2, self_driving_world, "gains", STEPS, "12KiB", 0, 0.002,
                            "other hint", CPU_SHARE, False, True, timeout=240)
    for rank, r in enumerate(ranks):
        assert r["decisions"] == [
            f"from step {FIRST}: hint='GPipe', buffer_limit='hint+2', the default policy "
            "(switch; predicted 1.500x the fixed schedule)"], r["decisions"]
        # Ranked by GPipe from the switch on, except the A/B's fixed steps (1F1B's order).
        assert r["ranked_by"][:FIRST] == [None] * FIRST
        ranked = {(by, policy == "fixed") for by, policy in zip(r["ranked_by"][FIRST:],
                                                                r["policy"][FIRST:])}
        assert ranked == {("GPipe", False), (None, True)}, ranked
        assert r["limits"][FIRST] == r["limits"][0] + 2
        assert all(r["bitwise"]), rank
        assert max(r["bytes"]) <= 12 * 1024, r["bytes"]
    # Rank 0 holds two microbatches of 2048 B under 1F1B; GPipe's order at 4 runs ahead.
    assert max(ranks[0]["bytes"][FIRST:]) > 4096


def test_without_tune_hints_no_other_hint_is_offered():
    ranks = run_local_world(2, self_driving_world, "gains", 8, "12KiB", 0, 0.002,
                            "other hint", timeout=240)
    for r in ranks:
        assert "no gain" in r["decisions"][0], r["decisions"]
        assert set(r["ranked_by"]) == {None}


def test_a_budget_the_fixed_schedule_does_not_fit_is_refused_on_every_rank():
    ranks = run_local_world(2, self_driving_world, "gains", STEPS, "3KiB", timeout=240)
    errors = {r.get("error") for r in ranks}
    assert len(errors) == 1, errors
    [error] = errors
    assert error.startswith("tune_within='3KiB': the fixed schedule itself holds")
    assert "give a budget of at least 4096 B" in error


def test_a_plan_reads_back_as_it_was_said():
    plan = BlockPlan((("hint+2", None, True, None, False),
                      ("hint+1", "critical", False, None, False),
                      ("hint+1", None, True, "GPipe", False), ("hint", "fixed", True, None, True)),
                     True,
                     ("from step 8: ...",), None, "predicting from steps 0-3 waits ...")
    assert BlockPlan.decode(plan.encode()) == plan


def test_the_prediction_process_predicts_what_the_advisor_predicts_and_is_kept(
        tmp_path, monkeypatch):
    from rrfp.advise import read_run
    from tests.test_advise import write_run

    # At nice 19 the process gets next to no CPU beside a loaded machine's busy processes
    # (it timed out in CI beside a simulation); what it predicts is the point here.
    monkeypatch.setattr("rrfp.advise.tuning.lower_priority", lambda *a, **k: None)

    write_run(tmp_path / "run", steps=4, ranks=2)
    run, _ = read_run(str(tmp_path / "run"))
    inline = predict_candidates(run, ["hint", "hint+1"], ["GPipe"])
    assert any(p.setting.hint == "GPipe" for p in inline)
    process = PredictionProcess()
    try:
        predicted, starting = process.predict(run, ["hint", "hint+1"], ["GPipe"])
        assert predicted == inline
        assert process.started
        again, kept = process.predict(run, ["hint", "hint+1"], ["GPipe"])
        assert again == inline
        # CPU seconds, not wall time: the first includes the interpreter importing torch.
        assert 0 < kept < starting / 2 < 60, (starting, kept)
        with pytest.raises(RuntimeError, match="(?s)the self-driving prediction failed: .*"
                                               "AttributeError"):
            process.predict(None, ["hint"], [])  # the process raises and ends
        assert not process.started
        assert process.predict(run, ["hint", "hint+1"], ["GPipe"])[0] == inline  # another
    finally:
        process.close()
    assert not process.started
    assert pickle.loads(pickle.dumps(inline)) == inline


def test_an_interchangeable_hint_is_predicted_at_the_runs_own_limits(tmp_path):
    from rrfp.advise import read_run
    from rrfp.advise.predict import predictions, Setting
    from tests.test_advise import write_run

    write_run(tmp_path / "run", steps=3, ranks=2)
    run, _ = read_run(str(tmp_path / "run"))
    assert run.hint.name == "1F1B"
    own_limits = resolve_buffer_limits("hint", run.hint)
    _, [kept] = predictions(run, [Setting("GPipe", "hint", limits_on_run_hint=True)])
    _, [its_own] = predictions(run, [Setting("GPipe", "hint")])
    assert kept.limits == own_limits
    assert its_own.limits.per_rank[0] > own_limits.per_rank[0]  # GPipe holds every microbatch
    assert kept.speedups != its_own.speedups


def test_steps_ranked_by_an_interchangeable_hint_replay_ranked_by_it_against_the_runs_fixed_order():
    from rrfp.advise import run_from_trace_events
    from rrfp.advise.predict import replay
    from rrfp.core.hints import build_hint
    from rrfp.sim.workloads import make_timing
    from tests.test_advise import simulated_step_stats

    hint = build_hint("1F1B", num_ranks=2, num_stages=2, n_microbatches=8)
    steps = [[event for stats in simulated_step_stats(hint, make_timing("bursty", 2, 8, k), k,
                                                      buffer_limit="hint+2")
              for event in dataclasses.replace(stats, ranked_by="GPipe").chrome_trace_events()]
             for k in range(4)]
    run = run_from_trace_events(steps, "ranked by GPipe")
    assert (run.hint.name, run.ranked_by.name) == ("1F1B", "GPipe")
    as_own = dataclasses.replace(run, ranked_by=None)
    assert replay(run).fixed == replay(as_own).fixed
    # Ranked by GPipe, the replay's ranks count other actions as out of (ranking) order.
    assert ([r.out_of_order for r in replay(run).own_results]
            != [r.out_of_order for r in replay(as_own).own_results])


def test_a_policy_reading_sizes_is_a_candidate_told_them_and_not_where_they_tell_apart(
        tmp_path):
    from rrfp.advise import read_run
    from tests.test_advise import SIZES, write_run

    packed = [MicrobatchSize(tokens=2)] * 4
    for name, sizes in (("sized", list(SIZES)), ("packed", packed), ("none", None)):
        write_run(tmp_path / name, ranks=2, microbatches=4, steps=3, sizes=sizes)
        run, _ = read_run(str(tmp_path / name))
        settings = {p.setting for p in predict_candidates(run, ["hint", "hint+1"])}
        without = {s for s in settings if not s.use_sizes}
        if name != "sized":  # none told microbatches apart: told or not runs alike
            assert not without, (name, without)
            continue
        assert without
        for setting in without:  # each beside its twin told the sizes; none runs alike
            assert dataclasses.replace(setting, use_sizes=True) in settings, setting
            limits = resolve_buffer_limits(setting.buffer_limit, run.hint)
            assert policy_for(setting.policy, run.hint, limits) in SIZE_READING_POLICIES, setting


def test_a_failed_prediction_keeps_the_hints_own_setting(caplog):
    import concurrent.futures

    from rrfp.comm.board import JobScope
    from rrfp.core.hints import build_hint
    from rrfp.core.settings import parse_buffer_limit
    from rrfp.runtime.self_driving import SelfDriving

    hint = build_hint("1F1B", num_ranks=2, num_stages=2, n_microbatches=4)
    driving = SelfDriving(parse_buffer_limit("hint+2"), hint, 0, JobScope("", None, ()),
                          (0,), 10.0)
    for _ in range(8):  # the measured steps
        driving.tuner.observe(driving.tuner.next_run(), 1.0)
    failed = concurrent.futures.Future()
    failed.set_exception(RuntimeError("the child died"))
    with caplog.at_level("WARNING"):
        driving.hand_over(failed)
    assert "the prediction failed" in caplog.text and "the child died" in caplog.text
    assert driving.tuner.decisions[-1].reason == "no gain"
    assert driving.tuner.setting.buffer_limit == "hint"


STARTS_A_PREDICTION_CHILD = """
import subprocess, sys, time
from rrfp.advise import child_environment
child = subprocess.Popen([sys.executable, "-m", *sys.argv[1].split()], stdin=int(sys.argv[2]),
                         stdout=subprocess.DEVNULL, env=child_environment())
print(child.pid, flush=True)
time.sleep(300)
"""


@pytest.mark.parametrize("command, when", [("rrfp.advise.tuning", "reading"),
                                           ("rrfp.advise - --json", "starting")])
def test_a_prediction_child_exits_once_the_trainer_that_started_it_is_killed(command, when):
    # Its standard input stays open (this test holds its write end): only the parent's
    # death can end the child, which would otherwise wait, or predict, for nobody. The
    # trainer is killed at once, or once the child waits for its input.
    read_end, write_end = os.pipe()
    trainer = subprocess.Popen([sys.executable, "-c", STARTS_A_PREDICTION_CHILD, command,
                                str(read_end)], stdout=subprocess.PIPE, text=True,
                               pass_fds=(read_end,))
    os.close(read_end)
    child = int(trainer.stdout.readline())
    try:
        deadline = time.monotonic() + 120
        while when == "reading" and not _reading_a_pipe(child):
            assert time.monotonic() < deadline, "the child never read its input"
            time.sleep(0.05)
        trainer.kill()
        trainer.wait()
        deadline = time.monotonic() + 60
        while _running(child) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not _running(child), "the prediction child outlived its parent"
    finally:
        os.close(write_end)
        if _running(child):
            os.kill(child, signal.SIGKILL)


def _reading_a_pipe(pid: int) -> bool:
    with open(f"/proc/{pid}/wchan") as f:
        return "pipe" in f.read()


def _running(pid: int) -> bool:
    """Whether ``pid`` runs (a process that exited and was not reaped yet does not)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


@pytest.mark.skipif(not hasattr(os, "SCHED_IDLE"), reason="Linux scheduling classes")
def test_the_prediction_child_gets_a_share_of_a_busy_core_not_only_idle_time():
    # SCHED_IDLE would starve it where every core trains; nice 19 keeps a small share.
    from rrfp.advise import lower_priority

    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        lower_priority(child.pid, idle=False)
        assert os.sched_getscheduler(child.pid) == os.SCHED_OTHER
        assert os.getpriority(os.PRIO_PROCESS, child.pid) == 19
        lower_priority(child.pid)
        assert os.sched_getscheduler(child.pid) == os.SCHED_IDLE
    finally:
        child.kill()
        child.wait()


def test_a_limit_plan_ranked_by_another_hint_keeps_the_runs_limits():
    from rrfp.core.hints import build_hint
    from rrfp.runtime.limit_plan import LimitPlan

    shape = dict(num_ranks=2, num_stages=2, n_microbatches=8)
    own, gpipe = build_hint("1F1B", **shape), build_hint("GPipe", **shape)
    ranked = LimitPlan("hint+1", own, 0, None, ranked_by=gpipe)
    assert ranked.limits == LimitPlan("hint+1", own, 0, None).limits
    assert (ranked.hint, ranked.ranked_by) == (own, gpipe)
    with pytest.raises(ValueError, match="counted in microbatches only"):
        LimitPlan("busiest", own, 0, None, ranked_by=gpipe)
