"""What the advisor says: the ranked table, the one-line verdict, the measured A/B."""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field

from rrfp.advise.measured import MeasuredRun
from rrfp.advise.predict import Prediction, predictions, Replay, variability
from rrfp.core.limits import fixed_peak_bytes
from rrfp.core.text import counted
from rrfp.core.ab_pairs import ab_speedups

MIN_STEPS = 3
"""Fewer measured training steps than this are too few to predict from."""
MIN_VARIABILITY = 0.01
"""Action times that vary less than this leave RRFP nothing to reorder."""
DEFAULT_MARGIN = 0.25
"""The verdict's memory margin: this fraction of the fixed schedule's busiest rank's
activation bytes on top of them."""
NOTABLE = 1.01
"""A predicted speedup below this is no gain worth a setting."""


def spread(values: Sequence[float]) -> str:
    """``median [min-max]`` of speedups."""
    return f"{statistics.median(values):.2f}x [{min(values):.2f}-{max(values):.2f}]"


def size(nbytes: float) -> str:
    """Bytes in the largest binary unit below them (``38.0 MiB``, ``2.5 KiB``)."""
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if abs(nbytes) >= scale:
            value = nbytes / scale
            return f"{value:.1f} {unit}" if abs(value) < 100 else f"{value:.0f} {unit}"
    return f"{nbytes:.0f} B"


