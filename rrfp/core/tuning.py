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
   **Fall back** when the upper one-sided bound of the mean log speedup over every pair
   since the decision (at least ``min_pairs``) is below 0: the setting is slower than the
   fixed order, beyond what the pairs' own spread explains. The bound holds over every
   look at once (``rrfp.core.ab_pairs.look_quantile``, tightest at its first look): a
   setting as fast as the fixed order is rejected with a chance of at most
   1 - ``confidence`` however long it runs, not that chance at each new pair. The hint's own
   setting runs, else (it too found slower) the fixed order: not the next candidate, which
   the replay that over-predicted the rejected setting predicted no faster. From then on
   each prediction (a refine round's) counts at its value times the replay's measured
   error on this job: the lowest ratio, over the settings found slower, of the A/B's
   measured speedup to its latest prediction. A drift (rule 4) forgets what was found
   slower, and so the error.
4. **Re-tune.** The median of the last ``window`` steps at the setting against the median
   of the steps at it before them (the latest ``reference`` of them): when it moved by
   more than ``drift_fraction`` and by more than ``drift_errors`` standard errors, on
   ``drift_hold`` steps in a row, then (once at least ``dwell`` steps passed since the
   last decision) the setting keeps running while the steps from the next block on are
   measured again, and the choice is made again on them.
"""

from __future__ import annotations

import bisect
import math
import statistics
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

from rrfp.core.ab_pairs import look_quantile, PairLogs

__all__ = ["Candidate", "Decision", "FIXED_ORDER", "OWN", "Predicted", "SettingTimes",
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
    confidence: float = 0.95
    min_pairs: int = 4
    window: int = 10
    reference: int = 2000
    drift_fraction: float = 0.10
    drift_errors: float = 3.0
    drift_hold: int = 5
    dwell: int = 30

    def __post_init__(self) -> None:
        for name in ("measure_steps", "ab_every", "ab_every_settled", "min_pairs", "window",
                     "drift_hold", "reference"):
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
        if self.reference < self.window:
            raise ValueError(f"TuningRules.reference ({self.reference}) must be at least "
                             f"window ({self.window}): a drift compares the window with them")
        if not 0.5 < self.confidence < 1:
            raise ValueError(f"TuningRules.confidence must be in (0.5, 1), got {self.confidence}")


class SettingTimes:
    """The times of the steps at the setting since a decision (the A/B's aside): the last
    ``window`` of them, and up to ``reference`` before those, kept sorted; a step costs
    the same however many ran before it."""

    def __init__(self, window: int, reference: int):
        self.recent: deque[float] = deque(maxlen=window)
        self._earlier: deque[float] = deque()
        self.earlier: list[float] = []
        """Sorted."""
        self._reference = reference

    def add(self, seconds: float) -> None:
        recent = self.recent
        if len(recent) == recent.maxlen:
            moved = recent[0]
            self._earlier.append(moved)
            bisect.insort(self.earlier, moved)
            if len(self._earlier) > self._reference:
                oldest = self._earlier.popleft()
                del self.earlier[bisect.bisect_left(self.earlier, oldest)]
        recent.append(seconds)

    def earlier_median(self) -> float:
        earlier, n = self.earlier, len(self.earlier)
        return earlier[n // 2] if n % 2 else (earlier[n // 2 - 1] + earlier[n // 2]) / 2


@dataclass
class _Since:
    """What the tuner saw since its last decision."""

    step: int
    pairs: PairLogs
    times: SettingTimes
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
        self._since = self._new_since(0)
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
        pairs = self._since.pairs.sums()
        return pairs.count >= self.rules.settle_pairs and pairs.mean() > 0

    def observe(self, run: StepRun, seconds: float) -> None:
        """The step that ran ``run`` (``next_run()``'s answer) took ``seconds``."""
        if not seconds >= 0:
            raise ValueError(f"a step's time must be a number of seconds >= 0, got {seconds!r}")
        since = self._since
        since.pairs.add(run.ab_fixed, seconds)
        if not run.ab_fixed:
            since.times.add(seconds)
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
        self._since = self._new_since(self.steps)

    def _new_since(self, step: int) -> _Since:
        return _Since(step, PairLogs(), SettingTimes(self.rules.window, self.rules.reference))

    def _falls_back(self) -> bool:
        """Fall back where the pairs since the decision say the setting is slower."""
        pairs = self._since.pairs.sums()
        count, rules = pairs.count, self.rules
        if count < max(2, rules.min_pairs):
            return False
        if pairs.upper_bound(look_quantile(rules.confidence, count, rules.min_pairs)) >= 0:
            return False
        measured = math.exp(pairs.mean())
        self._rejected[self.setting] = measured
        self._decide(self._plain(), "fall back", measured=measured)
        return True

    def _watch_drift(self) -> None:
        """Measure again where the steps at the setting drifted (see the rules)."""
        rules, since = self.rules, self._since
        earlier, last = since.times.earlier, since.times.recent
        if len(earlier) < rules.window:
            return
        reference = since.times.earlier_median()
        moved = abs(statistics.median(last) - reference)
        # the spread costs a pass over the earlier steps: only where the move is large
        strays = (moved > rules.drift_fraction * reference
                  and moved > rules.drift_errors * 1.2533 * _deviation(earlier)
                  * math.sqrt(1 / len(earlier) + 1 / len(last)))
        since.drifting = since.drifting + 1 if strays else 0
        since.drifted = since.drifted or since.drifting >= rules.drift_hold
        if since.drifted and self.steps - since.step >= rules.dwell:
            pairs = since.pairs.sums()
            measured = math.exp(pairs.mean()) if pairs.count else None
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
