"""examples/minimal.py and a schedule its user forgot to close: the process exits 0."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from rrfp.testing.worlds import output_within

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def torchrun(script: str, timeout: float = 120) -> tuple[int, str]:
    """``torchrun --nproc-per-node 2 script`` from the repository root: (exit status, output)."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2", "--standalone",
         script], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        start_new_session=True,  # a hang kills torchrun's workers too
        env={**os.environ, "PYTHONPATH": os.pathsep.join(
            [ROOT, *filter(None, [os.environ.get("PYTHONPATH")])])})
    out, ended = output_within(proc, timeout)
    if not ended:
        pytest.fail(f"{script} ran past {timeout} s (a hang?):\n{out[-3000:]}")
    return proc.returncode, out


def test_a_schedule_left_open_closes_itself_before_the_interpreter_finalizes():
    # Its receive threads, waiting on receives posted ahead for a next step, would be
    # ended inside torch's C++ wait as the interpreter finalizes: the process aborts in
    # some of the runs. The probe runs after the schedule's exit handler.
    status, out = torchrun("tests/exit_probe.py")
    assert status == 0, out[-3000:]
    for rank in (0, 1):
        assert f"rank {rank}: rrfp threads alive at exit: []" in out, out[-3000:]


@pytest.mark.job
def test_the_minimal_example_exits_0_every_time():
    # The abort at exit happened in 4 of 14 runs without a close (on 2 loaded cores).
    for run in range(10):
        status, out = torchrun("examples/minimal.py")
        assert status == 0 and "terminate called" not in out, f"run {run + 1}:\n{out[-3000:]}"
        assert "step 4: loss" in out
