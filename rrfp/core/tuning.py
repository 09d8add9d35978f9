"""Self-driving RRFP: which setting each step runs, decided from the steps' measured times.

A torch-free state machine that the runtime and the simulator drive alike: the caller asks
``next_run()`` what the coming step runs, runs it, and reports its seconds to
``observe()``. Predicting the candidate settings is the caller's work (it needs the
simulator, and runs off the training's critical path): when ``wants_predictions`` names
measured steps, the caller predicts every candidate from them and hands the result to
``choose()``, steps going on meanwhile. The rules, with their constants in ``TuningRules``:

0. **Blocks.** A decision takes effect at the first step of the next block of ``block``
   steps, so that every rank of a job can read a block's plan (``plan_block``) once, from
   one rank that decides, and switch at the same step.

1. **Measure.** The first ``measure_steps`` steps run the hint's own setting (``OWN``),
   which keeps running, verified by the A/B (rule 3), until the first decision.
2. **Choose.** The candidate with the best predicted speedup over the fixed schedule runs
   from then on if that speedup is at least ``switch_margin`` and ``refine_margin`` times
   the hint's own setting's; otherwise the hint's own setting keeps running (what the run
   would do without choosing), or, once the A/B found it slower, the fixed order itself
   (``FIXED_ORDER``). **Refine** on the first
   ``refine_at`` steps since measuring began (each entry once): a candidate predicted
   faster than the running one by ``refine_margin`` takes over.
3. **Verify.** Every ``ab_every``-th step runs the fixed order (the in-run A/B), from the
   first step on: while a first prediction waits for its CPU share, the hint's own
   setting runs checked. Each such step paired with its neighbours gives a measured
   speedup (``ab_speedups``); each decision starts its own pairs. Once ``settle_pairs``
   pairs measured the setting faster on average, every ``ab_every_settled``-th step runs
   the fixed order instead (back to ``ab_every`` while their mean says slower).
   **Fall back** when the upper one-sided ``confidence`` bound of the mean log speedup,
   over every pair since the decision (at least ``min_pairs``), is below 0: the setting is
   slower than the fixed order, beyond what the pairs' own spread explains. The hint's own
   setting runs, else (it too found slower) the fixed order: not the next candidate, which
   the replay that over-predicted the rejected setting predicted no faster. From then on
   each prediction (a refine round's) counts at its value times the replay's measured
   error on this job: the lowest ratio, over the settings found slower, of the A/B's
   measured speedup to its latest prediction. A drift (rule 4) forgets what was found
   slower, and so the error.
4. **Re-tune.** The median of the last ``window`` steps at the setting against the median
   of the steps at it before them: when it moved by more than ``drift_fraction`` and by more than
   ``drift_errors`` standard errors, on ``drift_hold`` steps in a row, then (once at least
   ``dwell`` steps passed since the last decision) the setting keeps running while the
   steps from the next block on are measured again, and the choice is made again on them.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field

__all__ = ["ab_speedups", "Candidate", "Decision", "FIXED_ORDER", "OWN", "Predicted",
           "StepRun", "Tuner", "TuningRules"]


@dataclass(frozen=True)
class Candidate:
    """A setting the tuner may run: a ``buffer_limit`` within the budget, a policy, and the
    hint that ranks ready actions."""

    buffer_limit: str
    """Counted on the run's own hint (its peaks, ``"hint+k"``), whichever hint ranks."""
    policy: str | None = None
    """None: ScheduleRRFP's default at that limit."""
    use_sizes: bool = True
    """Whether the policy is told the microbatches' sizes (where the caller gives them)."""
    hint: str | None = None
    """The name of an interchangeable hint that ranks ready actions instead of the run's
    own (``rrfp.core.hints.interchangeable_hints``); None: the run's own."""

    def describe(self) -> str:
        if self == FIXED_ORDER:
            return "the hint's fixed order"
        ranked = "" if self.hint is None else f"hint={self.hint!r}, "
        policy = "the default policy" if self.policy is None else f"policy={self.policy!r}"
        sizes = "" if self.use_sizes else ", sizes not used"
        return f"{ranked}buffer_limit={self.buffer_limit!r}, {policy}{sizes}"


OWN = Candidate("hint")
"""The hint's own setting: its memory, the default policy."""
FIXED_ORDER = Candidate("hint", "fixed")
"""The hint's fixed order: the fixed schedule itself."""


