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

from rrfp.core.actions import _Action, F
from rrfp.core.arbiter import Arbiter
from rrfp.core.hints import build_hint
from rrfp.core.limits import resolve_buffer_limits
from rrfp.core.loop import StepLoop
from rrfp.core.policy import make_policy
from rrfp.core.wakeup import Wakeup
from rrfp.devices.device import CudaDevice, HostDevice
from rrfp.testing.emulation import EmulatedDevice

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
    # The first work waits for a gate that opens 0.3 s after the launches (a launch that
    # ran its work would not return for 5 s); the others queue behind it.
    gate = threading.Event()
    works = [lambda: (gate.wait(5.0), time.sleep(0.05), ran.append(0))]
    works += [lambda mb=mb: (time.sleep(0.05), ran.append(mb)) for mb in (1, 2)]
    start = time.perf_counter()
    for mb, work in enumerate(works):
        device.launch(_Action(0, F, mb), work)
    launched = time.perf_counter() - start
    assert 0.006 <= launched < 2.0  # three launch costs, none of the work
    assert device.outstanding == 3 and ran == []
    threading.Timer(0.3, gate.set).start()
    done = _wait_for(device, 3)
    assert [c.action.microbatch_index for c in done] == ran == [0, 1, 2]
    assert device.outstanding == 0
    for earlier, later in zip(done, done[1:]):
        assert earlier.end <= later.start  # one stream: no overlap
    # A span is the work's own time on the device (the first's includes its wait for the
    # gate), not the time since its launch: at least 0.35 s for the queued ones.
    assert done[0].end - done[0].start >= 0.345
    assert all(0.045 <= c.end - c.start < 0.3 for c in done[1:])
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
    started, gate = threading.Event(), threading.Event()
    before = set(threading.enumerate())
    device.launch(_Action(0, F, 0), lambda: (started.set(), gate.wait(5.0), ran.append(0)))
    for mb in range(1, 5):
        device.launch(_Action(0, F, mb), lambda mb=mb: ran.append(mb))
    assert started.wait(5.0)
    (device_thread,) = [t for t in set(threading.enumerate()) - before
                        if t.name == "rrfp-emulated-device"]
    # The running work ends half a second after close() began, on a loaded machine too.
    threading.Timer(0.5, gate.set).start()
    assert device.close(5.0) == []
    assert ran == [0]  # the current work finished, the queued work was skipped
    assert not device_thread.is_alive()


def test_close_returns_a_device_thread_still_running_until_a_later_close_sees_it_end():
    """A failed step lets go of the stages' state only once the device's thread, which may
    read it, has ended: ``close`` must keep reporting that thread while it runs."""
    device = EmulatedDevice()
    device.begin_step(time.perf_counter(), Wakeup())
    ran: list[int] = []
    started, gate = threading.Event(), threading.Event()
    device.launch(_Action(0, F, 0), lambda: (started.set(), gate.wait(30.0), ran.append(0)))
    device.launch(_Action(0, F, 1), lambda: ran.append(1))
    assert started.wait(5.0)
    (running,) = device.close(0.05)
    assert running.name == "rrfp-emulated-device" and running.is_alive()
    assert device.close(0.05) == [running]
    gate.set()
    assert device.close(5.0) == []
    assert ran == [0] and not running.is_alive()
    assert device.close(5.0) == []


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


def test_the_gpu_check_gives_each_action_the_kernels_launched_inside_its_range():
    """``gpu_check``'s reading of a profiler trace (as torch's Chrome trace writes it): a
    kernel belongs to the action whose host range holds its launch, on whichever thread
    launched it (a backward's kernels come from autograd's thread); its extent runs from
    its first kernel's start to its last one's end; kernels launched outside every range
    belong to none."""
    from benchmarks.gpu_check import _kernel_extents, _kernels

    def launch(ts, correlation, tid):
        return {"cat": "cuda_runtime", "ts": ts, "dur": 1, "tid": tid,
                "args": {"correlation": correlation}}

    def kernel(ts, dur, correlation, cat="kernel"):
        return {"cat": cat, "ts": ts, "dur": dur, "args": {"correlation": correlation}}

    events = [
        {"cat": "user_annotation", "name": "PP:0F0", "ts": 100, "dur": 50},
        {"cat": "user_annotation", "name": "PP:0B0", "ts": 200, "dur": 80},
        {"cat": "user_annotation", "name": "other", "ts": 300, "dur": 50},
        launch(110, 1, tid=1), launch(120, 2, tid=1),
        launch(210, 3, tid=2), launch(270, 4, tid=2),  # autograd's thread
        launch(310, 5, tid=1),  # outside every PP range
        kernel(1000, 400, 1), kernel(1400, 100, 2, cat="gpu_memcpy"),
        kernel(1500, 700, 3), kernel(2250, 250, 4), kernel(2600, 50, 5),
    ]
    extents = _kernel_extents(_kernels(events))
    assert extents == {"0F0": pytest.approx(500e-6), "0B0": pytest.approx(1000e-6)}


def test_the_gpu_check_finds_where_the_device_idles_inside_a_step():
    """The idle report's gaps: only where no kernel runs (a kernel inside a longer one
    leaves none), from the end of the latest-ending kernel so far, longest first, each
    named by the action whose kernel ran last before it and the one that ends it."""
    from benchmarks.gpu_check import _idle_gaps

    kernels = [(0, 100, "0F0"), (20, 50, "0F0"),  # the second inside the first
               (130, 200, "1F0"),                  # 30 us after 0F0's end
               (202, 300, "0F1"),                  # 2 us: too short to count
               (400, 450, None)]                   # 100 us, launched by no action
    assert _idle_gaps(kernels) == [(pytest.approx(100e-6), "0F1", "-"),
                                   (pytest.approx(30e-6), "0F0", "1F0")]


