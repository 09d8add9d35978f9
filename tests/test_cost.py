"""The predictions' CPU share (``rrfp.advise.cost``): a prediction made beside training
starts only where its expected CPU fits what the share has granted since the first step."""

from __future__ import annotations

import math
import time

import pytest
import torch

from rrfp.advise import run_from_trace_events
from rrfp.advise.cost import CpuBudget, prediction_cpu_seconds
from rrfp.comm.board import JobScope
from rrfp.core.hints import build_hint
from rrfp.core.settings import parse_buffer_limit
from rrfp.core.tuning import Candidate, Predicted
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
    # A process kept from an earlier prediction has imported torch: only the replay.
    assert budget.expected(actions, starting=False) == pytest.approx(
        prediction_cpu_seconds(actions, starting=False) / 2)
    assert prediction_cpu_seconds(actions, starting=False) < prediction_cpu_seconds(actions) / 3
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

    class Process:  # predicts at once; started by its first prediction
        def __init__(self) -> None:
            self.started = False
            self.predicted: list[int] = []

        def predict(self, run, limits, hints):
            cpu_seconds = 2.0 if self.started else 5.0
            self.started = True
            self.predicted.append(run.actions)
            return [Predicted(Candidate("hint+1"), 1.2)], cpu_seconds

        def close(self) -> None:
            self.started = False

    hint = build_hint("1F1B", num_ranks=2, num_stages=2, n_microbatches=4)
    clock = Clock()
    budget = CpuBudget(0.01, cores=1, clock=clock)
    driving = self_driving.SelfDriving(
        parse_buffer_limit("hint+1"), hint, 0, JobScope("t", torch.distributed.HashStore(),
                                                        (0, 1)), (0,), 5.0, cpu_budget=budget,
        process=(process := Process()))
    def run_steps(steps: range) -> list:
        ran = []
        for step in steps:
            run, _ = driving.before_step(step)
            ran.append(run)
            driving.after_step(step, WholeStep(hint, step))
        return ran

    built = []  # the measured run, built inside a timed step: once, not at every block
    monkeypatch.setattr(self_driving, "run_from_trace_events",
                        lambda steps, source: built.append(len(steps))
                        or run_from_trace_events(steps, source))
    with caplog.at_level("INFO"):
        ran = run_steps(range(40))  # the clock stands still: nothing is granted
    assert process.predicted == [] and built == [4]
    assert {r.setting.buffer_limit for r in ran} == {"hint"}
    assert [step for step, r in enumerate(ran) if r.ab_fixed] == list(range(7, 40, 8))
    assert caplog.text.count("waits for the CPU it may take") == 1, caplog.text
    assert driving.waiting.startswith("predicting from steps 0-3 waits for the CPU it may "
                                      "take beside training (1% of the time of 1 core")
    # Granted: what a first prediction from the first 4 steps is expected to take.
    first, second = (run_from_trace_events([WholeStep(hint, s).chrome_trace_events()
                                            for s in range(steps)], "measured").actions
                     for steps in (4, 16))
    clock.now = 100 * (prediction_cpu_seconds(first) + 0.1)
    step = 40
    while not driving.decisions and step < 400:
        run_steps(range(step, step + 4))
        step += 4
        time.sleep(0.01)  # the thread that waits on the process
    assert process.predicted == [first]
    assert driving.decisions[0].startswith(f"from step {step - 4}: buffer_limit='hint+1'")
    assert budget.spent == 5.0
    # The next, from 16 steps, in the process the first started: granted what its replay
    # is expected to take, short of a new process's start-up.
    kept = budget.expected(second, starting=False)
    assert budget.spent + kept + 0.1 < budget.spent + budget.expected(second)
    clock.now = 100 * (budget.spent + kept + 0.1)
    for _ in range(100):
        if len(process.predicted) == 2:
            break
        run_steps(range(step, step + 4))
        step += 4
        time.sleep(0.01)
    assert process.predicted == [first, second]
    driving.close()