@dataclass(frozen=True)
class StepRun:
    """What one step runs."""

    setting: Candidate
    ab_fixed: bool
    """The in-run A/B's baseline step: the hint's fixed order, whatever the setting."""


@dataclass(frozen=True)
class Predicted:
    setting: Candidate
    speedup: float
    """Predicted over the fixed schedule, from the measured steps."""


@dataclass(frozen=True)
class Decision:
    """A change of what the tuner runs, and why."""

    step: int
    """The first step it applies to."""
    setting: Candidate
    reason: str
    """``"measure"``, ``"switch"``, ``"refine"``, ``"no gain"``, ``"fall back"`` or
    ``"drift"``."""
    predicted: float | None = None
    """The setting's predicted speedup over the fixed schedule."""
    measured: float | None = None
    """The in-run A/B's geometric mean speedup behind a fall-back or a drift."""

    def line(self) -> str:
        """One log line: what runs from which step, the prediction, the measurement."""
        text = f"from step {self.step}: {self.setting.describe()} ({self.reason}"
        if self.predicted is not None:
            text += f"; predicted {self.predicted:.3f}x the fixed schedule"
        if self.measured is not None:
            text += f"; measured {self.measured:.3f}x by the in-run A/B"
        return text + ")"


@dataclass(frozen=True)
class TuningRules:
    """The tuner's constants (see the module's docstring for the rules they set)."""

    block: int = 4
    measure_steps: int = 4
    refine_at: tuple[int, ...] = (16, 40)
    refine_margin: float = 1.01
    ab_every: int = 8
    ab_every_settled: int = 64
    settle_pairs: int = 4
    switch_margin: float = 1.02
    confidence: float = 0.99
    min_pairs: int = 4
    window: int = 10
    drift_fraction: float = 0.10
    drift_errors: float = 3.0
    drift_hold: int = 5
    dwell: int = 30

    def __post_init__(self) -> None:
        for name in ("measure_steps", "ab_every", "ab_every_settled", "min_pairs", "window",
                     "drift_hold"):
            if getattr(self, name) < 1 + (name.startswith("ab_")):
                raise ValueError(f"TuningRules.{name} must be an int >= "
                                 f"{1 + name.startswith('ab_')}, got {getattr(self, name)}")
        for name in ("ab_every", "ab_every_settled"):
            if getattr(self, name) % self.block:
                raise ValueError(f"TuningRules.{name} ({getattr(self, name)}) must be a "
                                 f"multiple of block ({self.block})")
        rounds = [self.measure_steps, *self.refine_at]
        if any(later <= earlier for earlier, later in zip(rounds, rounds[1:])):
            raise ValueError(f"TuningRules.refine_at ({self.refine_at}) must rise, each "
                             f"above measure_steps ({self.measure_steps})")
        if not 0.5 < self.confidence < 1:
            raise ValueError(f"TuningRules.confidence must be in (0.5, 1), got {self.confidence}")


def ab_speedups(steps: Sequence[tuple[bool, float]]) -> list[float]:
    """The in-run A/B's measured speedups: for each fixed-order step (``(True, seconds)``),
    its time over the mean of the steps at the run's own setting next to it (before and
    after), so that a drift in the machine's speed falls on both."""
    ratios = []
    for i, (fixed, seconds) in enumerate(steps):
        if not fixed:
            continue
        neighbours = [steps[j][1] for j in (i - 1, i + 1)
                      if 0 <= j < len(steps) and not steps[j][0]]
        if neighbours:
            ratios.append(seconds / statistics.mean(neighbours))
    return ratios


def upper_bound(values: Sequence[float], confidence: float) -> float:
    """The one-sided upper ``confidence`` bound of the mean of ``values`` (Student's t,
    its quantile by the Cornish-Fisher expansion, a little below the exact one with few
    degrees of freedom: ``tests/test_tuning.py`` bounds the difference)."""
    n = len(values)
    z = statistics.NormalDist().inv_cdf(confidence)
    df = n - 1
    t = (z + (z**3 + z) / (4 * df) + (5 * z**5 + 16 * z**3 + 3 * z) / (96 * df**2)
         + (3 * z**7 + 19 * z**5 + 17 * z**3 - 15 * z) / (384 * df**3))
    return statistics.mean(values) + t * statistics.stdev(values) / math.sqrt(n)


