"""The advisor inside a torchtitan run (both versions), on the rank that logs the loss.

* The verdict line (``rrfp.advise``: the timing variability, the best setting within a
  memory margin and the best that keeps the job's peak, each with its predicted speedup
  and bytes): at the end of the run, and once ``FIRST_VERDICT_AFTER`` steps after the
  first have run where the run is long enough for it to cost training little: where its
  CPU (``rrfp.advise.cost.prediction_cpu_seconds``) is at most ``CPU_SHARE`` of the CPU
  time the remaining steps have; else one line says that the verdict waits for the end. It is
  computed by ``python -m rrfp.advise -`` in a child process at the lowest CPU priority:
  training never waits for it, nor shares its interpreter (and its GIL) with it; its line
  is logged at the first metrics step after it is ready.
* With ``rrfp.fixed_every`` (the in-run A/B), each fixed-order step's measured speedup
  (its step time over the RRFP steps beside it).
* At the trainer's close, one summary block: steps, median step time, the measured A/B,
  mean idle fraction and out-of-hint actions per rank, peak activation bytes per rank
  against the fixed schedule's, the final verdict.
* Self-driving (``rrfp.tune_within``): each decision that took effect goes to TensorBoard
  as text (``rrfp/self_driving``; the schedule logs it to the console itself) and the
  summary lists them; the verdict is left out, in one line (its steps ran several
  settings: the advisor reads one setting's run, and the tuner chose by its predictions).

The verdict and the summary also go to TensorBoard as text (``rrfp/verdict``,
``rrfp/summary``), in the run folder torchtitan's TensorBoard writer uses.
"""

from __future__ import annotations

import bisect
import collections
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import rrfp
from rrfp import ScheduleRRFP, StepStats
from rrfp.advise import ab_speedups, child_environment, lower_priority
from rrfp.advise.cost import available_cores, CPU_SHARE, prediction_cpu_seconds
from rrfp.advise.report import MIN_STEPS, size, spread
from rrfp.core.ab_pairs import PairStream
from rrfp.core.hints import Hint
from rrfp.core.limits import fixed_peak_bytes, realized_peak_bytes
from torchtitan.tools.logging import logger

FIRST_VERDICT_AFTER = MIN_STEPS
"""Steps after the first (warm-up) one that the first verdict is predicted from."""
KEPT_STEPS = 20
"""The end-of-run verdict predicts from the last this-many steps."""
FINAL_TIMEOUT_S = 300.0
"""The most the trainer's close waits for the end-of-run verdict."""


SELF_DRIVING_NO_VERDICT = (
    "advisor: no verdict under rrfp.tune_within: its steps ran several settings, and the "
    "tuner chose among them by the same predictions (its decisions above)")
"""The summary's line in place of the verdict in a self-driving run."""


class AdvisorProcess:
    """``python -m rrfp.advise - --json`` in a child process reading the steps' trace
    events from a file as its standard input. The answer comes back in files: the training
    process only looks whether the child has exited, with no thread of its own.
    ``low_priority``: the child runs at the lowest CPU priority from its start (its
    start-up, mostly importing torch, included), for while training runs."""

    def __init__(self, source: str, steps: list[list[dict]], *, low_priority: bool):
        command = [sys.executable, "-m", "rrfp.advise", "-", "--json", "--source", source]
        self._folder = tempfile.TemporaryDirectory(prefix="rrfp-advise-")
        steps_path = os.path.join(self._folder.name, "steps.json")
        with open(steps_path, "w") as f:
            json.dump(steps, f)
        self._out = open(os.path.join(self._folder.name, "answer.json"), "w+")
        self._err = open(os.path.join(self._folder.name, "errors.txt"), "w+")
        with open(steps_path) as stdin:
            self._process = subprocess.Popen(command, stdin=stdin, stdout=self._out,
                                             stderr=self._err, text=True,
                                             env=child_environment())
        if low_priority:
            lower_priority(self._process.pid)
        self.answer: dict | None = None
        self.failure: str | None = None

    @property
    def pid(self) -> int:
        return self._process.pid

    def done(self, timeout: float = 0.0) -> bool:
        """Whether the child has exited (waiting up to ``timeout`` seconds); once it has,
        ``answer`` or ``failure`` is set."""
        try:
            self._process.wait(timeout)
        except subprocess.TimeoutExpired:
            return False
        if self.answer is None and self.failure is None:
            self._read_answer()
        return True

    def _read_answer(self) -> None:
        self._out.seek(0)
        self._err.seek(0)
        if self._process.returncode == 0:
            self.answer = json.loads(self._out.read())
        else:
            self.failure = (self._err.read().strip().splitlines()
                            or [f"exit status {self._process.returncode}"])[-1]
        self._out.close()
        self._err.close()
        self._folder.cleanup()

    def stop(self) -> None:
        if not self.done():
            self._process.kill()
            self.done(10.0)


