"""Devices the step loop (``rrfp.core.loop``) launches actions on.

* ``CudaDevice``: the current CUDA stream. A launch enqueues the action's kernels between
  two timing events and returns; completion is an event query, never a synchronize.
* ``HostDevice``: plain CPU tensors. CPU ops are synchronous, so an action is complete
  when its launch returns.

Studies add an emulated asynchronous device for CPU stages (``rrfp.testing.emulation``).

All report ``Completion`` s with device start and end times in seconds from the step start:
those durations, not launch times, feed the policies' history, the stats and the traces.
"""

from __future__ import annotations

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