@dataclass
class _Since:
    """What the tuner saw since its last decision."""

    step: int
    runs: list[tuple[bool, float]] = field(default_factory=list)
    """(an A/B fixed-order step, seconds) per step."""
    pair_logs: list[float] = field(default_factory=list)
    """The log of each A/B pair's measured speedup in ``runs`` (read once per step)."""
    drifting: int = 0
    """Steps in a row whose recent median strayed."""
    drifted: bool = False
    """They strayed on ``drift_hold`` steps in a row (kept until the dwell has passed)."""


class Tuner:
    """Which setting each step runs (see the module's docstring)."""

    def __init__(self, rules: TuningRules = TuningRules()):
        self.rules = rules
        self.steps = 0
        """Steps observed."""
        self.setting = OWN
        self.decisions: list[Decision] = [Decision(0, OWN, "measure")]
        self._measuring_from: int | None = 0
        """The first step of the steps being measured (None: not measuring)."""
        self._rounds = self._prediction_rounds()
        """How many measured steps each prediction still to come is made from."""
        self._since = _Since(0)
        self._pending: Decision | None = None
        """A decision made, to take effect at its step (the next block's first)."""
        self._ranked: list[Predicted] = []
        self._rejected: dict[Candidate, float] = {}
        """The settings the A/B found slower, with their measured speedups."""

    @property
    def wants_predictions(self) -> range | None:
        """The measured steps to predict every candidate from, once they ran (None: no
        prediction is wanted now)."""
        start = self._measuring_from
        if start is None or self.steps - start < self._rounds[0]:
            return None
        return range(start, start + self._rounds[0])

    @property
    def measuring(self) -> bool:
        """Whether the steps now running are measured for a prediction to come (not yet
        all the steps the last of them reads)."""
        start = self._measuring_from
        return start is not None and self.steps < start + self._rounds[-1]

    def _prediction_rounds(self) -> list[int]:
        return [self.rules.measure_steps, *self.rules.refine_at]

    def next_run(self) -> StepRun:
        """What the coming step runs."""
        return self._run_at(self.steps)

    def plan_block(self) -> list[StepRun]:
        """What each step of the block starting now runs (call it at a block's first
        step): what one deciding rank tells the others."""
        if self.steps % self.rules.block:
            raise RuntimeError(f"plan_block() at step {self.steps}, inside a block of "
                               f"{self.rules.block}: call it at a block's first step")
        return [self._run_at(self.steps + k) for k in range(self.rules.block)]

    def _run_at(self, step: int) -> StepRun:
        if self.setting == FIXED_ORDER:
            return StepRun(self.setting, False)
        every = self.rules.ab_every_settled if self._settled() else self.rules.ab_every
        return StepRun(self.setting, (step - self._since.step) % every == every - 1)

    def _settled(self) -> bool:
        """Whether the A/B may verify rarely: ``settle_pairs`` pairs since the decision
        measured the setting faster than the fixed order on average. A setting measured
        slower keeps its fixed-order steps coming (they run the faster order) until the
        fall-back's bound decides."""
        logs = self._since.pair_logs
        return len(logs) >= self.rules.settle_pairs and statistics.mean(logs) > 0

    def observe(self, run: StepRun, seconds: float) -> None:
        """The step that ran ``run`` (``next_run()``'s answer) took ``seconds``."""
        if not seconds >= 0:
            raise ValueError(f"a step's time must be a number of seconds >= 0, got {seconds!r}")
        since = self._since
        since.runs.append((run.ab_fixed, seconds))
        since.pair_logs = [math.log(r) for r in ab_speedups(since.runs) if r > 0]
        self.steps += 1
        if self._pending is not None:
            self._apply_pending()
        elif not self._falls_back() and self._measuring_from is None:
            self._watch_drift()

    def choose(self, predictions: Sequence[Predicted]) -> Decision:
        """Decide on the measured steps' ``predictions`` (one per candidate, the setting
        running now among them or not); applies from the next step. Returns the decision
        in force."""
        if self.wants_predictions is None:
            raise RuntimeError("choose() needs predictions of the measured steps: call it "
                               "when wants_predictions names them")
        first = len(self._rounds) == len(self._prediction_rounds())
        self._rounds.pop(0)
        if not self._rounds:
            self._measuring_from = None
        self._ranked = sorted((p for p in predictions if p.setting != FIXED_ORDER),
                              key=lambda p: -p.speedup)
        best = self._next_candidate()
        if best is None:
            plain = self._plain()
            if first or self.setting != plain:
                return self._decide(plain, "no gain",
                                    max((p.speedup for p in self._ranked), default=None))
            return self._in_force()
        if first:
            return self._decide(best.setting, "switch", best.speedup)
        running = next((p.speedup for p in self._ranked if p.setting == self.setting), 1.0)
        if best.setting != self.setting and best.speedup >= running * self.rules.refine_margin:
            return self._decide(best.setting, "refine", best.speedup)
        return self._in_force()

    def _in_force(self) -> Decision:
        """The latest decision, taken effect or pending."""
        return self._pending or self.decisions[-1]

    def _next_candidate(self) -> Predicted | None:
        """The best candidate not rejected that clears the margins, its prediction times the
        replay's measured error: over the fixed schedule, and over the hint's own setting's
        prediction (what the run would do without choosing)."""
        own = next((p.speedup for p in self._ranked if p.setting == OWN), 1.0)
        floor = max(self.rules.switch_margin / self._replay_error(),
                    own * self.rules.refine_margin)
        return next((p for p in self._ranked if p.setting not in self._rejected
                     and p.setting != OWN and p.speedup >= floor), None)

    def _replay_error(self) -> float:
        """The lowest measured over predicted speedup of a setting the A/B found slower
        (1: none, or none of them predicted)."""
        return min([1.0, *(self._rejected[p.setting] / p.speedup for p in self._ranked
                           if p.setting in self._rejected and p.speedup > 0)])

    def _plain(self) -> Candidate:
        """Where no candidate clears the margins: the hint's own setting, unless the A/B
        found it slower than the fixed order."""
        return OWN if OWN not in self._rejected else FIXED_ORDER

    def _decide(self, setting: Candidate, reason: str, predicted: float | None = None,
                measured: float | None = None) -> Decision:
        block = self.rules.block
        decision = Decision(-(-self.steps // block) * block, setting, reason, predicted,
                            measured)
        self._pending = decision
        self._apply_pending()
        return decision

    def _apply_pending(self) -> None:
        decision = self._pending
        if decision is None or self.steps < decision.step:
            return
        self._pending = None
        self.decisions.append(decision)
        self.setting = decision.setting
        self._since = _Since(self.steps)

    def _falls_back(self) -> bool:
        """Fall back where the pairs since the decision say the setting is slower."""
        logs = self._since.pair_logs
        if len(logs) < max(2, self.rules.min_pairs):
            return False
        if upper_bound(logs, self.rules.confidence) >= 0:
            return False
        measured = math.exp(statistics.mean(logs))
        self._rejected[self.setting] = measured
        self._decide(self._plain(), "fall back", measured=measured)
        return True

    def _watch_drift(self) -> None:
        """Measure again where the steps at the setting drifted (see the rules)."""
        rules, since = self.rules, self._since
        times = [seconds for fixed, seconds in since.runs if not fixed]
        if len(times) < 2 * rules.window:
            return
        earlier, last = times[:-rules.window], times[-rules.window:]
        reference, recent = statistics.median(earlier), statistics.median(last)
        spread = _deviation(earlier)  # the longer stretch estimates it more steadily
        error = 1.2533 * spread * math.sqrt(1 / len(earlier) + 1 / len(last))
        strays = (abs(recent - reference) > rules.drift_fraction * reference
                  and abs(recent - reference) > rules.drift_errors * error)
        since.drifting = since.drifting + 1 if strays else 0
        since.drifted = since.drifted or since.drifting >= rules.drift_hold
        if since.drifted and self.steps - since.step >= rules.dwell:
            measured = math.exp(statistics.mean(since.pair_logs)) if since.pair_logs else None
            decision = self._decide(self.setting, "drift", measured=measured)
            self._rejected.clear()  # what the A/B found slower was found on other timings
            # From the next block: where a job's ranks are told to share their traces.
            self._measuring_from = decision.step
            self._rounds = self._prediction_rounds()


def _deviation(values: Sequence[float]) -> float:
    """The standard deviation of ``values`` estimated from their median absolute deviation
    (1.4826 MAD for normal data), steady against outliers. The median of n values errs
    by about 1.2533 of it over the square root of n."""
    centre = statistics.median(values)
    return 1.4826 * statistics.median(abs(v - centre) for v in values)
