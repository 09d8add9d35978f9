"""What a prediction costs in CPU, and the share of the host's CPU that predictions made
beside training may take (the advisor's first verdict, the self-driving tuner's choices)."""

from __future__ import annotations

import math
import os
import time
from collections.abc import Callable

CPU_SHARE = 0.01
"""The most of the host's CPU time (wall time x the cores this process may run on) that
predictions running beside training may take."""
ADVISOR_START_CPU_S = 3.5
"""CPU seconds a prediction process takes to start, mostly importing torch (as measured
on this project's CPU machine)."""
PREDICT_CPU_S_PER_ACTION = 3.5e-3
"""CPU seconds a prediction takes per measured action, every setting and the fixed
schedule replayed (as measured on the torchtitan main job, rounded up)."""


def prediction_cpu_seconds(actions: int, *, starting: bool = True) -> float:
    """About what a prediction takes, in CPU seconds, from steps holding ``actions``
    actions (on every rank); ``starting``: in a process that starts for it (a process
    kept from an earlier prediction has imported torch already)."""
    return ADVISOR_START_CPU_S * starting + PREDICT_CPU_S_PER_ACTION * actions


def available_cores() -> int:
    """The cores this process may run on."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


class CpuBudget:
    """Predictions beside training within ``share`` of the CPU time since ``start()`` (its
    wall time x ``cores``). A prediction's expected cost is ``prediction_cpu_seconds``,
    scaled by what the last one took over that estimate (the host's speed); ``starting``:
    whether it starts the process it runs in."""

    def __init__(self, share: float = CPU_SHARE, *, cores: int | None = None,
                 clock: Callable[[], float] = time.monotonic):
        if not share > 0:
            raise ValueError(f"a CPU share must be > 0 (math.inf: unbounded), got {share!r}")
        self.share = share
        self.cores = cores if cores is not None else available_cores()
        self._clock = clock
        self._since: float | None = None
        self.spent = 0.0
        """CPU seconds the predictions took so far."""
        self._scale = 1.0

    def start(self) -> None:
        """Start counting the time the share is of (once; later calls do nothing)."""
        if self._since is None:
            self._since = self._clock()

    @property
    def granted(self) -> float:
        """CPU seconds the share gives so far."""
        if math.isinf(self.share):
            return math.inf
        if self._since is None:
            return 0.0
        return self.share * self.cores * (self._clock() - self._since)

    def expected(self, actions: int, *, starting: bool = True) -> float:
        """CPU seconds a prediction from ``actions`` actions is expected to take."""
        return self._scale * prediction_cpu_seconds(actions, starting=starting)

    def allows(self, actions: int, *, starting: bool = True) -> bool:
        """Whether a prediction from ``actions`` actions fits what is left of the share."""
        return self.spent + self.expected(actions, starting=starting) <= self.granted

    def spend(self, seconds: float, actions: int, *, starting: bool = True) -> None:
        """A prediction from ``actions`` actions took ``seconds`` of CPU."""
        self.spent += seconds
        self._scale = max(seconds, 1e-3) / prediction_cpu_seconds(actions, starting=starting)
