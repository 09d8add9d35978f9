"""The tuner's fall-back rule on real step times: how often it rejects a setting as fast as
the fixed order, and how soon it finds one that is slower.

    python -m benchmarks.fall_back_rule     # writes results/fall_back_rule.md

**Measured step times, replayed through the tuner** (no job runs): the steps of the
fixed and the default runs of ``self_driving_real.json`` (the torchtitan documents job on
2 CPU processes; the default ran no action out of the hint's order, so both runs are one
setting's). Each run's steps from step 2 on drive a ``rrfp.core.tuning.Tuner`` that is
never handed a prediction (the hint's own setting runs, checked by the in-run A/B, as in
a job before its first prediction): the step the tuner asks for at index ``i`` takes the
run's ``i + offset``-th time, for 8 offsets per run (the A/B's steps fall on other steps
of the same run). *A/A*: every step at its own time, so a fall-back is a false one.
*Slower*: the steps at the setting take their time over a factor (0.96, 0.92), the A/B's
at their own: a fall-back is right, and the table gives the step it came at.
"""

from __future__ import annotations

import argparse
import json
import statistics

from benchmarks.pages import result_path, write_page
from rrfp.core.tuning import FIXED_ORDER, Tuner, TuningRules

SOURCE = "self_driving_real.json"
OFFSETS = 8
RULES = {"the default (min_pairs 4, confidence 0.95 over every look)": TuningRules(),
         "min_pairs 4, confidence 0.9": TuningRules(confidence=0.9),
         "min_pairs 4, confidence 0.99": TuningRules(confidence=0.99),
         "min_pairs 16, confidence 0.95": TuningRules(min_pairs=16)}
FACTORS = (0.96, 0.92)


def runs_of(saved: dict) -> list[list[float]]:
    """Each fixed and default run's step times from step 2 on."""
    return [[ms / 1000 for step, _, ms in measured[name]["steps"] if step >= 2]
            for measured in saved["rounds"] for name in ("fixed", "default")]


def fall_back_step(times: list[float], offset: int, factor: float,
                   rules: TuningRules) -> int | None:
    """The step at which a tuner, its setting ``factor`` times as fast as the fixed order
    on these times, fell back (None: it did not)."""
    tuner = Tuner(rules)
    for i in range(len(times) - offset):
        run = tuner.next_run()
        seconds = times[i + offset]
        tuner.observe(run, seconds if run.ab_fixed else seconds / factor)
        if tuner.decisions[-1].setting == FIXED_ORDER:
            return tuner.decisions[-1].step
    return None


def row(name: str, rules: TuningRules, runs: list[list[float]]) -> str:
    cells = [name]
    for factor in (1.0, *FACTORS):
        steps = [fall_back_step(times, offset, factor, rules)
                 for times in runs for offset in range(OFFSETS)]
        found = [s for s in steps if s is not None]
        cells.append(f"{len(found)} of {len(steps)}"
                     + (f" (median step {statistics.median(found):.0f})"
                        if found and factor != 1.0 else ""))
    return "| " + " | ".join(cells) + " |"


def main(argv: list[str] | None = None) -> None:
    argparse.ArgumentParser(description=__doc__.split("\n")[0]).parse_args(argv)
    with open(result_path(SOURCE)) as f:
        saved = json.load(f)
    runs = runs_of(saved)
    lines = [
        "# The fall-back rule on real step times (the documents job, CPU)", "",
        "Regenerate with `python -m benchmarks.fall_back_rule` (the method: "
        "`benchmarks/fall_back_rule.py`'s docstring) from the runs of "
        f"`{SOURCE}` (`{saved['command']}`): {len(runs)} runs of "
        f"{min(map(len, runs))} steps, {OFFSETS} offsets each. A tuner that is never handed "
        "a prediction runs the hint's own setting, checked by the in-run A/B "
        "(`TuningRules.ab_every`, then `ab_every_settled` once its pairs measured it "
        "faster), until it falls back. Cells: the runs that fell back; for a slower "
        "setting, the median step it did.", "",
        "| rule | as fast as the fixed order: fell back (false) | "
        + " | ".join(f"{f}x the fixed order: fell back" for f in FACTORS) + " |",
        "|---|---|" + "---|" * len(FACTORS)]
    lines += [row(name, rules, runs) for name, rules in RULES.items()]
    print("wrote", write_page("fall_back_rule.md", lines))


if __name__ == "__main__":
    main()
