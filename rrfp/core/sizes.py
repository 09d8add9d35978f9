"""Microbatch sizes, and the device durations they predict.

Most variability in training is not noise: it comes from the data. A microbatch's token
count, its documents' lengths and its image count are known when the step starts, and its
cost on each stage follows from them: linear in tokens for the MLPs, quadratic in document
length for attention, linear in images for a vision encoder. ``MicrobatchSize`` records
those three numbers; ``DurationModels`` fits, per (stage, action kind), a least-squares
model of a rank's measured device durations against them over a window of recent steps,
and predicts each (stage, kind, microbatch) of the next step from its size.

A rank measures only its own stages; the fitted models (``DurationFit``, a few floats) are
what ranks share (``DurationModels.fits`` / ``adopt``) so that every rank can cost every
stage's actions. Torch-free, like the arbiter and the policies that read it.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

Key = tuple[int, str]
"""(stage, action kind): "F", "B", "I" or "W"."""

DEFAULT_WINDOW = 8
"""Steps of measured durations a fit rests on: recent enough to follow a model whose speed
drifts (warm-up, a changed learning-rate phase), enough samples (a step's microbatches
each) to fit three slopes."""


@dataclass(frozen=True)
class MicrobatchSize:
    """What a microbatch's cost follows from, all known before it runs.

    ``tokens``: tokens it holds (image tokens included where they enter the language
    stages); ``attention``: the sum over its documents (or sequences) of their length
    squared, in tokens squared (attention's cost; with one document per sequence, the sum of
    squared sequence lengths); ``images``: images it holds (a vision encoder's cost). Leave
    a number the model does not vary with at 0.
    """

    tokens: float
    attention: float = 0.0
    images: float = 0.0

    def __post_init__(self) -> None:
        for name in ("tokens", "attention", "images"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value >= 0):
                raise ValueError(f"microbatch size {name}={value!r}: give a finite number "
                                 ">= 0")

    @property
    def features(self) -> tuple[float, float, float]:
        return (float(self.tokens), float(self.attention), float(self.images))


StepSizes = Sequence["MicrobatchSize | None"]
"""One entry per microbatch of a step (None: that microbatch's size is not known)."""


def step_sizes(given: object, n_microbatches: int) -> list[MicrobatchSize | None] | None:
    """A step's sizes as the caller gave them (``ScheduleRRFP.step(mb_sizes=...)``),
    checked: None, or a list or tuple with one entry per microbatch, each a
    ``MicrobatchSize``, a number (its tokens) or None (not known). Raises ``ValueError``
    (``TypeError`` for an entry of another type) saying what to change; checks no more
    than the sizes themselves, so every rank given the same sizes raises alike."""
    if given is None:
        return None
    if not isinstance(given, (list, tuple)):
        raise TypeError(f"mb_sizes must be a list with one size per microbatch, not a "
                        f"{type(given).__name__}")
    if len(given) != n_microbatches:
        raise ValueError(f"mb_sizes has {len(given)} entries for {n_microbatches} "
                         "microbatches: give one size (or None) per microbatch")
    sizes: list[MicrobatchSize | None] = []
    for i, size in enumerate(given):
        if size is None or isinstance(size, MicrobatchSize):
            sizes.append(size)
        elif isinstance(size, (int, float)) and not isinstance(size, bool):
            try:
                sizes.append(MicrobatchSize(tokens=size))
            except ValueError as e:
                raise ValueError(f"mb_sizes[{i}]: {e}") from None
        else:
            raise TypeError(f"mb_sizes[{i}] is a {type(size).__name__}: give a "
                            "rrfp.core.sizes.MicrobatchSize, a number of tokens, or None")
    return sizes


def tell_apart(sizes: StepSizes | None) -> bool:
    """Whether ``sizes`` say anything a per-kind mean does not: at least two known sizes
    that differ. A packed batch (every microbatch alike) is costed as if no size were
    known."""
    known = {s for s in sizes or () if s is not None}
    return len(known) > 1


@dataclass(frozen=True)
class DurationFit:
    """A (stage, kind)'s duration against size: ``intercept + sum(slopes * features)``,
    and the mean of the durations it was fitted on (for a microbatch without a size)."""

    mean: float
    intercept: float
    slopes: tuple[float, float, float] = (0.0, 0.0, 0.0)

    def predict(self, size: MicrobatchSize | None) -> float:
        """Seconds (or the unit it was fitted in) a microbatch of ``size`` is expected to
        take; never below zero (a fit extrapolated below its samples)."""
        if size is None:
            return self.mean
        return max(0.0, self.intercept + sum(b * x for b, x in zip(self.slopes, size.features)))


def fit_durations(samples: Sequence[tuple[MicrobatchSize | None, float]]) -> DurationFit:
    """Least squares of duration against size (with an intercept) over the samples with a
    size; ``mean`` over all. A number that does not vary among the samples, or that is a
    linear combination of the others (the intercept included), gets no slope."""
    if not samples:
        raise ValueError("fit_durations needs at least one sample")
    mean = sum(seconds for _, seconds in samples) / len(samples)
    sized = [(size.features, seconds) for size, seconds in samples if size is not None]
    if not sized:
        return DurationFit(mean, intercept=mean)
    columns = [[1.0] * len(sized)] + [[features[j] for features, _ in sized]
                                      for j in range(3)]
    solution = _least_squares(columns, [seconds for _, seconds in sized])
    return DurationFit(mean, solution[0], tuple(solution[1:]))  # type: ignore[arg-type]


def _least_squares(columns: list[list[float]], target: list[float]) -> list[float]:
    """Coefficients x minimizing |sum_j x_j columns[j] - target| (Gram-Schmidt, pivoting
    by column order): a column within rounding of the span of the earlier ones gets 0."""
    # Scaled to unit norm first: tokens (~1e3) and squared lengths (~1e6) side by side.
    norms = [math.sqrt(sum(v * v for v in col)) for col in columns]
    basis: list[list[float]] = []
    kept: list[int] = []
    r: list[list[float]] = []  # r[k][j]: projection of column j on basis vector k
    for j, (col, norm) in enumerate(zip(columns, norms)):
        if norm == 0.0:
            continue
        v = [c / norm for c in col]
        projections = []
        for q in basis:
            p = sum(a * b for a, b in zip(q, v))
            projections.append(p)
            v = [a - p * b for a, b in zip(v, q)]
        rest = math.sqrt(sum(a * a for a in v))
        if rest < 1e-9:
            continue
        basis.append([a / rest for a in v])
        kept.append(j)
        r.append(projections + [rest])
    rhs = [sum(q_i * t_i for q_i, t_i in zip(q, target)) for q in basis]
    scaled = [0.0] * len(basis)
    for k in reversed(range(len(basis))):
        scaled[k] = (rhs[k] - sum(r[i][k] * scaled[i] for i in range(k + 1, len(basis)))) \
            / r[k][k]
    solution = [0.0] * len(columns)
    for k, j in enumerate(kept):
        solution[j] = scaled[k] / norms[j]
    return solution


@dataclass
class DurationModels:
    """Per (stage, kind): the fit of measured durations against size over the last
    ``window`` steps that had sizes, for the stages this rank measures, and the fits other
    ranks shared for theirs."""

    window: int = DEFAULT_WINDOW
    fits: dict[Key, DurationFit] = field(default_factory=dict)
    """Every (stage, kind) with a fit: measured here, or adopted."""
    _steps: dict[Key, deque[list[tuple[MicrobatchSize | None, float]]]] = field(
        default_factory=dict)

    def record_step(self, sizes: StepSizes,
                    runs: Iterable[tuple[int, str, int, float]]) -> None:
        """One step's device durations, as (stage, kind, microbatch, seconds), with the
        sizes that step's microbatches had; refits the (stage, kind)s it ran."""
        step: dict[Key, list[tuple[MicrobatchSize | None, float]]] = {}
        for stage, kind, microbatch, seconds in runs:
            size = sizes[microbatch] if microbatch < len(sizes) else None
            step.setdefault((stage, kind), []).append((size, seconds))
        for key, samples in step.items():
            steps = self._steps.setdefault(key, deque(maxlen=self.window))
            steps.append(samples)
            self.fits[key] = fit_durations([s for seen in steps for s in seen])

    def adopt(self, fits: Mapping[Key, DurationFit]) -> None:
        """Take the fits other ranks made of their stages (never one of this rank's own
        measured ones: those it keeps)."""
        for key, fit in fits.items():
            if key not in self._steps:
                self.fits[key] = fit

    def own_fits(self) -> dict[Key, DurationFit]:
        """The fits of what this rank measured: what it shares with the others."""
        return {key: self.fits[key] for key in self._steps}

    def predict(self, stage: int, kind: str, size: MicrobatchSize | None) -> float | None:
        """The expected duration of a (stage, kind) action on a microbatch of ``size``
        (None: no fit of that stage and kind)."""
        fit = self.fits.get((stage, kind))
        return None if fit is None else fit.predict(size)
