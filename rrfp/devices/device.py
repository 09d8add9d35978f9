"""Devices the step loop (``rrfp.core.loop``) launches actions on.

* ``CudaDevice``: the current CUDA stream. A launch enqueues the action's kernels between
  two timing events and returns; completion is an event query, never a synchronize.
* ``HostDevice``: plain CPU tensors. CPU ops are synchronous, so an action is complete
  when its launch returns.
* ``EmulatedDevice``: an asynchronous device for CPU tests and studies. A launch returns at
  once (after an optional emulated launch cost, spent on the calling thread); a device
  thread runs launched work in order and completes it, as a CUDA stream would. Combined
  with ``rrfp.testing.emulation.EmulatedDeviceTime`` (stage compute that sleeps for a chosen time)
  it makes schedules measurable on a CPU machine. Figures obtained with it are *emulated*.

All report ``Completion`` s with device start and end times in seconds from the step start:
those durations, not launch times, feed the policies' history, the stats and the traces.
"""

from __future__ import annotations

import queue
import threading
import time
from collections import deque
from collections.abc import Callable

import torch

from rrfp.core.actions import _Action
from rrfp.core.loop import Completion
from rrfp.core.wakeup import Wakeup


class HostDevice:
    """Synchronous execution on the calling thread (CPU tensors)."""

    outstanding = 0
    most_behind = 0
    """As ``EmulatedDevice.most_behind``: a launch returns once its work is done."""

    def __init__(self) -> None:
        self._origin = time.perf_counter()
        self._done: list[Completion] = []

    def begin_step(self, origin: float, wakeup: Wakeup) -> None:
        self._origin = origin

    def launch(self, action: _Action, work: Callable[[], None]) -> None:
        start = time.perf_counter()
        work()
        self._done.append(Completion(action, start - self._origin, time.perf_counter() - self._origin))

    def completed(self) -> list[Completion]:
        done, self._done = self._done, []
        return done

    def close(self, timeout: float) -> list[threading.Thread]:
        return []


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
        Returns the thread if it is still running after ``timeout`` seconds."""
        thread, self._thread = self._thread, None
        if thread is None:
            return []
        self._skip = True
        self._work.put(_STOP)
        thread.join(timeout)
        self._skip = False
        self._error = None
        self._outstanding = 0
        self._done = queue.SimpleQueue()
        return [thread] if thread.is_alive() else []

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


class CudaDevice:
    """The current CUDA stream of ``device``: launches enqueue, completion is polled.

    Device times are placed on the host's timeline (one clock with arrivals, waits and
    sends, all ``time.perf_counter`` from the step start): an event recorded at the step
    start is polled at every launch and completion check until it has completed, and the
    host time it was first seen complete anchors the events timed after it (later than
    the truth by at most the host's delay in looking: a launch, or the loop's poll).
    """

    def __init__(self, device: torch.device, cuda=None):
        self.device = device
        self._cuda = cuda if cuda is not None else torch.cuda
        self._pending: deque[tuple[_Action, torch.cuda.Event, torch.cuda.Event]] = deque()
        self._origin_event: torch.cuda.Event | None = None
        self._origin = time.perf_counter()
        self._anchor: float | None = None
        """Seconds from the step start when the origin event was seen complete."""
        self.most_behind = 0
        """As ``EmulatedDevice.most_behind``."""

    @property
    def outstanding(self) -> int:
        return len(self._pending)

    def begin_step(self, origin: float, wakeup: Wakeup) -> None:
        wakeup.polled = True
        self._origin, self._anchor = origin, None
        self.most_behind = 0
        self._origin_event = self._cuda.Event(enable_timing=True)
        self._origin_event.record(self._cuda.current_stream(self.device))
        self._look_at_origin()

    def _look_at_origin(self) -> None:
        if self._anchor is None and self._origin_event.query():
            self._anchor = time.perf_counter() - self._origin

    def launch(self, action: _Action, work: Callable[[], None]) -> None:
        self.most_behind = max(self.most_behind, len(self._pending))
        self._look_at_origin()
        stream = self._cuda.current_stream(self.device)
        start = self._cuda.Event(enable_timing=True)
        end = self._cuda.Event(enable_timing=True)
        start.record(stream)
        work()
        end.record(stream)
        self._pending.append((action, start, end))

    def completed(self) -> list[Completion]:
        self._look_at_origin()  # complete before any later event: set before they are read
        done = []
        while self._pending and self._pending[0][2].query():
            action, start, end = self._pending.popleft()
            # Both events are complete: elapsed_time reads them without synchronizing.
            done.append(Completion(action,
                                   self._anchor + self._origin_event.elapsed_time(start) / 1e3,
                                   self._anchor + self._origin_event.elapsed_time(end) / 1e3))
        return done

    def close(self, timeout: float) -> list[threading.Thread]:
        self._pending.clear()
        return []
