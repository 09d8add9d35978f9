"""Emulated device time: make a stage's forward and backward take a chosen wall time.

For studying schedules on a CPU machine: the wrapped module still computes (so results
are real and comparable), and each microbatch additionally sleeps as if a kernel ran for
the given time. Sleeping releases the CPU, so several ranks on few cores measure the
schedule rather than core contention. Any figure obtained this way is *emulated*.

Run it under ``ScheduleRRFP(..., device=rrfp.devices.device.EmulatedDevice())`` to emulate an
asynchronous accelerator: the compute (and so the sleep) then happens on the emulated
device's thread, after the launch returned, as a CUDA kernel would. Under torch's own
schedules (or RRFP's synchronous CPU device) it happens on the calling thread.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch


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
