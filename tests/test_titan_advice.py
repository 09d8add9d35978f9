"""The advisor in a torchtitan job: its child process (at idle priority from its start;
its answer, or its one-line failure) and whether the first verdict runs during the run."""

from __future__ import annotations

import logging
import os

import pytest

from rrfp.testing.stats import made_up_stats


@pytest.mark.skipif(not hasattr(os, "SCHED_IDLE"), reason="SCHED_IDLE (Linux)")
def test_the_verdicts_child_runs_at_idle_priority_from_its_start():
    from torchtitan_ext.common.run_advice import AdvisorProcess

    child = AdvisorProcess("a run", [], low_priority=True)
    try:
        # Before it has imported anything: its start-up is the most of what it takes.
        assert os.sched_getscheduler(child.pid) == os.SCHED_IDLE
    finally:
        child.stop()


def test_the_verdicts_child_answers_from_the_steps_it_is_given():
    from torchtitan_ext.common.run_advice import AdvisorProcess

    child = AdvisorProcess("a run", [], low_priority=False)
    assert child.done(300)
    assert child.answer is None
    assert child.failure == "rrfp.advise: a run: no steps to read"


@pytest.mark.parametrize("total_steps, first_verdict", [(4, False), (20, False),
                                                         (100_000, True)])
def test_the_first_verdict_runs_in_the_run_only_where_it_costs_training_little(
        total_steps, first_verdict):
    # Decided after step 4: 4 steps of 2 ranks x 32 actions, about 4.4 s of CPU to predict
    # from. 16 steps of 0.5 s left have 16 s on 2 cores: 1% of it is far less; 99,996
    # steps left have far more. A run of 4 steps ends there: the end's verdict comes next,
    # with nothing said about the first.
    from torchtitan.tools.logging import logger as torchtitan_logger
    from torchtitan_ext.common.run_advice import RunAdvice

    records = []
    handler = logging.Handler()
    handler.emit = records.append
    torchtitan_logger.addHandler(handler)
    level = torchtitan_logger.level
    torchtitan_logger.setLevel(logging.INFO)
    advice = RunAdvice(None, source="a run", label=lambda s: f"rank {s.pp_rank}", advise=True,
                       total_steps=total_steps, tensorboard_folder=None)
    try:
        for step in range(1, 6):
            advice.add(step, [made_up_stats(rank, step_time=0.5, realized_order=["0F0"] * 32)
                              for rank in range(2)])
        assert (advice.first_verdict is not None) == first_verdict
    finally:
        torchtitan_logger.removeHandler(handler)
        torchtitan_logger.setLevel(level)
        if advice.first_verdict is not None:
            advice.first_verdict.stop()
    waits = [r.getMessage() for r in records if "comes at the end of the run" in r.getMessage()]
    cores = len(os.sched_getaffinity(0))
    expected = ("rrfp: the verdict comes at the end of the run: predicting now would take "
                f"about 4 s of CPU, over 1% of the {16 * 0.5 * cores:.0f} s the 16 steps "
                f"left have on {cores} cores")
    assert waits == ([expected] if total_steps == 20 else [])