class TextLog:
    """TensorBoard text beside torchtitan's scalars: a writer of its own in the folder of
    torchtitan's, found by its event file's name (``events.out.tfevents.<time>.<host>.
    <pid>...``: torchtitan keeps its writer in a private field)."""

    def __init__(self, tensorboard_folder: str | None):
        self._folder = tensorboard_folder
        self._writer = None

    def add(self, tag: str, text: str, step: int) -> None:
        if self._writer is None:
            folder = self._run_folder()
            if folder is None:
                return
            from torch.utils.tensorboard import SummaryWriter

            self._writer = SummaryWriter(folder)
        # Markdown: a line break needs two spaces; a block, a code block.
        self._writer.add_text(tag, "    " + text.replace("\n", "\n    "), step)
        self._writer.flush()

    def _run_folder(self) -> str | None:
        mine = f".{os.getpid()}."
        for folder, _, names in os.walk(self._folder or "/nonexistent"):
            if any(n.startswith("events.out.tfevents.") and mine in n for n in names):
                return folder
        return None

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()


@dataclass(frozen=True)
class StepRecord:
    """What the summary keeps of one step of the pipeline."""

    step: int
    fixed_order: bool
    step_time: float
    idle: dict[str, float]
    out_of_hint: dict[str, int]
    actions: dict[str, int]
    activation_bytes: dict[str, int | None]
    held: dict[str, int]
    """Per rank, the most microbatches of activations it held (counted every step)."""
    fixed_held: dict[str, int]
    """Per rank, what the hint's fixed order holds at its peak."""
    held_bytes: dict[str, int] = field(default_factory=dict)
    """Per rank, the most activation bytes the step's realized order held, at the bytes per
    microbatch metered so far (empty before every stage's are)."""
    fixed_held_bytes: dict[str, int] = field(default_factory=dict)
    """Per rank, what the hint's fixed order holds at its peak at those same bytes."""


class PairsSoFar:
    """``ab_speedups`` of the steps so far, kept as each step comes, so that a step costs
    the same however many ran before it (the console notes a pair at each fixed-order
    step of a run of any length)."""

    def __init__(self) -> None:
        self.ordered: list[float] = []
        """The pairs, in ascending order (the last fixed-order step's against the step
        before it only, until the step after it completes it)."""
        self._stream = PairStream()

    def add(self, fixed: bool, seconds: float) -> float | None:
        """The next step; the pair it made (None: none; the step after a fixed-order one
        completes that one's pair, which counts as made there only where the fixed-order
        step had no step before it)."""
        provisional = self._stream.tail
        completed = self._stream.add(fixed, seconds)
        self._replace(provisional, completed)
        self._replace(None, self._stream.tail)
        if self._stream.tail is not None:
            return self._stream.tail
        return completed if provisional is None else None

    def _replace(self, old: float | None, new: float | None) -> None:
        if old is not None:
            del self.ordered[bisect.bisect_left(self.ordered, old)]
        if new is not None:
            bisect.insort(self.ordered, new)


