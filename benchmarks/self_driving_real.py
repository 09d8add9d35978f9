"""Self-driving RRFP on real compute: the torchtitan documents job (CPU), alternating rounds.

    python -m benchmarks.self_driving_real     # writes results/self_driving_real.md and .json

**Measured, real compute** (no emulated time): torchtitan 0.2.2's llama3 debug model on
whole documents of varying length (``train_configs/documents_cpu.toml``: 2 pipeline ranks
x 2 stages, Interleaved1F1B, microbatches each as long as their content), ``--steps``
steps per run by ``torchrun --nproc-per-node 2`` with one thread per process. Three runs
per round, in alternating order from round to round:

* *fixed*: RRFP's fixed policy (the hint's order, as torch's schedule would run it: torch's
  own schedules cannot take microbatches of different shapes);
* *default*: RRFP with every default (``buffer_limit="hint"``) and its in-run A/B on every
  second step (``--rrfp.fixed_every 2``): each other step runs the fixed order;
* *self-driving*: ``--rrfp.tune_within`` a byte budget per rank of the fixed schedule's
  peak activation bytes plus half (read off a first, untimed run's summary).

A step's figure is its schedule step time (``rrfp step N: ... ms``, the lines the job
logs per step); step 1 is left out everywhere.

**Paired, within one run** (the page's first figures; the host's speed swings more from
minute to minute than the settings differ, and a pair's two steps run seconds apart):

* *default / fixed*: the in-run A/B's speedups of the default run (``ab_speedups``, the
  tuner's own: a fixed-order step against the mean of the default steps beside it), every
  second one so that no step is in two pairs; their geometric mean and its 95% interval
  (Student's t on the logs).
* *self-driving / fixed*: the mode's run cut where its decisions took effect; in each
  stretch running a setting other than the fixed order, the A/B's pairs give that
  setting's speedup (geometric mean, 95% interval), and each of its steps counts at its
  time times that speedup: what the fixed order would have taken. The estimate is that
  sum (fixed-order steps at their own time) over the run's time, its interval the
  stretches' interval ends. Stretches with fewer than 2 pairs count at speedup 1 and are
  named. What the pairs cannot see: the predictions' CPU (a process at ``nice 19``,
  within ``rrfp.advise.cost.CPU_SHARE`` of the host's CPU since the first step) slows the
  fixed-order steps beside the others alike; the whole-run figures below include it.

**Whole runs one after another** (second): the fixed run's time over the other run's, on
the same steps (the data loader gives each run the same documents at each step): for the
default, its steps that ran its own setting.

Each run's steps (step, whether the fixed order ran, ms), the mode's decisions and the load
before the run go to ``self_driving_real.json`` beside the page.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import statistics
import sys
import time
from dataclasses import dataclass

from benchmarks.pages import result_path, write_page
from benchmarks.titan_runs import run_job
from rrfp.core.ab_pairs import ab_speedups, upper_bound
from rrfp.core.tuning import FIXED_ORDER, OWN
from rrfp.testing.ab import in_alternating_order

CONFIG = "train_configs/documents_cpu.toml"
STEP_LINE = re.compile(r"rrfp step\s+(\d+)( \(fixed order\))?: (\d+) ms")
DECISION = re.compile(r"rrfp self-driving: (from step .*)")
FROM_STEP = re.compile(r"from step (\d+): (.*?)(?: \((\w[^()]*)\))?$")
WAITING = re.compile(r"rrfp self-driving: (predicting from steps .*)")
OUT_OF_HINT = re.compile(r"out-of-hint actions: (.*)")
NAMES = ("fixed", "default", "self-driving")
"""The runs of a round, as the page's columns give them."""
FIXED_PEAK = re.compile(r"\(fixed schedule ([\d.]+) MiB\)")
CONFIDENCE = 0.975
"""Each side of the page's 95% intervals."""
SAVED = "self_driving_real.json"
"""Every run's steps, decisions and load, beside the page."""

Steps = dict[int, tuple[bool, float]]
"""A run's steps: torchtitan's step (from 1) -> (ran the fixed order, seconds)."""


def run(extra: tuple[str, ...], steps: int) -> str:
    """The console of one training run of the documents job with ``extra`` options."""
    dump = os.path.join("outputs", "self_driving_real")
    return run_job(dump, "--rrfp.trace_folder", "", "--rrfp.no-advise", *extra, steps=steps,
                   job=["-m", "torchtitan_ext.train", "--job.config_file", CONFIG,
                        "--job.dump_folder", dump, "--metrics.no-enable-tensorboard"])


def steps_run(out: str, steps: int) -> Steps:
    """Each step 1..``steps`` of a run's console."""
    runs = {int(step): (bool(fixed), int(ms) / 1000)
            for step, fixed, ms in STEP_LINE.findall(out)}
    if sorted(runs) != list(range(1, steps + 1)):
        raise RuntimeError(f"logged steps {sorted(runs)}:\n{out[-3000:]}")
    return runs


