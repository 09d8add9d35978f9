"""What earlier steps showed one rank, for the policies that decide by it (``lookahead``,
``critical``), and the microbatch sizes of the step about to run.

Torch-free, like the arbiter and the policies.
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from rrfp.core.actions import Edge
from rrfp.core.sizes import DurationModels, StepSizes, tell_apart

__all__ = ["History"]


@dataclass
class History:
    """What earlier steps showed one rank, and the sizes of the step about to run.

    ``durations[(stage, kind)]``: that stage and kind's mean run time (seconds); each
    step's mean weighs one half against what the steps before it showed.
    ``arrivals[(edge, microbatch)]``: the earliest arrival seen, in seconds after the step
    start (the cautious side for the guard). ``models``: per (stage, kind), duration
    against microbatch size (``rrfp.core.sizes``), fitted on the stages this rank ran and
    adopted from other ranks for theirs.
    """

    durations: dict[tuple[int, str], float] = field(default_factory=dict)
    arrivals: dict[tuple[Edge, int], float] = field(default_factory=dict)
    gaps: dict[tuple[Edge, int], float] = field(default_factory=dict)
    """Shortest time seen between a message and the one before it on the same edge."""
    priority_costs: tuple[tuple[str, float], ...] | None = None
    """The per-kind costs (in forwards) the critical policy last ranked actions by."""
    models: DurationModels = field(default_factory=DurationModels)
    _sizes: StepSizes | None = None
    _sizes_tell_apart: bool = False
    _last: dict[Edge, float] = field(default_factory=dict)

    def expect_sizes(self, sizes: StepSizes | None) -> None:
        """The sizes of the step about to run, one per microbatch (None: not known), from
        whoever runs it; they hold for that step only (``record_step`` forgets them).
        Where they tell no two microbatches apart (None, or all alike: a packed batch)
        the policies decide exactly as without them."""
        self._sizes = sizes
        self._sizes_tell_apart = tell_apart(sizes)

    @property
    def sizes_tell_apart(self) -> bool:
        """Whether the step about to run has sizes that tell some microbatches apart."""
        return self._sizes_tell_apart

    def predicted(self, stage: int, kind: str, microbatch: int) -> float | None:
        """The expected duration of that action of the step about to run, from its
        microbatch's size (None: no sizes that tell microbatches apart, or no fit of that
        stage and kind)."""
        if not self._sizes_tell_apart:
            return None
        return self.models.predict(stage, kind, self._sizes[microbatch])  # type: ignore[index]

    def prediction_errors(self, runs: Sequence[tuple[int, str, int | None, float]]
                          ) -> dict[int, float] | None:
        """How far the durations predicted from the sizes of the step about to be recorded
        fell from ``runs`` (as ``record_step`` takes them): per stage, the median over its
        predicted actions of |predicted - measured| / measured. None where the step had no
        sizes that tell microbatches apart or no stage had a fit yet."""
        if not self._sizes_tell_apart:
            return None
        errors: dict[int, list[float]] = {}
        for stage, kind, microbatch, seconds in runs:
            predicted = None if microbatch is None else self.predicted(stage, kind, microbatch)
            if predicted is not None and seconds > 0:
                errors.setdefault(stage, []).append(abs(predicted - seconds) / seconds)
        return {stage: statistics.median(seen) for stage, seen in sorted(errors.items())} or None

    def record_step(self, runs: Sequence[tuple[int, str, int | None, float]]) -> None:
        """One step's device run times, as (stage, kind, microbatch, seconds): the per-kind
        means, and with the step's sizes the duration models; then forgets the sizes."""
        self.record_durations((stage, kind, seconds) for stage, kind, _, seconds in runs)
        if self._sizes is not None:  # the runs on a microbatch (not gradient reductions)
            self.models.record_step(self._sizes, [run for run in runs if run[2] is not None])
        self.expect_sizes(None)

    def start_step(self) -> None:
        self._last.clear()

    def record_durations(self, runs: Iterable[tuple[int, str, float]]) -> None:
        """One step's run times, as (stage, kind, seconds)."""
        # The step's mean, not a per-run average: that would rest on its last few runs,
        # which under compute noise made the critical policy's costs differ by up to a
        # forward from rank to rank.
        step: dict[tuple[int, str], list[float]] = {}
        for stage, kind, seconds in runs:
            step.setdefault((stage, kind), []).append(seconds)
        for key, seen in step.items():
            mean = sum(seen) / len(seen)
            previous = self.durations.get(key)
            self.durations[key] = mean if previous is None else 0.5 * (mean + previous)

    def record_arrival(self, edge: Edge, microbatch: int, offset: float) -> None:
        key = (edge, microbatch)
        self.arrivals[key] = min(offset, self.arrivals.get(key, offset))
        if edge in self._last:
            gap = offset - self._last[edge]
            self.gaps[key] = min(gap, self.gaps.get(key, gap))
        self._last[edge] = offset