class RunAdvice:
    """The verdict, the A/B and the summary of one run (see the module)."""

    def __init__(self, schedule: ScheduleRRFP, *, source: str,
                 label: Callable[[StepStats], str], advise: bool, total_steps: int,
                 tensorboard_folder: str | None, tune_within: int | str | None = ""):
        """``source``: how the verdict names the run (its traces' folder, where written);
        ``label``: a rank's name in the lines (``StepStats -> str``); ``advise``: whether
        to predict (the ``rrfp.advise`` setting); ``total_steps``: the step the run ends
        at (torchtitan's ``training.steps``); ``tune_within``: the self-driving budget
        (``rrfp.tune_within``; empty: off). Self-driving, the steps run several settings,
        which the advisor's verdict cannot read as one run's: the tuner's decisions take
        its place (``SELF_DRIVING_NO_VERDICT``)."""
        self.self_driving = tune_within not in (None, "")
        self.tune_within = tune_within
        self.decisions: list[str] = []
        """The self-driving decisions that took effect, as the schedule says them."""
        advise = advise and not self.self_driving
        self.schedule, self.source, self.label, self.advise = schedule, source, label, advise
        self.total_steps = total_steps
        self.text = TextLog(tensorboard_folder)
        self.records: list[StepRecord] = []
        self.events: collections.deque[list[dict]] = collections.deque(maxlen=KEPT_STEPS)
        self.bytes_per_microbatch: dict[int, int] = {}
        self._fixed_peaks: tuple[Hint | None, tuple[tuple[int, int], ...], dict[int, int]] = \
            (None, (), {})
        """The hint and bytes per microbatch the fixed order's peak bytes per rank were
        counted at, and those peaks (they change only with the hint or a metered step's
        bytes)."""
        self.first_verdict: AdvisorProcess | None = None
        """Started once ``FIRST_VERDICT_AFTER`` steps after the first ran, where it fits."""
        self._pairs = PairsSoFar()
        """The in-run A/B's pairs of the steps after the first."""
        self.ab_note: str | None = None
        """The A/B pair the latest step completed, as its console line says it (None: none)."""
        self.bookkeeping_s = 0.0
        """Seconds this rank's main thread spent in ``add`` (what training pays)."""
        self.child_cpu_s = 0.0
        """CPU seconds the verdicts' child processes reported."""

    def add(self, step: int, gathered: list[StepStats]) -> dict[str, float]:
        """Keep the step (every rank's stats); note the A/B pair (``ab_note``) and log the
        verdict that became ready. Returns TensorBoard scalars."""
        start = time.perf_counter()
        try:
            return self._add(step, gathered)
        finally:
            self.bookkeeping_s += time.perf_counter() - start

    def _add(self, step: int, gathered: list[StepStats]) -> dict[str, float]:
        self.ab_note = None
        fixed = gathered[0].policy == "fixed"
        for s in gathered:
            for stage, nbytes in (s.activation_bytes_per_microbatch or {}).items():
                self.bytes_per_microbatch[stage] = nbytes
        self.records.append(StepRecord(
            step, fixed, max(s.step_time for s in gathered),
            {self.label(s): s.idle_fraction for s in gathered},
            {self.label(s): s.out_of_hint_order for s in gathered},
            {self.label(s): s.dispatched for s in gathered},
            {self.label(s): s.peak_activation_bytes for s in gathered},
            {self.label(s): s.peak_rank_in_flight for s in gathered},
            {self.label(s): s.hint_rank_peak for s in gathered}, *self._held_bytes(gathered)))
        if self.advise:
            self.events.append([e for s in gathered for e in s.chrome_trace_events()])
            if len(self.records) == FIRST_VERDICT_AFTER + 1:
                self._start_first_verdict(step)
        scalars = self._ab_pair()
        if self.self_driving:
            self._new_decisions(step)
        if self.first_verdict is not None and self.first_verdict.done():
            self._say_verdict(self.first_verdict, step,
                              f"from steps 2-{FIRST_VERDICT_AFTER + 1}")
            self.first_verdict = None
        return scalars

    def _held_bytes(self, gathered: list[StepStats]) -> tuple[dict[str, int], dict[str, int]]:
        """Per rank, the most activation bytes the step's realized order held, and the
        hint's fixed order would hold, at the bytes per microbatch metered so far (empty
        before every stage's are): the two compare within the step."""
        if not self.bytes_per_microbatch:
            return {}, {}
        hint = self.schedule.hint
        if len(self.bytes_per_microbatch) != hint.num_stages:
            return {}, {}
        at = tuple(sorted(self.bytes_per_microbatch.items()))
        if self._fixed_peaks[0] is not hint or self._fixed_peaks[1] != at:
            self._fixed_peaks = hint, at, fixed_peak_bytes(hint, self.bytes_per_microbatch)
        fixed = self._fixed_peaks[2]
        return ({self.label(s): realized_peak_bytes(hint, s.pp_rank, s.realized_order,
                                                    self.bytes_per_microbatch)
                 for s in gathered},
                {self.label(s): fixed[s.pp_rank] for s in gathered})

    def _start_first_verdict(self, step: int) -> None:
        steps_left = self.total_steps - step
        if steps_left <= 0:
            return  # the end of the run's verdict comes next
        needs = prediction_cpu_seconds(sum(sum(r.actions.values()) for r in self.records))
        cores = available_cores()
        has = steps_left * statistics.median(r.step_time for r in self.records[1:]) * cores
        if needs <= CPU_SHARE * has:
            self.first_verdict = AdvisorProcess(self.source, list(self.events), low_priority=True)
            return
        logger.info(f"rrfp: the verdict comes at the end of the run: predicting now would "
                    f"take about {needs:.0f} s of CPU, over {CPU_SHARE:.0%} of "
                    f"the {has:.0f} s the {steps_left} steps left have on {cores} cores")

    def _new_decisions(self, step: int) -> None:
        """Keep the self-driving decisions that took effect since the last step (the
        schedule logs each itself, ``rrfp self-driving: ...``, on every rank), and write
        them to TensorBoard as text (``rrfp/self_driving``)."""
        new = self.schedule.tuning_decisions[len(self.decisions):]
        self.decisions += new
        for line in new:
            self.text.add("rrfp/self_driving", line, step)

    def _ab_pair(self) -> dict[str, float]:
        """The in-run A/B's pair the latest step made (a fixed-order step's against the
        step before it; ``ab_note`` says it for the step's console line)."""
        if len(self.records) < 2:
            return {}
        latest = self.records[-1]
        pair = self._pairs.add(latest.fixed_order, latest.step_time)
        if pair is None:
            return {}
        self.ab_note = (f"A/B fixed order / RRFP step time {pair:.3f}x, so far "
                        f"{spread(self._pairs.ordered)} over {len(self._pairs.ordered)} pairs")
        return {"rrfp/ab_speedup": pair}

    def _say_verdict(self, process: AdvisorProcess, step: int, when: str) -> str:
        line = self._verdict_of(process, step)
        logger.info(f"{line} ({when})")
        return line

    def _verdict_of(self, process: AdvisorProcess, step: int) -> str:
        """The verdict line (to TensorBoard too); the end of run's is said in the summary."""
        if process.answer is not None:
            line = process.answer["verdict"]
            self.child_cpu_s += process.answer["cpu_seconds"]
        else:
            line = f"rrfp: no verdict ({process.failure})"
        self.text.add("rrfp/verdict", line, step)
        return line

    def _kept_actions(self) -> int:
        """Actions in the steps the end-of-run verdict predicts from, on every rank."""
        return sum(sum(r.actions.values()) for r in self.records[-len(self.events):])

    def finish(self) -> None:
        """At the trainer's close: the end-of-run verdict and the summary block (a first
        verdict not ready by then is dropped: the last one says more)."""
        if self.first_verdict is not None:
            self.first_verdict.stop()
        if not self.records:
            return
        verdict = None
        if self.advise and len(self.events) > 1:
            # Training is over: no need to yield the CPU.
            logger.info(f"rrfp: predicting the verdict from the last {len(self.events)} steps "
                        f"(about {prediction_cpu_seconds(self._kept_actions()):.0f} s of CPU)")
            final = AdvisorProcess(self.source, list(self.events), low_priority=False)
            if not final.done(FINAL_TIMEOUT_S):
                final.stop()
                final.failure = f"not ready within {FINAL_TIMEOUT_S:.0f} s"
            verdict = self._verdict_of(final, self.records[-1].step)
        lines = self.summary(verdict)
        logger.info("\n".join(lines))
        self.text.add("rrfp/summary", "\n".join(lines), self.records[-1].step)
        self.text.close()

    def summary(self, verdict: str | None) -> list[str]:
        steps = self.records[1:] or self.records  # the first step warms up
        own = [r for r in steps if not r.fixed_order] or steps
        hint = self.schedule.hint
        lines = [f"rrfp summary: {len(self.records)} steps, hint {hint.name}, policy "
                 f"{self.schedule.policy}; step time {statistics.median(r.step_time for r in own) * 1e3:.1f} ms "
                 f"(median of steps {own[0].step}-{own[-1].step}"
                 + (", RRFP steps)" if len(own) < len(steps) else ")")]
        lines += self._decision_lines()
        lines += ab_lines(steps)
        labels = list(own[0].idle)
        lines.append("  mean idle: " + ", ".join(
            f"{k} {statistics.mean(r.idle[k] for r in own):.0%}" for k in labels))
        lines.append("  out-of-hint actions: " + ", ".join(
            f"{k} {sum(r.out_of_hint[k] for r in own)} of {sum(r.actions[k] for r in own)}"
            for k in labels))
        lines.append("  microbatches held (every step): " + held_line(self.records, labels))
        lines.append("  peak activations: " + peaks_line(self.records, labels))
        lines.append(f"  advisor cost: {self.bookkeeping_s / len(self.records) * 1e3:.1f} ms per "
                     f"step on this rank's main thread; {self.child_cpu_s:.1f} s of CPU in its "
                     "verdicts' child processes")
        if verdict is not None:
            lines.append(f"  {verdict}")
        elif self.self_driving:
            lines.append(f"  {SELF_DRIVING_NO_VERDICT}")
        return lines

    def _decision_lines(self) -> list[str]:
        """Self-driving: the budget and each decision that took effect, in order."""
        if not self.self_driving:
            return []
        if not self.decisions:
            waiting = self.schedule.tuning_waiting
            why = ("the hint's own setting ran while the tuner measured it" if waiting is None
                   else f"the latest {waiting}")
            return [f"  self-driving within tune_within={self.tune_within!r}: no decision took "
                    f"effect; {why}"]
        return [f"  self-driving within tune_within={self.tune_within!r}, the decisions that "
                "took effect (rrfp counts steps from 0, torchtitan from 1):",
                *(f"    {line}" for line in self.decisions)]

