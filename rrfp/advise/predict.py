"""Each setting a run could take, replayed in the simulator on the run's measured steps.

A setting keeps the job's model split (its placement and microbatch count): a hint with
the same placement, a ``buffer_limit`` (``hint``, ``hint+1``, ``hint+2``, ``2x hint``,
and, where the activations were metered, ``busiest`` and byte budgets) and a policy (the
default at that limit, or one named). Every measured step is simulated under the fixed
schedule of the run's hint (the baseline: what the job runs without RRFP) and under the
setting, in step order, so the policies that learn from earlier steps learn as they would
in the run; where the steps recorded their microbatch sizes (``step(mb_sizes=...)``), a
setting's policy is told them unless the setting says not (``Setting.use_sizes``), and the
run's own setting's as its steps were. A setting's speedup is the median over steps of
fixed / setting makespans; its step time, the run's measured step time scaled by what the
simulator predicts for the setting against the run's own setting. Bytes: per rank the activation bytes the setting's
limits allow at most (its worst mix of stages' microbatches), and the peak the simulated
steps held, at the measured bytes per microbatch per stage.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from rrfp.advise.measured import MeasuredRun
from rrfp.core.hints import build_hint, Hint, HINT_NAMES
from rrfp.core.limits import (byte_budgets, check_limits, fixed_peak_bytes, limits_within_bytes,
                              MemoryLimits, most_bytes_allowed, peak_bytes_held,
                              resolve_buffer_limits)
from rrfp.core.policy import policy_for, SIZE_READING_POLICIES
from rrfp.core.settings import parse_buffer_limit
from rrfp.core.sizes import StepSizes, tell_apart
from rrfp.sim.engine import simulate, SimResult

MICROBATCH_LIMITS = ("hint", "hint+1", "hint+2", "2x hint")
BUDGET_FACTORS = (1.25, 1.5)
"""Byte budgets tried: these multiples of the fixed schedule's busiest rank's peak bytes."""
NAMED_POLICIES = ("hint", "lookahead", "critical", "arrival")
"""Policies tried beside the default, on the run's own hint."""


@dataclass(frozen=True)
class Setting:
    """What a user would set: ScheduleRRFP's ``hint``, ``buffer_limit`` and ``policy``."""

    hint: str
    buffer_limit: str
    policy: str | None = None
    """None: ScheduleRRFP's default at the limit."""
    use_sizes: bool = True
    """Whether the policy is told each step's microbatch sizes, where the run's steps
    recorded them (``step(mb_sizes=...)``; the self-driving mode may run without)."""
    limits_on_run_hint: bool = False
    """``buffer_limit`` counted on the run's hint, not on ``hint`` (the self-driving
    mode's candidates ranked by an interchangeable hint keep the run's limits)."""

    def describe(self, run_hint: str) -> str:
        """The setting as ScheduleRRFP's arguments (the hint where it is not the run's)."""
        parts = [] if self.hint == run_hint else [f"hint={self.hint!r}"]
        parts.append(f"buffer_limit={self.buffer_limit!r}")
        if self.policy is not None:
            parts.append(f"policy={self.policy!r}")
        if not self.use_sizes:
            parts.append("sizes not used")
        return ", ".join(parts)


@dataclass(frozen=True)
class Prediction:
    setting: Setting
    policy: str
    """The policy it runs (the default resolved)."""
    limits: MemoryLimits
    speedups: tuple[float, ...]
    """Per measured step: simulated fixed-schedule makespan / the setting's."""
    step_time: float
    """Predicted seconds per step."""
    allowed_bytes: Mapping[int, int] | None
    """Per rank: the most activation bytes its limits allow (None: bytes not measured)."""
    peak_bytes: Mapping[int, int] | None
    """Per rank: the most the simulated steps held."""
    fixed_bytes: Mapping[int, int] | None
    """Per rank: what the run's hint's fixed order holds at its peak."""
    even_split: bool
    """The hint splits backward (I/W) but the run measured whole backwards: each was
    split in two equal halves."""
    results: tuple[SimResult, ...] = field(repr=False, default=())
    """Per measured step, its simulation under the setting."""

    @property
    def speedup(self) -> float:
        return statistics.median(self.speedups)

    @property
    def extra_bytes(self) -> dict[int, int] | None:
        """Per rank: bytes the limits allow beyond the fixed schedule's own peak there."""
        if self.allowed_bytes is None or self.fixed_bytes is None:
            return None
        return {r: self.allowed_bytes[r] - self.fixed_bytes[r] for r in self.allowed_bytes}

    @property
    def job_peak_extra(self) -> int | None:
        """Bytes the busiest rank may hold beyond the fixed schedule's busiest rank: what
        the job's peak activation memory may grow by."""
        if self.allowed_bytes is None or self.fixed_bytes is None:
            return None
        return max(self.allowed_bytes.values()) - max(self.fixed_bytes.values())


