"""The device layer alone: the emulated asynchronous device, the CUDA device where there is
one, the step loop's launch depth on them, and the GPU check's dry run."""

from __future__ import annotations

import math
import os
import subprocess
import sys
import threading
import time

import pytest
import torch

from rrfp.arbiter import Arbiter, resolve_buffer_limits
from rrfp.device import CudaDevice, EmulatedDevice, HostDevice, Wakeup
from rrfp.hints import _Action, build_hint, F
from rrfp.loop import StepLoop

NO_CUDA = "CudaDevice needs a CUDA device; torch.cuda.is_available() is False on this machine"

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _wait_for(device, count: int, timeout: float = 5.0) -> list:
    done, deadline = [], time.perf_counter() + timeout
    while len(done) < count and time.perf_counter() < deadline:
        done += device.completed()
        time.sleep(1e-3)
    return done


def test_emulated_launch_returns_before_the_work_runs_and_completes_in_order():
    device, wakeup = EmulatedDevice(launch_cost=0.002), Wakeup()
    device.begin_step(time.perf_counter(), wakeup)
    ran: list[int] = []
    start = time.perf_counter()
    for mb in range(3):
        device.launch(_Action(0, F, mb), lambda mb=mb: (time.sleep(0.05), ran.append(mb)))
    launched = time.perf_counter() - start
    assert 0.006 <= launched < 0.04  # three launch costs, none of the work
    assert device.outstanding == 3 and ran == []
    done = _wait_for(device, 3)
    assert [c.action.microbatch_index for c in done] == ran == [0, 1, 2]
    assert device.outstanding == 0
    for earlier, later in zip(done, done[1:]):
        assert earlier.end <= later.start  # one stream: no overlap
    assert all(0.045 <= c.end - c.start < 0.1 for c in done)
    device.close(5.0)


def test_emulated_device_runs_work_with_the_launching_threads_grad_mode():
    device = EmulatedDevice()
    device.begin_step(time.perf_counter(), Wakeup())
    modes: list[bool] = []
    with torch.no_grad():
        device.launch(_Action(0, F, 0), lambda: modes.append(torch.is_grad_enabled()))
    device.launch(_Action(0, F, 1), lambda: modes.append(torch.is_grad_enabled()))
    _wait_for(device, 2)
    assert modes == [False, True]
    device.close(5.0)


def test_a_failure_on_the_emulated_device_is_raised_and_later_work_is_skipped():
    device = EmulatedDevice()
    device.begin_step(time.perf_counter(), Wakeup())
    ran: list[int] = []

    def fail():
        raise ValueError("boom")

    device.launch(_Action(0, F, 0), fail)
    device.launch(_Action(0, F, 1), lambda: ran.append(1))
    with pytest.raises(RuntimeError, match="0F0 failed on the emulated device: boom") as info:
        _wait_for(device, 2)
    assert isinstance(info.value.__cause__, ValueError)
    assert ran == []
    assert device.close(5.0) == []


def test_close_stops_the_device_thread_and_skips_queued_work():
    device = EmulatedDevice()
    device.begin_step(time.perf_counter(), Wakeup())
    ran: list[int] = []
    for mb in range(5):
        device.launch(_Action(0, F, mb), lambda mb=mb: (time.sleep(0.05), ran.append(mb)))
    time.sleep(0.02)
    assert device.close(5.0) == []
    assert len(ran) <= 1
    assert not [t for t in threading.enumerate() if t.name == "rrfp-emulated-device"]


def test_wakeup_wakes_a_waiter_and_host_device_completes_at_launch():
    wakeup = Wakeup()
    threading.Timer(0.05, wakeup.notify).start()
    start = time.perf_counter()
    wakeup.wait(5.0)
    assert time.perf_counter() - start < 1.0
    device = HostDevice()
    device.begin_step(time.perf_counter(), wakeup)
    device.launch(_Action(0, F, 0), lambda: time.sleep(0.01))
    (done,) = device.completed()
    assert device.outstanding == 0 and done.end - done.start >= 0.01