def budget_of(out: str) -> str:
    """The fixed schedule's busiest rank's peak activation bytes plus half, in MiB."""
    peaks = [float(v) for v in FIXED_PEAK.findall(out)]
    if not peaks:
        raise RuntimeError(f"no peak activations in the summary:\n{out[-3000:]}")
    return f"{math.ceil(1.5 * max(peaks))}MiB"


@dataclass(frozen=True)
class Speedup:
    """A geometric mean of paired speedups (fixed-order time over the setting's: above 1,
    the setting is faster) and its 95% interval."""

    value: float
    low: float
    high: float
    pairs: int

    @staticmethod
    def of(ratios: list[float]) -> "Speedup | None":
        """Of the pairs' ``ratios`` (None: fewer than 2)."""
        if len(ratios) < 2:
            return None
        logs = [math.log(r) for r in ratios]
        mean, high = statistics.mean(logs), upper_bound(logs, CONFIDENCE)
        return Speedup(math.exp(mean), math.exp(2 * mean - high), math.exp(high), len(logs))

    def __str__(self) -> str:
        return f"{self.value:.3f}x [{self.low:.3f}-{self.high:.3f}] ({self.pairs} pairs)"


def default_pairs(runs: Steps) -> list[float]:
    """The default run's A/B speedups over the fixed order, every second one (with
    ``fixed_every 2`` a default step neighbours two fixed-order steps)."""
    return ab_speedups([runs[s] for s in sorted(runs) if s >= 2])[::2]


@dataclass(frozen=True)
class Stretch:
    """Steps of the mode's run under one decision."""

    first: int
    """The torchtitan step it starts at."""
    setting: str
    reason: str
    steps: int
    speedup: Speedup | None
    """Its A/B pairs' speedup (None: the fixed order, or fewer than 2 pairs)."""

    @property
    def fixed_order(self) -> bool:
        return self.setting == FIXED_ORDER.describe()


def stretches(runs: Steps, decisions: list[str]) -> list[Stretch]:
    """The mode's run cut where each decision took effect (its lines count steps from 0,
    torchtitan from 1); before the first, the hint's own setting measured."""
    cuts = [(2, OWN.describe(), "measure")]
    for line in decisions:
        match = FROM_STEP.match(line)
        if match is None:
            raise RuntimeError(f"a decision line this page cannot read: {line!r}")
        cuts.append((int(match.group(1)) + 1, match.group(2), match.group(3) or ""))
    ends = [first for first, _, _ in cuts[1:]] + [max(runs) + 1]
    out = []
    for (first, setting, reason), end in zip(cuts, ends):
        steps = [runs[s] for s in range(first, end)]
        pairs = [] if setting == FIXED_ORDER.describe() else ab_speedups(steps)
        out.append(Stretch(first, setting, reason, len(steps), Speedup.of(pairs)))
    return out


def paired_mode(runs: Steps, cut: list[Stretch]) -> tuple[float, float, float]:
    """The mode's run's estimated speedup over the fixed order, with its interval's ends:
    each step of a stretch at its time times the stretch's speedup (fixed-order steps, and
    stretches without pairs, at their own time) over the run's time."""
    spent = sum(seconds for step, (_, seconds) in runs.items() if step >= 2)
    estimates = []
    for pick in ("value", "low", "high"):
        fixed_equivalent = 0.0
        for stretch in cut:
            factor = getattr(stretch.speedup, pick) if stretch.speedup else 1.0
            for step in range(stretch.first, stretch.first + stretch.steps):
                fixed, seconds = runs[step]
                fixed_equivalent += seconds * (1.0 if fixed else factor)
        estimates.append(fixed_equivalent / spent)
    return estimates[0], estimates[1], estimates[2]


def whole_ratio(fixed: Steps, other: Steps, own_steps_only: bool = False) -> float:
    """The fixed run's seconds over ``other``'s on the same steps (from step 2; with
    ``own_steps_only``, the steps where ``other`` ran its own setting)."""
    steps = [s for s in other if s >= 2 and not (own_steps_only and other[s][0])]
    return sum(fixed[s][1] for s in steps) / sum(other[s][1] for s in steps)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=120)
    parser.add_argument("--page", action="store_true",
                        help="write the page again from self_driving_real.json, running nothing")
    args = parser.parse_args(argv)
    if not args.page:
        measure(args.rounds, args.steps, " ".join(
            ["python -m benchmarks.self_driving_real", *(sys.argv[1:] if argv is None else argv)]))
    with open(result_path(SAVED)) as f:
        saved = json.load(f)
    rounds = [{name: {**run_, "steps": {step: (bool(fixed), ms / 1000)
                                        for step, fixed, ms in run_["steps"]}}
               for name, run_ in measured.items()} for measured in saved["rounds"]]
    print("wrote", write_page("self_driving_real.md", page(rounds, saved)))


