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

**Many looks** (seeded pairs, no step times): 300 runs of 1,500 pairs each (a job at the
settled A/B rate for about 100k steps), each pair's log drawn normal or heavy-tailed
(Student's t, 3 degrees of freedom) around the log of a true speedup, at this job's
spread per pair (0.12); the bound looked at after every pair from the 4th, at 0.95 over
every look (``look_quantile``, the tuner's) and at 0.95 each look (``t_quantile``).
"""

from __future__ import annotations

import argparse
import json
import math
import random
import statistics

from benchmarks.pages import result_path, write_page
from rrfp.core.ab_pairs import LogSums, look_quantile, t_quantile
from rrfp.core.tuning import FIXED_ORDER, Tuner, TuningRules

SOURCE = "self_driving_real.json"
OFFSETS = 8
RULES = {"the default (min_pairs 4, confidence 0.95 over every look)": TuningRules(),
         "min_pairs 4, confidence 0.9": TuningRules(confidence=0.9),
         "min_pairs 4, confidence 0.99": TuningRules(confidence=0.99),
         "min_pairs 16, confidence 0.95": TuningRules(min_pairs=16)}
FACTORS = (0.96, 0.92)
LOOKS = 1500
SPREAD = 0.12
"""The standard deviation of a pair's log on the documents job (0.10-0.14 by round over
its runs so far)."""
DEFAULT = TuningRules()
OVER_LOOKS = {n: look_quantile(DEFAULT.confidence, n, DEFAULT.min_pairs)
              for n in range(2, LOOKS + 1)}
EACH_LOOK = {n: t_quantile(DEFAULT.confidence, n - 1) for n in range(2, LOOKS + 1)}


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


def first_look_below(logs: list[float], quantiles: dict[int, float],
                     first: int = DEFAULT.min_pairs) -> int | None:
    """The first count of pairs (at least ``first``) whose upper bound of the mean log, at
    ``quantiles[n]`` standard errors, is below 0 (None: none)."""
    sums = LogSums()
    for log in logs:
        sums = sums.plus(log)
        if sums.count >= first and sums.upper_bound(quantiles[sums.count]) < 0:
            return sums.count
    return None


def normal(rng: random.Random) -> float:
    return rng.gauss(0, 1)


def heavy_tailed(rng: random.Random) -> float:
    """Student's t with 3 degrees of freedom, scaled to variance 1."""
    chi = sum(rng.gauss(0, 1) ** 2 for _ in range(3)) / 3
    return rng.gauss(0, 1) / math.sqrt(chi) / math.sqrt(3)


def looks_below(speedup: float, draw, quantiles: dict[int, float], runs: int = 300,
                seed: int = 0) -> list[int | None]:
    """``first_look_below`` of ``runs`` seeded runs of ``LOOKS`` pairs."""
    rng = random.Random(seed)
    return [first_look_below([math.log(speedup) + SPREAD * draw(rng) for _ in range(LOOKS)],
                             quantiles) for _ in range(runs)]


def looks_row(name: str, quantiles: dict[int, float]) -> str:
    cells = [name]
    for speedup, draw in ((1.0, normal), (1.0, heavy_tailed), (0.96, normal),
                          (0.92, normal)):
        runs = looks_below(speedup, draw, quantiles)
        found = [n for n in runs if n is not None]
        cells.append(f"{100 * len(found) / len(runs):.1f}%"
                     + (f" (median pair {statistics.median(found):.0f})"
                        if found and speedup != 1.0 else ""))
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
    lines += [
        "", "## Many looks (seeded pairs)", "",
        f"300 seeded runs of {LOOKS} pairs (a job at the settled A/B rate for about 100k "
        f"steps), each pair's log around the log of the true speedup at a spread of "
        f"{SPREAD} (this job's), the bound looked at after every pair from the 4th. Cells: "
        "the runs whose bound fell below 0 (a fall-back); for a slower setting, the "
        "median pair it came at.", "",
        "| bound | as fast, normal pairs (false) | as fast, heavy-tailed pairs (false) | "
        "0.96x | 0.92x |", "|---|---|---|---|---|",
        looks_row("0.95 over every look (the tuner's)", OVER_LOOKS),
        looks_row("0.95 at each look", EACH_LOOK)]
    print("wrote", write_page("fall_back_rule.md", lines))


if __name__ == "__main__":
    main()