def test_gpu_check_dry_run_passes_on_cpu():
    # The single-process part of benchmarks/gpu_check.py on the emulated device.
    result = subprocess.run([sys.executable, "-m", "benchmarks.gpu_check", "--dry-run"], cwd=ROOT,
                            capture_output=True, text=True, timeout=180)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "bitwise equal to torch's ScheduleInterleaved1F1B: True" in result.stdout
    assert "single-process checks passed (dry run on CPU)" in result.stdout


def _busy_work(device_kind: str, seconds: float):
    """Work that keeps the device busy for about ``seconds`` once it runs."""
    if device_kind == "cuda":
        # torch.cuda._sleep spins a kernel for a number of GPU cycles (about 1 GHz or more).
        return lambda: torch.cuda._sleep(int(seconds * 1e9))
    return lambda: time.sleep(seconds)


def _make_device(device_kind: str):
    return CudaDevice(torch.device("cuda", 0)) if device_kind == "cuda" else EmulatedDevice()


DEVICE_KINDS = ["emulated", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason=NO_CUDA))]


@pytest.mark.parametrize("device_kind", DEVICE_KINDS)
@pytest.mark.parametrize("launch_depth", [1, 2, 3, math.inf])
def test_the_step_loop_launches_only_while_fewer_than_launch_depth_actions_are_incomplete(
        device_kind, launch_depth):
    """One rank alone running GPipe's order (4 forwards ready at once, then the backwards):
    every launch finds fewer than ``launch_depth`` launched actions not yet complete, and
    as many as the depth allows (without a bound, all of the step's first 8 actions)."""
    hint = build_hint("GPipe", num_ranks=1, num_stages=1, n_microbatches=4)
    device, wakeup = _make_device(device_kind), Wakeup()

    class Executor:
        def work(self, action, sends):
            return _busy_work(device_kind, 0.005)

        def completed(self, action):
            pass

    origin = time.perf_counter()
    device.begin_step(origin, wakeup)
    loop = StepLoop(Arbiter(hint, 0, limits=resolve_buffer_limits("hint", hint)), device,
                    Executor(), arrivals=lambda: [], clock=lambda: time.perf_counter() - origin,
                    launch_depth=launch_depth, stall_timeout=30)
    for timeout in loop.run():
        wakeup.wait(timeout)
    device.close(5.0)
    assert [c.action for c in loop.completions] == list(hint.orders[0])
    # REDUCE_GRAD waits for the last backward to be launched, not completed: 8 ahead of it.
    assert device.most_behind == min(launch_depth - 1, 8)


@pytest.mark.skipif(not torch.cuda.is_available(), reason=NO_CUDA)
def test_cuda_launch_returns_before_the_kernels_run_and_completion_is_polled_in_order():
    device, wakeup = CudaDevice(torch.device("cuda", 0)), Wakeup()
    torch.cuda.synchronize()
    device.begin_step(time.perf_counter(), wakeup)
    assert wakeup.polled
    start = time.perf_counter()
    for mb in range(3):
        device.launch(_Action(0, F, mb), _busy_work("cuda", 0.05))
    launched = time.perf_counter() - start
    assert launched < 0.05  # enqueued, not run: the three kernels take about 0.15 s
    assert device.completed() == [] and device.outstanding == 3
    assert device.most_behind == 2
    done = []
    deadline = time.perf_counter() + 10
    while len(done) < 3 and time.perf_counter() < deadline:
        done += device.completed()
    assert [c.action.microbatch_index for c in done] == [0, 1, 2]
    assert device.outstanding == 0
    for earlier, later in zip(done, done[1:]):
        assert earlier.end <= later.start  # one stream: in order, no overlap
    assert all(c.end - c.start > 0.01 for c in done)  # device time, not launch time
    device.close(5.0)