def measure(rounds: int, steps: int, command: str) -> None:
    """Run the rounds; save every run's steps, decisions and load as ``SAVED``."""
    started = time.time()
    budget = budget_of(run(("--rrfp.policy", "fixed"), 4))
    variants = dict(zip(NAMES, (("--rrfp.policy", "fixed"), ("--rrfp.fixed_every", "2"),
                                ("--rrfp.tune_within", budget))))
    measured_rounds = []
    for round_ in range(rounds):
        measured = {}
        for name in in_alternating_order(list(variants), round_):
            load = os.getloadavg()[0]
            out = run(variants[name], steps)
            measured[name] = {
                "load": load,
                "steps": [[step, int(fixed), round(seconds * 1000)]
                          for step, (fixed, seconds) in steps_run(out, steps).items()],
                "decisions": DECISION.findall(out), "waiting": WAITING.findall(out)[-1:],
                "out_of_hint": OUT_OF_HINT.findall(out)[-1:]}
            print(f"round {round_ + 1} {name}: "
                  f"{sum(ms for _, _, ms in measured[name]['steps']) / 1000:.1f} s "
                  f"(load {load:.1f})", flush=True)
        measured_rounds.append(measured)
    with open(result_path(SAVED), "w") as f:
        json.dump({"budget": budget, "steps": steps, "command": command,
                   "minutes": round((time.time() - started) / 60),
                   "rounds": measured_rounds}, f, separators=(",", ":"))


def page(rounds: list[dict[str, dict]], saved: dict) -> list[str]:
    """The results page's lines, of the ``rounds`` read from ``saved`` (``SAVED``)."""
    budget, steps = saved["budget"], saved["steps"]
    lines = [
        "# Self-driving RRFP on real compute: the torchtitan documents job (CPU)", "",
        f"Regenerate with `{saved['command']}` ({saved['minutes']} min; the method: "
        "`benchmarks/self_driving_real.py`'s docstring; every run's steps: "
        "`self_driving_real.json`). Budget "
        f"`--rrfp.tune_within {budget}` (the fixed schedule's peak plus half). Steps 2-{steps} "
        "of each run. Above 1: faster than the fixed order. *Paired*: within one run, each "
        "fixed-order step against the steps beside it (95% intervals); *whole runs*: the "
        "fixed run against the other, on the same steps, one run after the other; *loads*: "
        "the 1-minute load average before each run. Machine: "
        f"{os.cpu_count()} CPUs shared with other jobs.", "",
        "| round | paired: default / fixed | paired: self-driving / fixed | whole runs: "
        "default / fixed | whole runs: self-driving / fixed | loads before fixed / default / "
        "self-driving | default: out-of-hint actions |",
        "|---|---|---|---|---|---|---|"]
    cuts = [stretches(measured["self-driving"]["steps"], measured["self-driving"]["decisions"])
            for measured in rounds]
    modes = []
    for i, (measured, cut) in enumerate(zip(rounds, cuts)):
        fixed, default, mode = (measured[n]["steps"] for n in NAMES)
        estimate = paired_mode(mode, cut)
        modes.append(estimate)
        loads = " / ".join(f"{measured[n]['load']:.1f}" for n in NAMES)
        lines.append(
            f"| {i + 1} | {Speedup.of(default_pairs(default)) or '-'} | {estimate[0]:.3f}x "
            f"[{estimate[1]:.3f}-{estimate[2]:.3f}] | "
            f"{whole_ratio(fixed, default, own_steps_only=True):.3f}x | "
            f"{whole_ratio(fixed, mode):.3f}x | {loads} | "
            f"{''.join(measured['default']['out_of_hint']) or '-'} |")
    pooled = Speedup.of([r for measured in rounds
                         for r in default_pairs(measured["default"]["steps"])])
    lines += ["", f"Paired, the rounds' pairs pooled: default / fixed **{pooled}**.",
              "Paired, self-driving / fixed: **"
              + ", ".join(f"{value:.3f}x" for value, _, _ in modes)
              + f"** (lowest interval end {min(low for _, low, _ in modes):.3f}x).", "",
              "## The mode's decisions, with each stretch's paired speedup", "",
              "| round | from step | setting | why | steps | paired speedup over the fixed "
              "order |", "|---|---|---|---|---|---|"]
    for i, (measured, cut) in enumerate(zip(rounds, cuts)):
        mode = measured["self-driving"]
        for stretch in cut:
            paired = ("(is the fixed order)" if stretch.fixed_order
                      else str(stretch.speedup or "fewer than 2 pairs: counted at 1"))
            lines.append(f"| {i + 1} | {stretch.first} | {stretch.setting} | "
                         f"{stretch.reason} | {stretch.steps} | {paired} |")
        if not mode["decisions"]:
            lines.append(f"| {i + 1} | - | (no decision: "
                         f"{''.join(mode['waiting']) or 'still measuring'}) | | | |")
    return lines


if __name__ == "__main__":
    main()