def peaks_line(records: list[StepRecord], labels: list[str]) -> str:
    """Per rank the most activation bytes held in any step (each step's realized order at
    the bytes per microbatch metered by then), against the most the fixed schedule holds
    at those bytes, naming the steps that held more than it would have at theirs; then
    what the meter measured itself, naming the steps it metered."""
    metered_steps = [r.step for r in records
                     if any(v is not None for v in r.activation_bytes.values())]
    if not metered_steps:
        return "not measured (rrfp.meter_activations off)"
    metered = {k: max((r.activation_bytes[k] for r in records
                       if r.activation_bytes[k] is not None), default=None) for k in labels}
    counted = [r for r in records if r.held_bytes]
    parts = []
    for k in labels:
        if not counted:
            parts.append(f"{k} -")
            continue
        more = [r.step for r in counted if r.held_bytes[k] > r.fixed_held_bytes[k]]
        fixed = max(r.fixed_held_bytes[k] for r in counted)
        parts.append(f"{k} {size(max(r.held_bytes[k] for r in counted))} (fixed schedule "
                     f"{size(fixed)}" + (f"; more in step{steps_named(more)})" if more else ")"))
    every = (" (in step" + steps_named([r.step for r in counted]) + ": the microbatches "
             "each held, at the bytes per microbatch metered)" if counted else "")
    return (", ".join(parts) + every + "; metered in step" + steps_named(metered_steps)
            + ": " + ", ".join(f"{k} {'-' if metered[k] is None else size(metered[k])}"
                               for k in labels))