def test_gpu_check_dry_run_passes_on_cpu():
    # benchmarks/gpu_check.py on CPU: the single-process part on the emulated device, and
    # the transport part (many channels, a receive posted with compute queued, a clean
    # close with sends in flight, failure told through the store) on 2 gloo processes.
    result = subprocess.run([sys.executable, "-m", "benchmarks.gpu_check", "--dry-run"], cwd=ROOT,
                            capture_output=True, text=True, timeout=400)
    assert result.returncode == 0, result.stdout + result.stderr
    out = result.stdout
    assert "bitwise equal to torch's ScheduleInterleaved1F1B: True" in out
    assert "every span at least its emulated kernel time" in out and ": ok" in out
    assert "single-process checks passed (dry run on CPU)" in out
    for check in ("[4] 14 channels", "[5] arrival with 200 ms of compute queued",
                  "[6] the producer closed right after its sends", "[7] the consumer raised "
                  "PeerFailedError naming global rank 0", "carried a message"):
        line = next((l for l in out.splitlines() if check in l), None)
        assert line is not None and line.endswith("True"), (check, out)
    assert "transport checks passed (dry run on CPU, 2 processes, gloo)" in out


class _FakeEvent:
    """A CUDA event on a fake device clock: complete once the clock has passed it."""

    def __init__(self, clock, enable_timing=False):
        self.clock, self.at = clock, None

    def record(self, stream):  # the stream reaches it once its queued work is done
        self.at = max(self.clock["queued_until"], self.clock["device"])

    def query(self):
        return self.at is not None and self.clock["device"] >= self.at

    def elapsed_time(self, other):
        return (other.at - self.at) * 1e3  # milliseconds


class _FakeCuda:
    def __init__(self, clock):
        self.clock = clock

    def Event(self, enable_timing=False):
        return _FakeEvent(self.clock, enable_timing)

    def current_stream(self, device):
        return None


def test_cuda_device_times_are_placed_on_the_host_timeline():
    """Spans, arrivals and waits share one clock: device event times are anchored at the
    host time the step-start event was seen complete, not at the device's own zero."""
    from rrfp.devices.device import CudaDevice

    clock = {"device": 99.0, "queued_until": 100.5}  # earlier work queued until t=100.5
    device = CudaDevice(torch.device("cuda", 0), cuda=_FakeCuda(clock))
    origin = time.perf_counter()
    device.begin_step(origin, Wakeup())
    assert device._anchor is None  # the step-start event waits behind the earlier work
    time.sleep(0.05)
    clock["device"] = 100.5  # now it completes; the host sees it at its next look
    seen = time.perf_counter() - origin
    device.launch(_Action(0, F, 0), lambda: clock.__setitem__("queued_until", 100.7))
    clock["device"] = 100.7  # the action ran 0.2 s on the device
    (done,) = device.completed()
    assert seen <= device._anchor <= time.perf_counter() - origin
    assert device._anchor >= 0.05  # not the device's zero: the host saw it 50 ms in
    assert abs(done.start - device._anchor) < 1e-9
    assert abs((done.end - done.start) - 0.2) < 1e-9


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
        def work(self, node):
            return _busy_work(device_kind, 0.005)

        def completed(self, action):
            pass

    origin = time.perf_counter()
    device.begin_step(origin, wakeup)
    loop = StepLoop(Arbiter(hint, 0, limits=resolve_buffer_limits("hint", hint),
                            policy=make_policy("hint")), device,
                    Executor(), arrivals=lambda: [], clock=lambda: time.perf_counter() - origin,
                    launch_depth=launch_depth, stall_timeout=30)
    for timeout in loop.run():
        wakeup.wait(timeout)
    device.close(5.0)
    assert [c.action for c in loop.completions] == list(hint.orders[0])
    # REDUCE_GRAD waits for the last backward to be launched, not completed: 8 ahead of it.
    assert device.most_behind == min(launch_depth - 1, 8)


def test_a_polled_loop_records_one_wait_per_idle_stretch_not_one_per_poll():
    """Polled sources (CUDA events, NCCL works) wake the loop every 20 us. Each stretch with
    nothing to launch must still be one wait span: one per poll made thousands per step on
    an H200, and building their spans took 4 ms of host time after every step."""
    hint = build_hint("GPipe", num_ranks=1, num_stages=1, n_microbatches=4)
    device, wakeup = EmulatedDevice(), Wakeup()

    class Executor:
        def work(self, node):
            return _busy_work("emulated", 0.02)

        def completed(self, action):
            pass

    origin = time.perf_counter()
    device.begin_step(origin, wakeup)
    wakeup.polled = True
    loop = StepLoop(Arbiter(hint, 0, limits=resolve_buffer_limits("hint", hint),
                            policy=make_policy("hint")), device,
                    Executor(), arrivals=lambda: [], clock=lambda: time.perf_counter() - origin,
                    launch_depth=1, stall_timeout=30)
    polls = 0
    for timeout in loop.run():
        polls += 1
        wakeup.wait(timeout)
    device.close(5.0)
    assert polls > 5 * len(loop.completions)  # the situation: many polls per action
    # Launch depth 1: every idle stretch ends with a completion.
    assert 1 <= len(loop.waits) <= len(loop.completions)
    for (start, end), (later_start, _) in zip(loop.waits, loop.waits[1:]):
        assert start <= end <= later_start
    assert sum(end - start for start, end in loop.waits) >= loop.wait_time


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
