"""The predictions' CPU share (``rrfp.advise.cost``): a prediction made beside training
starts only where its expected CPU fits what the share has granted since the first step."""

from __future__ import annotations

import math
import time

import pytest
import torch

from rrfp.advise.cost import CpuBudget, prediction_cpu_seconds
from rrfp.comm.board import JobScope
from rrfp.core.hints import build_hint
from rrfp.core.settings import parse_buffer_limit
from rrfp.core.tuning import Candidate, Predicted
from rrfp.runtime.limit_plan import LimitPlan
from rrfp.sim.workloads import make_timing, Timing
from tests.test_advise import simulated_step_stats

pytestmark = pytest.mark.timeout(120)


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_the_share_grants_cpu_with_the_time_on_every_core_and_learns_the_host_speed():
    clock = Clock()
    budget = CpuBudget(0.01, cores=4, clock=clock)
    assert budget.granted == 0.0  # not started
    budget.start()
    clock.now = 50.0
    assert budget.granted == pytest.approx(2.0)  # 1% of 50 s on 4 cores
    actions = 100
    assert budget.expected(actions) == pytest.approx(prediction_cpu_seconds(actions))
    assert not budget.allows(actions)  # about 3.9 s expected
    clock.now = 1000.0
    assert budget.allows(actions)
    # A host twice as fast as the estimate: the next is expected to take half.
    budget.spend(prediction_cpu_seconds(actions) / 2, actions)
    assert budget.expected(10 * actions) == pytest.approx(prediction_cpu_seconds(10 * actions) / 2)
    assert budget.spent == pytest.approx(prediction_cpu_seconds(actions) / 2)
    budget.start()  # once: the time since the first step keeps counting
    assert budget.granted == pytest.approx(40.0)
    assert CpuBudget(math.inf, clock=clock).allows(10**9)
    with pytest.raises(ValueError, match="a CPU share must be > 0"):
        CpuBudget(0.0)


class WholeStep:
    """Both ranks' measured step, as the one rank of the pipeline that shares traces."""

    def __init__(self, hint, step: int):
        drawn = make_timing("spikes", hint.num_stages, hint.n_microbatches, seed=step)
        timing = Timing(*[[[v * 0.01 for v in row] for row in table] for table in (
            drawn.forward, drawn.backward_input, drawn.backward_weight,
            drawn.activation_latency, drawn.gradient_latency)])
        self.stats = simulated_step_stats(hint, timing, step)
        self.step_time = max(s.step_time for s in self.stats)

    def chrome_trace_events(self) -> list[dict]:
        return [e for s in self.stats for e in s.chrome_trace_events()]


def test_a_prediction_waits_until_it_fits_the_share_and_the_hints_setting_runs_meanwhile(
        monkeypatch, caplog):
    import rrfp.runtime.self_driving as self_driving

    started = []

    def child(run, limits, hints):
        started.append(run.actions)
        return [Predicted(Candidate("hint+1"), 1.2)], 2.0

    monkeypatch.setattr(self_driving, "predicted_in_a_child", child)
    hint = build_hint("1F1B", num_ranks=2, num_stages=2, n_microbatches=4)
    clock = Clock()
    budget = CpuBudget(0.01, cores=1, clock=clock)
    driving = self_driving.SelfDriving(
        parse_buffer_limit("hint+1"), hint, 0, JobScope("t", torch.distributed.HashStore(),
                                                        (0, 1)), (0,), 5.0, cpu_budget=budget)
    def run_steps(steps: range) -> list:
        ran = []
        for step in steps:
            run, _ = driving.before_step(step)
            ran.append(run)
            driving.after_step(step, WholeStep(hint, step))
        return ran

    with caplog.at_level("INFO"):
        ran = run_steps(range(40))  # the clock stands still: nothing is granted
    assert started == []
    assert {(r.setting.buffer_limit, r.ab_fixed) for r in ran} == {("hint", False)}
    assert caplog.text.count("waits for the CPU it may take") == 1, caplog.text
    assert driving.waiting.startswith("predicting from steps 0-3 waits for the CPU it may "
                                      "take beside training (1% of the time of 1 core")
    clock.now = 1e5  # 1,000 s granted
    step = 40
    while not driving.decisions and step < 400:
        run_steps(range(step, step + 4))
        step += 4
        time.sleep(0.01)  # the thread that waits on the child
    assert started and started[0] > 0
    assert driving.decisions[0].startswith(f"from step {step - 4}: buffer_limit='hint+1'")
    assert budget.spent >= 2.0
    driving.close()
