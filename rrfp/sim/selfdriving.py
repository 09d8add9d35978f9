"""Self-driving RRFP in the simulator: a run of many steps under ``rrfp.core.tuning.Tuner``.

``run(hint, timings, budget=...)`` takes any sequence of ``Timing`` a caller builds (one per
step: ``rrfp.sim.families`` draws the study's, a replay file gives a measured one) and
simulates each step under what the tuner says, as ``ScheduleRRFP`` would run it: the
setting's limits and policy (the sizes given to the policy where the candidate uses them
and the step has them), the in-run A/B's steps in the fixed order, the policies' history
carried from step to step. The tuner's predictions replay its measured steps under every
candidate within the budget (``predict``), as the advisor replays a run's traces. Every
step counts in the run's throughput, the A/B's and the measuring steps' too.

``hindsight(...)`` runs every candidate alone over the same steps: the best single setting,
chosen knowing the whole run, is the yardstick of what the mode captures.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from rrfp.core.hints import Hint, interchangeable_hints
from rrfp.core.history import History
from rrfp.core.limits import check_limits, resolve_buffer_limits
from rrfp.core.policy import policy_for, SIZE_READING_POLICIES
from rrfp.core.settings import DEFAULT_LAUNCH_DEPTH, parse_buffer_limit
from rrfp.core.tuning import Candidate, Decision, FIXED_ORDER, Predicted, Tuner, TuningRules
from rrfp.sim.engine import simulate
from rrfp.sim.workloads import Timing

POLICIES = ("hint", "lookahead", "critical", "drain")
"""The policies a candidate may run, beside the default at its limit."""


def candidates(hint: Hint, budget: str, *, sizes: bool = False,
               hints: bool = False) -> list[Candidate]:
    """Every setting within ``budget`` (``"hint+k"``, ``"Nx hint"`` or an int, in
    microbatches): each limit from the hint's own up to the budget, under the default
    policy and each of ``POLICIES``, and (``hints``, as ``Settings.tune_hints``) each
    interchangeable hint ranking at that limit under its default policy where the limit
    suits it; told the sizes and not where the steps have them (``sizes``) and the policy
    reads them; settings that run alike are one."""
    limit = parse_buffer_limit(budget)
    if limit.in_bytes:
        raise ValueError(f"budget={budget!r}: the simulator's candidates are in microbatches "
                         "(the simulated steps have no bytes); use 'hint+k', 'Nx hint' or an int")
    top = resolve_buffer_limits(limit, hint)
    own = resolve_buffer_limits("hint", hint)
    extra = max(top.per_rank[r] - own.per_rank[r] for r in own.per_rank)
    ranking = {None: hint, **(interchangeable_hints(hint) if hints else {})}
    found, seen = [], set()
    for spec in ("hint", *(f"hint+{k}" for k in range(1, extra + 1))):
        limits = resolve_buffer_limits(spec, hint)
        for name, ranked in ranking.items():
            try:
                check_limits(limits, ranked, spec)
            except ValueError:  # below the peaks its streams need
                continue
            for policy in (None, *POLICIES) if name is None else (None,):
                runs = policy_for(policy, ranked, limits)
                for use in (True, False) if sizes and runs in SIZE_READING_POLICIES else (True,):
                    key = (name, spec, runs, use)
                    if key not in seen:
                        seen.add(key)
                        found.append(Candidate(spec, policy, use, name))
    return found


@dataclass(frozen=True)
class SelfDrivingRun:
    """A simulated run: per step what ran and how long it took, and the tuner's decisions."""

    step_times: tuple[float, ...]
    fixed_times: tuple[float, ...]
    """Per step: the fixed schedule's makespan on the same timings."""
    settings: tuple[Candidate, ...]
    """Per step: what the tuner ran (``FIXED_ORDER`` for the A/B's steps too)."""
    ab_steps: tuple[int, ...]
    decisions: tuple[Decision, ...]

    @property
    def speedup(self) -> float:
        """The run's throughput over the fixed schedule's: every step counted."""
        return sum(self.fixed_times) / sum(self.step_times)

    @property
    def settled_at(self) -> int:
        """The step from which the last decision's setting ran."""
        return self.decisions[-1].step