def steps_named(steps: list[int]) -> str:
    """``s 2, 3, 7`` or `` 1`` (after the word step), runs of more than two as ``2-9``."""
    runs: list[list[int]] = []
    for step in steps:
        if runs and step == runs[-1][-1] + 1:
            runs[-1].append(step)
        else:
            runs.append([step])
    named = [f"{r[0]}-{r[-1]}" if len(r) > 2 else ", ".join(map(str, r)) for r in runs]
    return ("s " if len(steps) > 1 else " ") + ", ".join(named)


def held_line(records: list[StepRecord], labels: list[str]) -> str:
    """Per rank the most microbatches held, against the fixed schedule's, naming the steps
    that held more."""
    parts = []
    for k in labels:
        fixed = max(r.fixed_held[k] for r in records)
        more = [r.step for r in records if r.held[k] > r.fixed_held[k]]
        parts.append(f"{k} at most {max(r.held[k] for r in records)} (fixed schedule {fixed}"
                     + (f"; more in step{steps_named(more)})" if more else ")"))
    return ", ".join(parts)


def ab_lines(steps: list[StepRecord]) -> list[str]:
    """What the in-run A/B measured and how sure it is: each fixed-order step against the
    RRFP steps beside it; the fixed-order steps train too, so the run's throughput counts
    them."""
    pairs = ab_speedups([(r.fixed_order, r.step_time) for r in steps])
    if not pairs:
        return []
    faster = sum(p > 1 for p in pairs)
    sure = ("RRFP faster in every pair" if faster == len(pairs) else
            "RRFP slower in every pair" if faster == 0 else
            f"RRFP faster in {faster} of {len(pairs)} pairs: no difference this run can show")
    fixed = [r for r in steps if r.fixed_order]
    return [f"  measured (in-run A/B, {len(fixed)} steps in the fixed order, each against the "
            f"RRFP steps beside it): fixed / RRFP step time {spread(pairs)} over "
            f"{len(pairs)} pairs; {sure}",
            f"  all steps, fixed-order ones included: median "
            f"{statistics.median(r.step_time for r in steps) * 1e3:.1f} ms"]
