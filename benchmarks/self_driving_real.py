"""Self-driving RRFP on real compute: the torchtitan documents job (CPU), alternating rounds.

    python -m benchmarks.self_driving_real          # writes results/self_driving_real.md

**Measured, real compute** (no emulated time): torchtitan 0.2.2's llama3 debug model on
whole documents of varying length (``train_configs/documents_cpu.toml``: 2 pipeline ranks
x 2 stages, Interleaved1F1B, microbatches each as long as their content), ``--steps``
steps per run by ``torchrun --nproc-per-node 2`` with one thread per process. Three runs
per round, in alternating order from round to round:

* *fixed*: RRFP's fixed policy (the hint's order, as torch's schedule would run it: torch's
  own schedules cannot take microbatches of different shapes);
* *default*: RRFP with every default (``buffer_limit="hint"``);
* *self-driving*: ``--rrfp.tune_within`` a byte budget per rank of the fixed schedule's
  peak activation bytes plus half (read off a first, untimed run's summary).

Each run's figure is the sum of its schedule step times (``rrfp step N: ... ms``, the lines
the job logs per step) over every step after the first: for the mode its measuring steps
and its in-run A/B's fixed-order steps count. The page lists every round, the ratios to
the fixed runs and the decisions the mode logged, or, where it made none, why (its
predictions start within the job's CPU share, ``rrfp.advise.cost.CPU_SHARE``, so on this
host's two busy cores the first comes minutes into the run). Where the mode decided, the
ratios over the steps from its first decision on are given too: the same steps of each
run (the data loader gives each run the same documents at each step).
"""

from __future__ import annotations

import argparse
import math
import os
import re
import statistics
import sys
import time

from benchmarks.pages import write_page
from benchmarks.titan_runs import run_job
from rrfp.testing.ab import in_alternating_order

CONFIG = "train_configs/documents_cpu.toml"
STEP_LINE = re.compile(r"rrfp step\s+(\d+)(?: \(fixed order\))?: (\d+) ms")
DECISION = re.compile(r"rrfp self-driving: (from step .*)")
FROM_STEP = re.compile(r"from step (\d+):")
WAITING = re.compile(r"rrfp self-driving: (predicting from steps .*)")
NAMES = ("fixed", "default", "self-driving")
"""The runs of a round, as the page's columns give them."""
FIXED_PEAK = re.compile(r"\(fixed schedule ([\d.]+) MiB\)")


def run(extra: tuple[str, ...], steps: int) -> str:
    """The console of one training run of the documents job with ``extra`` options."""
    dump = os.path.join("outputs", "self_driving_real")
    return run_job(dump, "--rrfp.trace_folder", "", "--rrfp.no-advise", *extra, steps=steps,
                   job=["-m", "torchtitan_ext.train", "--job.config_file", CONFIG,
                        "--job.dump_folder", dump, "--metrics.no-enable-tensorboard"])


def step_seconds(out: str, steps: int) -> dict[int, float]:
    """The schedule's time of each step 1..``steps`` (torchtitan counts from 1)."""
    times = {int(step): int(ms) / 1000 for step, ms in STEP_LINE.findall(out)}
    if sorted(times) != list(range(1, steps + 1)):
        raise RuntimeError(f"logged steps {sorted(times)}:\n{out[-3000:]}")
    return times


def first_decided(said: list[str]) -> int | None:
    """The torchtitan step from which the mode's first decision ran (its lines count the
    schedule's steps from 0), or None."""
    steps = [int(m.group(1)) for m in map(FROM_STEP.match, said) if m]
    return min(steps) + 1 if steps else None


def budget_of(out: str) -> str:
    """The fixed schedule's busiest rank's peak activation bytes plus half, in MiB."""
    peaks = [float(v) for v in FIXED_PEAK.findall(out)]
    if not peaks:
        raise RuntimeError(f"no peak activations in the summary:\n{out[-3000:]}")
    return f"{math.ceil(1.5 * max(peaks))}MiB"


def total(times: dict[int, float], start: int) -> float:
    """A run's seconds over its steps ``start`` on."""
    return sum(seconds for step, seconds in times.items() if step >= start)