class _Runner:
    """Simulates steps of ``hint`` the way ``ScheduleRRFP`` would run a candidate."""

    def __init__(self, hint: Hint, launch_depth: float, launch_cost: float):
        self.hint, self.launch_depth, self.launch_cost = hint, launch_depth, launch_cost
        self._hints: dict[str, Hint] | None = None
        """The interchangeable hints, built at the first setting ranked by one."""

    def ranked_by(self, setting: Candidate) -> Hint:
        if setting.hint is None:
            return self.hint
        if self._hints is None:
            self._hints = interchangeable_hints(self.hint)
        return self._hints[setting.hint]

    def fixed(self, timing: Timing) -> float:
        return simulate(self.hint, timing.duration, latency=timing.latency, policy="fixed",
                        launch_depth=math.inf, launch_cost=self.launch_cost).makespan

    def step(self, setting: Candidate, timing: Timing,
             histories: Mapping[int, History] | None) -> tuple[float, dict[int, History]]:
        """The step's makespan under ``setting`` and what the policies learnt from it."""
        if setting == FIXED_ORDER:
            return self.fixed(timing), dict(histories or {})
        limits = resolve_buffer_limits(setting.buffer_limit, self.hint)
        ranked = self.ranked_by(setting)
        result = simulate(ranked, timing.duration, latency=timing.latency,
                          policy=policy_for(setting.policy, ranked, limits),
                          limits=limits, histories=histories,
                          launch_depth=self.launch_depth, launch_cost=self.launch_cost,
                          sizes=timing.sizes if setting.use_sizes else None)
        return result.makespan, result.histories


def setting_times(hint: Hint, timings: Sequence[Timing], setting: Candidate, *,
                  launch_depth: float = DEFAULT_LAUNCH_DEPTH, launch_cost: float = 0.0
                  ) -> list[float]:
    """Each step's makespan under ``setting`` alone (in order, its policy learning from its
    own earlier steps)."""
    return _times(_Runner(hint, launch_depth, launch_cost), setting, timings)


def _times(runner: _Runner, setting: Candidate, timings: Sequence[Timing]) -> list[float]:
    times, histories = [], None
    for timing in timings:
        makespan, histories = runner.step(setting, timing, histories)
        times.append(makespan)
    return times


def predict(hint: Hint, timings: Sequence[Timing], settings: Sequence[Candidate], *,
            launch_depth: float = DEFAULT_LAUNCH_DEPTH, launch_cost: float = 0.0
            ) -> list[Predicted]:
    """Each setting's speedup over the fixed schedule on ``timings`` (simulated in order,
    each policy learning from its own earlier steps): the fixed schedule's total time over
    the setting's."""
    runner = _Runner(hint, launch_depth, launch_cost)
    fixed = sum(runner.fixed(t) for t in timings)
    return [Predicted(setting, fixed / sum(_times(runner, setting, timings)))
            for setting in settings]


def run(hint: Hint, timings: Sequence[Timing], *, budget: str = "hint+2",
        rules: TuningRules = TuningRules(), settings: Sequence[Candidate] | None = None,
        launch_depth: float = DEFAULT_LAUNCH_DEPTH, launch_cost: float = 0.0) -> SelfDrivingRun:
    """``len(timings)`` steps of ``hint`` under the tuner, choosing among ``settings``
    (default: ``candidates(hint, budget)``, with sizes where the steps have them); times in
    the timings' unit."""
    if settings is None:
        settings = candidates(hint, budget, sizes=any(t.sizes is not None for t in timings))
    runner = _Runner(hint, launch_depth, launch_cost)
    tuner = Tuner(rules)
    histories: dict[int, History] | None = None
    times, fixed_times, ran, ab_steps = [], [], [], []
    for step, timing in enumerate(timings):
        planned = tuner.next_run()
        setting = FIXED_ORDER if planned.ab_fixed else planned.setting
        makespan, learned = runner.step(setting, timing, histories)
        if setting != FIXED_ORDER:  # as in the runtime: fixed-order steps teach nothing
            histories = learned
        tuner.observe(planned, makespan)
        times.append(makespan)
        fixed_times.append(makespan if setting == FIXED_ORDER else runner.fixed(timing))
        ran.append(setting)
        if planned.ab_fixed:
            ab_steps.append(step)
        measured = tuner.wants_predictions
        if measured is not None:
            tuner.choose(predict(hint, [timings[s] for s in measured], settings,
                                 launch_depth=launch_depth, launch_cost=launch_cost))
    return SelfDrivingRun(tuple(times), tuple(fixed_times), tuple(ran), tuple(ab_steps),
                          tuple(tuner.decisions))


def hindsight(hint: Hint, timings: Sequence[Timing], settings: Sequence[Candidate], *,
              launch_depth: float = DEFAULT_LAUNCH_DEPTH, launch_cost: float = 0.0
              ) -> Predicted:
    """The best single setting over the whole run, chosen knowing it: its speedup over the
    fixed schedule, every step counted."""
    return max(predict(hint, timings, settings, launch_depth=launch_depth,
                       launch_cost=launch_cost), key=lambda p: p.speedup)
