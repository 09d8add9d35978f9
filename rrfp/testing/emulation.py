"""An emulated accelerator for studying schedules on a CPU machine.

* ``EmulatedDeviceTime``: a stage's forward and backward take a chosen wall time. The
  wrapped module still computes (so results are real and comparable), and each microbatch
  additionally sleeps as if a kernel ran for the given time. Sleeping releases the CPU, so
  several ranks on few cores measure the schedule rather than core contention.
* ``EmulatedDevice``: an asynchronous device. A launch returns at once (after an optional
  emulated launch cost, spent on the calling thread); a device thread runs launched work in
  order and completes it, as a CUDA stream would.

Run stages of ``EmulatedDeviceTime`` on an ``EmulatedDevice``
(``rrfp.testing.study.StudySchedule(..., study=Study(device=EmulatedDevice()))``): the
compute (and so the sleep) then happens on the device's thread, after the launch returned,
as a CUDA kernel would. Under torch's own schedules (or RRFP's synchronous CPU device) it
happens on the calling thread. Any figure obtained this way is *emulated*.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable

import torch

from rrfp.core.actions import _Action
from rrfp.core.loop import Completion
from rrfp.core.wakeup import Wakeup


class EmulatedDeviceTime(torch.nn.Module):
    """Wraps a stage module whose output is one tensor.

    ``forward_time(mb)`` / ``backward_time(mb)`` give the seconds microbatch ``mb`` takes.
    Forward calls are numbered ``0, 1, ...`` modulo ``n_microbatches`` from construction or
    ``reset()``, so each step must run its forwards in microbatch order (every torch
    schedule does). A pipeline's first step also runs one shape-inference forward per
    stage: call ``reset()`` after a warm-up step.
    """

    def __init__(
        self,
        inner: torch.nn.Module,
        n_microbatches: int,
        forward_time: Callable[[int], float],
        backward_time: Callable[[int], float],
    ):
        super().__init__()
        self.inner = inner
        self.n_microbatches = n_microbatches
        self.forward_time = forward_time
        self.backward_time = backward_time
        self._calls = 0
        self.slept = 0.0
        """Seconds slept since construction or ``reset()``: the emulated busy time."""

    def reset(self) -> None:
        self._calls = 0
        self.slept = 0.0

    def sleep(self, seconds: float) -> None:
        start = time.perf_counter()
        time.sleep(seconds)
        self.slept += time.perf_counter() - start

    def forward(self, *args, **kwargs) -> torch.Tensor:
        out = self.inner(*args, **kwargs)
        mb = self._calls % self.n_microbatches
        self._calls += 1
        self.sleep(self.forward_time(mb))
        if out.requires_grad:
            # A hook, not a custom autograd Function: under torch's split backward (I/W)
            # a custom Function keeps its input alive after W, which would skew memory.
            seconds = self.backward_time(mb)
            out.register_hook(lambda grad: self.sleep(seconds))
        return out


_STOP = object()


class EmulatedDevice:
    """An asynchronous device emulated on the CPU: a thread runs launched work in order.

    ``launch_cost``: seconds each launch takes on the calling thread before it returns (the
    CPU cost of enqueueing an action's kernels on a real accelerator). Launched work runs
    with the grad mode of the launching thread. A failure in launched work is raised by
    the next ``completed`` call; later work is skipped, as on a faulted stream.
    """

    def __init__(self, launch_cost: float = 0.0):
        if not launch_cost >= 0:
            raise ValueError(f"launch_cost must be >= 0 seconds, got {launch_cost}")
        self.launch_cost = float(launch_cost)
        self._origin = time.perf_counter()
        self._wakeup: Wakeup | None = None
        self._work: queue.SimpleQueue = queue.SimpleQueue()
        self._done: queue.SimpleQueue = queue.SimpleQueue()
        self._outstanding = 0
        self._error: tuple[_Action, BaseException] | None = None
        self._skip = False
        self._thread: threading.Thread | None = None
        self.most_behind = 0
        """Most launched actions not yet reported complete that a launch of this step
        found (``outstanding`` at the launch): the step loop keeps it below its
        ``launch_depth``."""

    @property
    def outstanding(self) -> int:
        return self._outstanding

    def begin_step(self, origin: float, wakeup: Wakeup) -> None:
        if self._outstanding:
            raise RuntimeError(f"{self._outstanding} actions of an earlier step are still running")
        self._origin = origin
        self._wakeup = wakeup
        self.most_behind = 0

    def launch(self, action: _Action, work: Callable[[], None]) -> None:
        if self.launch_cost:
            time.sleep(self.launch_cost)
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="rrfp-emulated-device",
                                            daemon=True)
            self._thread.start()
        self.most_behind = max(self.most_behind, self._outstanding)
        self._outstanding += 1
        self._work.put((action, work, torch.is_grad_enabled()))

    def completed(self) -> list[Completion]:
        done = []
        queued = self._done
        while not queued.empty():  # the step loop is the only consumer
            item = queued.get_nowait()
            self._outstanding -= 1
            if isinstance(item, tuple):
                action, error = item
                raise RuntimeError(f"{action} failed on the emulated device: {error}") from error
            done.append(item)
        return done

    def close(self, timeout: float) -> list[threading.Thread]:
        """Stop the device thread after its current work; skip work not yet started.
        Returns the thread if it is still running after ``timeout`` seconds (a later
        ``close`` waits for it again)."""
        thread = self._thread
        if thread is None:
            return []
        if not self._skip:
            self._skip = True
            self._work.put(_STOP)
        thread.join(timeout)
        if thread.is_alive():
            return [thread]
        self._thread = None
        self._skip = False
        self._error = None
        self._outstanding = 0
        self._done = queue.SimpleQueue()
        return []

    def _run(self) -> None:
        while (item := self._work.get()) is not _STOP:
            action, work, grad_enabled = item
            if self._skip:
                continue
            if self._error is not None:
                outcome: Completion | tuple[_Action, BaseException] = self._error
            else:
                start = time.perf_counter()
                try:
                    with torch.set_grad_enabled(grad_enabled):
                        work()
                except BaseException as e:  # raised on the launching thread by completed()
                    self._error = outcome = (action, e)
                else:
                    outcome = Completion(action, start - self._origin,
                                         time.perf_counter() - self._origin)
            self._done.put(outcome)
            if self._wakeup is not None:
                self._wakeup.notify()