@dataclass(frozen=True)
class Replay:
    """The run's measured steps simulated at the run's own setting and in the fixed order."""

    fixed: tuple[float, ...]
    """Per step: the fixed schedule's simulated makespan."""
    own: tuple[float, ...]
    """Per step: the run's own setting's."""
    own_results: tuple[SimResult, ...]


def candidates(run: MeasuredRun) -> list[Setting]:
    """The settings the job could take without changing its model split."""
    limits = list(MICROBATCH_LIMITS)
    if run.bytes_per_microbatch is not None:
        busiest = max(fixed_peak_bytes(run.hint, run.bytes_per_microbatch).values())
        limits += ["busiest", *(_mib(busiest * f) for f in BUDGET_FACTORS)]
    own = run.hint.name
    settings = [Setting(own, limit, policy) for limit in limits
                for policy in (None, *NAMED_POLICIES)]
    for name in HINT_NAMES:
        if name.lower() != own.lower() and _same_split(run.hint, name):
            settings += [Setting(name, limit) for limit in limits]
    return settings


def _mib(nbytes: float) -> str:
    return f"{math.ceil(nbytes / (1 << 20))}MiB"


def _same_split(hint: Hint, name: str) -> bool:
    try:
        other = _built(hint, name)
    except ValueError:
        return False
    return dict(other.stage_to_rank) == dict(hint.stage_to_rank)


def _built(hint: Hint, name: str) -> Hint:
    if name == hint.name:
        return hint
    return build_hint(name, num_ranks=hint.num_ranks, num_stages=hint.num_stages,
                      n_microbatches=hint.n_microbatches, layout=hint.layout)


def limits_of(setting: Setting, hint: Hint,
              bytes_per_microbatch: Mapping[int, int] | None) -> MemoryLimits:
    """The microbatch limits ScheduleRRFP would run ``setting`` at (from its second step,
    for a setting in bytes); ``ValueError`` where it would refuse it."""
    limit = parse_buffer_limit(setting.buffer_limit)
    if not limit.in_bytes:
        return resolve_buffer_limits(limit, hint, fixed_order=setting.policy == "fixed")
    if bytes_per_microbatch is None or limit.auto:
        raise ValueError("a limit in bytes needs the measured bytes per microbatch, 'auto' "
                         "the devices' free memory")
    budgets = byte_budgets(limit, hint, bytes_per_microbatch,
                           dict.fromkeys(range(hint.num_ranks), limit.budget_bytes))
    return limits_within_bytes(hint, bytes_per_microbatch, budgets).limits


def replay(run: MeasuredRun) -> Replay:
    """The measured steps at the run's own setting and in the fixed order."""
    fixed = tuple(_simulate(run, run.hint, step, "fixed", None, None, None).makespan
                  for step in range(len(run.steps)))
    own = _simulated_steps(run, run.ranked_by or run.hint, run.policy, run.limits,
                           [step.timing.sizes if step.sizes_used else None for step in run.steps])
    return Replay(fixed, tuple(r.makespan for r in own), tuple(own))


def _hint_and_limits(run: MeasuredRun, setting: Setting) -> tuple[Hint, MemoryLimits]:
    """The hint ``setting`` ranks by and the limits it runs at; ``ValueError`` where
    ScheduleRRFP would refuse them."""
    hint = _built(run.hint, setting.hint)
    if not setting.limits_on_run_hint:
        return hint, limits_of(setting, hint, run.bytes_per_microbatch)
    limits = limits_of(setting, run.hint, run.bytes_per_microbatch)
    check_limits(limits, hint, setting.buffer_limit, fixed_order=setting.policy == "fixed")
    return hint, limits