@dataclass(frozen=True)
class Advice:
    """The run, each setting's prediction (best first) and what to say about them."""

    run: MeasuredRun
    source: str
    """How to name the run to a reader (the folder to pass to ``python -m rrfp.advise``)."""
    baseline: Replay
    rows: list[Prediction]
    variability: float
    margin: float = DEFAULT_MARGIN
    notes: list[str] = field(default_factory=list)

    @property
    def own_speedup(self) -> float:
        """The run's own setting's predicted speedup over the fixed schedule."""
        return statistics.median(f / o for f, o in zip(self.baseline.fixed, self.baseline.own))

    @property
    def measured_ab(self) -> list[float]:
        return ab_speedups([(s.fixed_order, s.step_time) for s in self.run.steps])

    @property
    def too_few(self) -> bool:
        return len(self.run.steps) < MIN_STEPS

    def warnings(self) -> list[str]:
        said = []
        if self.too_few:
            said.append(f"only {counted(len(self.run.steps), 'measured training step')} after the "
                        f"first: too few to predict from ({MIN_STEPS} or more: run more "
                        "steps with traces on)")
        if self.variability < MIN_VARIABILITY:
            said.append(f"the measured timings vary by {self.variability:.1%}: too alike for "
                        "any order to gain; expect about 1.00x everywhere")
        if any(row.even_split for row in self.rows):
            said.append("hints that split backward (I/W) are predicted from whole measured "
                        "backwards cut into two equal halves (marked ~; left out of the "
                        "verdict)")
        return said

    @property
    def fixed_peak(self) -> int | None:
        """The fixed schedule's busiest rank's activation bytes (None: not measured)."""
        per_microbatch = self.run.bytes_per_microbatch
        if per_microbatch is None:
            return None
        return max(fixed_peak_bytes(self.run.hint, per_microbatch).values())

    def best(self, most_extra: float | None) -> Prediction | None:
        """The best setting whose job peak grows by at most ``most_extra`` bytes (None:
        any), leaving out the guesses of ``even_split``."""
        for row in self.rows:
            grows = row.job_peak_extra
            if not row.even_split and (most_extra is None or grows is None
                                       or grows <= most_extra):
                return row
        return None

    def verdict(self) -> str:
        """One line: the variability; the best setting within the margin and the best that
        keeps the job's peak; this run's own; the measured A/B where there is one. Too few
        steps: that alone (and the A/B), no figure predicted from them."""
        if self.too_few:
            said = [f"rrfp: only {counted(len(self.run.steps), 'measured step')} after the first: "
                    f"too few to predict ({MIN_STEPS} or more)"]
            if self.measured_ab:
                said.append(f"measured {statistics.median(self.measured_ab):.2f}x by the "
                            "in-run A/B")
            return "; ".join(said) + f"; python -m rrfp.advise {self.source}"
        said = [f"rrfp: timing variability {self.variability:.0%}"]
        peak = self.fixed_peak
        within = "" if peak is None else f" within +{self.margin:.0%} of the activation peak"
        best = self.best(None if peak is None else self.margin * peak)
        flat = self.best(None if peak is None else 0)
        if best is None or best.speedup < NOTABLE:
            said.append(f"no setting{within} predicts {NOTABLE:.2f}x or more"
                        + self._left_out(best))
        else:
            said.append(f"{self._named(best)} predicts {best.speedup:.2f}x")
            if flat is not None and flat is not best:
                said.append(f"{self._named(flat)} {flat.speedup:.2f}x")
        own = f"this run ({self._own_setting()}) {self.own_speedup:.2f}x"
        if self.measured_ab:
            own += f", measured {statistics.median(self.measured_ab):.2f}x by the in-run A/B"
        said.append(own)
        return "; ".join(said) + f"; python -m rrfp.advise {self.source}"

    def _left_out(self, best: Prediction | None) -> str:
        """Why the table's top row, where it predicts a gain, is not the verdict's: it
        grows the peak beyond the margin, or it is a guess from halved backwards (~)."""
        top = self.rows[0] if self.rows else None
        if top is None or top is best or top.speedup < NOTABLE:
            return ""
        why = ("a guess from halved backwards, marked ~" if top.even_split
               else f"beyond the margin: {self._growth(top)}")
        return f" (the table's top row, {top.speedup:.2f}x, is {why})"

    def _own_setting(self) -> str:
        return f"buffer_limit={self.run.buffer_limit!r}, policy {self.run.policy}"

    def _named(self, row: Prediction) -> str:
        """The setting, and where it grows the job's peak activation bytes."""
        return f"{row.setting.describe(self.run.hint.name)} ({self._growth(row)})"

    @staticmethod
    def _growth(row: Prediction) -> str:
        allowed, grows = row.allowed_bytes, row.job_peak_extra
        if allowed is None or grows is None:
            return "bytes not measured"
        if grows <= 0:
            return "no peak change"
        rank = max(allowed, key=lambda r: allowed[r])
        return f"+{size(grows)} peak, rank {rank}"

    def table(self, rows: int | None = None) -> list[str]:
        """The report: the run, how well the simulator replays it, each setting ranked
        (the best ``rows`` of them; None: all)."""
        run = self.run
        own_times = [s.step_time for s in run.own_steps]
        replayed = statistics.median(self.baseline.own)
        lines = [
            f"run: {self.source}: {len(run.steps)} training steps (schedule steps "
            f"{run.steps[0].number}-{run.steps[-1].number}; {run.left_out} left out: the "
            f"first and forward-only), hint {run.hint.name} ({run.hint.layout} placement, "
            f"{counted(run.hint.num_ranks, 'rank')} x "
            f"{counted(run.hint.num_stages // run.hint.num_ranks, 'stage')}), "
            f"{counted(run.hint.n_microbatches, 'microbatch')}, buffer_limit={run.buffer_limit!r}, "
            f"policy {run.policy}, {run.device}",
            f"measured: step {statistics.median(own_times) * 1e3:.1f} ms (median), timing "
            f"variability {self.variability:.1%}; the simulator replays the run's steps at "
            f"{replayed * 1e3:.1f} ms (median)",
            f"predicted speedup of the run's own setting over the fixed schedule: "
            f"{self.own_speedup:.3f}x",
        ]
        if self.measured_ab:
            lines.append(f"measured by the in-run A/B (fixed order every k-th step): "
                         f"{spread(self.measured_ab)} over {len(self.measured_ab)} pairs")
        if run.bytes_per_microbatch is not None:
            lines.append("bytes per microbatch per stage: " + ", ".join(
                f"{s}: {size(b)}" for s, b in run.bytes_per_microbatch.items()))
        lines += [f"note: {n}" for n in [*self.notes, *self.warnings()]]
        lines += ["", f"{'setting':<58} {'policy':<10} {'step ms':>8} "
                      f"{'speedup [steps]':<20} {'busiest rank':>13} {'extra per rank'}"]
        shown = self.rows if rows is None else self.rows[:rows]
        lines += [self._row(row) for row in shown]
        if len(shown) < len(self.rows):
            lines.append(f"({len(self.rows) - len(shown)} more settings, each predicting "
                         f"{self.rows[len(shown)].speedup:.2f}x or less)")
        return lines

    def _row(self, row: Prediction) -> str:
        name = row.setting.describe(self.run.hint.name) + (" ~" if row.even_split else "")
        if row.allowed_bytes is None:
            memory, extra = "-", "bytes not measured"
        else:
            memory = size(max(row.allowed_bytes.values()))
            extra = ", ".join(f"r{r} {'+' if e >= 0 else ''}{size(e)}"
                              for r, e in row.extra_bytes.items())  # type: ignore[union-attr]
        return (f"{name:<58} {row.policy:<10} {row.step_time * 1e3:>8.1f} "
                f"{spread(row.speedups):<20} {memory:>13} {extra}")

    def as_json(self) -> dict:
        return {
            "verdict": self.verdict(),
            "own_speedup": self.own_speedup,
            "measured_ab": self.measured_ab,
            "variability": self.variability,
            "steps": len(self.run.steps),
            "rows": [{"setting": r.setting.describe(self.run.hint.name), "policy": r.policy,
                      "speedup": r.speedup, "speedups": list(r.speedups),
                      "step_time": r.step_time,
                      "allowed_bytes": r.allowed_bytes, "peak_bytes": r.peak_bytes,
                      "fixed_bytes": r.fixed_bytes} for r in self.rows],
        }


def advise(run: MeasuredRun, source: str, *, margin: float = DEFAULT_MARGIN,
           notes: Sequence[str] = ()) -> Advice:
    baseline, rows = predictions(run)
    return Advice(run, source, baseline, rows, variability(run), margin, list(notes))