def ratio(measured: dict[str, dict[int, float]], name: str, start: int,
          over: str = "fixed") -> float:
    """``over``'s seconds over ``name``'s, both from step ``start`` on (above 1: ``name``
    is faster)."""
    return total(measured[over], start) / total(measured[name], start)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=120)
    args = parser.parse_args(argv)
    started = time.time()
    budget = budget_of(run(("--rrfp.policy", "fixed"), 4))
    variants = dict(zip(NAMES, (("--rrfp.policy", "fixed"), (),
                                ("--rrfp.tune_within", budget))))
    rounds, loads, decisions = [], [], []
    for round_ in range(args.rounds):
        measured, load_before = {}, {}
        for name in in_alternating_order(list(variants), round_):
            load_before[name] = os.getloadavg()[0]
            out = run(variants[name], args.steps)
            measured[name] = step_seconds(out, args.steps)
            if name == "self-driving":
                decisions.append(DECISION.findall(out)
                                 or [f"(none: {w})" for w in WAITING.findall(out)[-1:]])
            print(f"round {round_ + 1} {name}: {total(measured[name], 2):.1f} s "
                  f"(load {load_before[name]:.1f})", flush=True)
        rounds.append(measured)
        loads.append(load_before)
    command = " ".join(["python -m benchmarks.self_driving_real",
                        *(sys.argv[1:] if argv is None else argv)])
    lines = page(rounds, loads, decisions, args.steps, budget, command,
                 (time.time() - started) / 60)
    print("wrote", write_page("self_driving_real.md", lines))


def page(rounds: list[dict[str, dict[int, float]]], loads: list[dict[str, float]],
         decisions: list[list[str]], steps: int, budget: str, command: str,
         minutes: float) -> list[str]:
    """The results page's lines."""
    decided = [first_decided(said) for said in decisions]
    lines = [
        "# Self-driving RRFP on real compute: the torchtitan documents job (CPU)", "",
        f"Regenerate with `{command}` ({minutes:.0f} min; the method: "
        "`benchmarks/self_driving_real.py`'s docstring). Budget "
        f"`--rrfp.tune_within {budget}` (the fixed schedule's peak plus half). Seconds: "
        f"the schedule's step times summed over steps 2-{steps}; in "
        "parentheses the 1-minute load average before the run; ratio: fixed / the run "
        "(above 1: faster); *decided*: the step from which the mode's first decision ran, "
        f"and the ratios over the steps from there to {steps} (the same steps of each "
        f"run). Machine: {os.cpu_count()} CPUs shared with other jobs.", "",
        "| round | fixed s | default s | self-driving s | default / fixed | "
        "self-driving / fixed | decided | from there: default / fixed | from there: "
        "self-driving / fixed | the mode's decisions |",
        "|---|---|---|---|---|---|---|---|---|---|"]
    for i, (measured, load, said, start) in enumerate(zip(rounds, loads, decisions, decided)):
        after = ([f"{ratio(measured, n, start):.3f}x" for n in ("default", "self-driving")]
                 if start else ["-", "-"])
        lines.append(
            f"| {i + 1} | "
            + " | ".join(f"{total(measured[n], 2):.1f} ({load[n]:.1f})" for n in NAMES)
            + f" | {ratio(measured, 'default', 2):.3f}x | "
            + f"{ratio(measured, 'self-driving', 2):.3f}x | {start or '-'} | {after[0]} | "
            + f"{after[1]} | " + ("<br>".join(said) or "(none: still measuring)") + " |")
    summary = {name: [ratio(r, a, 2, b) for r in rounds]
               for name, a, b in (("default / fixed", "default", "fixed"),
                                  ("self-driving / fixed", "self-driving", "fixed"),
                                  ("self-driving / default", "self-driving", "default"))}
    for name in ("default", "self-driving"):
        after = [ratio(r, name, start) for r, start in zip(rounds, decided) if start]
        if after:
            summary[f"{name} / fixed from the mode's first decision"] = after
    return lines + ["", *(f"Median ratio {name} over rounds: "
                          f"**{statistics.median(values):.3f}x** (min {min(values):.3f}x, "
                          f"max {max(values):.3f}x)." for name, values in summary.items())]


if __name__ == "__main__":
    main()