def predict(run: MeasuredRun, setting: Setting, baseline: Replay) -> Prediction:
    """``setting`` over the run's measured steps; ``ValueError`` where ScheduleRRFP would
    refuse it."""
    hint, limits = _hint_and_limits(run, setting)
    policy = policy_for(setting.policy, hint, limits)
    results = _simulated_steps(run, hint, policy, limits, _told(run, setting))
    own_steps = run.own_steps
    scaled = [step.step_time * r.makespan / own for step, r, own
              in zip(run.steps, results, baseline.own) if step in own_steps]
    per_microbatch = run.bytes_per_microbatch
    allowed = peak = fixed = None
    if per_microbatch is not None:
        allowed = {r: most_bytes_allowed(limits.per_stage, limits.per_rank[r], per_microbatch,
                                         hint.stages_on(r)) for r in range(hint.num_ranks)}
        peak = {r: max(peak_bytes_held(hint.plan.ranks[r], result.realized[r], per_microbatch)
                       for result in results) for r in range(hint.num_ranks)}
        fixed = fixed_peak_bytes(run.hint, per_microbatch)
    measured_split = any(span.kind == "I" for step in run.steps
                         for spans in step.spans.values() for span in spans)
    return Prediction(
        setting, policy, limits,
        tuple(f / r.makespan for f, r in zip(baseline.fixed, results)),
        statistics.median(scaled), allowed, peak, fixed,
        even_split=hint.has_split_backward and not measured_split, results=tuple(results))


def predictions(run: MeasuredRun, settings: Sequence[Setting] | None = None
                ) -> tuple[Replay, list[Prediction]]:
    """Every setting ScheduleRRFP accepts for the run (default: ``candidates``), best
    predicted speedup first; settings that run the same limits and policy are one row (told
    the sizes or not: one row where the policy does not read them or the steps have none
    that tell microbatches apart)."""
    baseline = replay(run)
    rows, seen = [], set()
    for setting in candidates(run) if settings is None else settings:
        try:
            hint, limits = _hint_and_limits(run, setting)
        except ValueError:
            continue
        policy = policy_for(setting.policy, hint, limits)
        told = policy in SIZE_READING_POLICIES and any(tell_apart(s) for s in _told(run, setting))
        key = (hint.name, _frozen(limits), policy, told)
        if key in seen:
            continue
        seen.add(key)
        rows.append(predict(run, setting, baseline))
    rows.sort(key=lambda p: -p.speedup)
    return baseline, rows


def _frozen(limits: MemoryLimits) -> tuple:
    return tuple(sorted(limits.per_stage.items())), tuple(sorted(limits.per_rank.items()))


def _told(run: MeasuredRun, setting: Setting) -> list[StepSizes | None]:
    """Per measured step, the sizes ``setting``'s policy is told."""
    return [step.timing.sizes if setting.use_sizes else None for step in run.steps]


def _simulated_steps(run: MeasuredRun, hint: Hint, policy: str, limits: MemoryLimits,
                     sizes: Sequence[StepSizes | None]) -> list[SimResult]:
    """The measured steps in order under ``policy``, each told its ``sizes``."""
    results: list[SimResult] = []
    histories = None
    for step in range(len(run.steps)):
        result = _simulate(run, hint, step, policy, limits, histories, sizes[step])
        histories = result.histories
        results.append(result)
    return results


def _simulate(run: MeasuredRun, hint: Hint, step: int, policy: str,
              limits: MemoryLimits | None, histories, sizes: StepSizes | None) -> SimResult:
    """One measured step under ``policy`` (the fixed order at the fixed schedule's launch
    depth), its policy told ``sizes`` (as ``ScheduleRRFP`` tells it)."""
    timing = run.steps[step].timing
    return simulate(hint, timing.duration, latency=timing.latency, policy=policy,
                    limits=limits, histories=histories, sizes=sizes,
                    launch_depth=run.fixed_launch_depth if policy == "fixed" else run.launch_depth,
                    launch_cost=run.dispatch_cost)


def variability(run: MeasuredRun) -> float:
    """How far the measured timings stray within a step: each action's duration from the
    step's mean for its stage and kind, each message's latency from the step's mean for
    its link and direction, the absolute deviations summed and divided by the time the
    actions took. 0: in every step each stage's forwards take as long as each other, its
    messages as long in transit (nothing for a readiness-first order to take); 0.2: they
    stray by a fifth of the compute. (A step slower as a whole is no variability here.)"""
    groups: dict[tuple, list[float]] = {}
    for i, step in enumerate(run.steps):
        for spans in step.spans.values():
            for span in spans:
                groups.setdefault((i, span.stage, span.kind), []).append(span.end - span.start)
        t = step.timing
        for s in range(t.num_stages):
            for m in range(t.n_microbatches):
                if s + 1 < t.num_stages:
                    groups.setdefault((i, s, "activation"), []).append(t.activation_latency[s][m])
                if s > 0:
                    groups.setdefault((i, s, "gradient"), []).append(t.gradient_latency[s][m])
    busy = sum(sum(v) for k, v in groups.items() if k[2] in ("F", "B", "I", "W"))
    if not busy:
        return 0.0
    return sum(abs(x - statistics.mean(v)) for v in groups.values() for x in v) / busy
