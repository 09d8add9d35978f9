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
predictions start within the job's CPU share, ``rrfp.advise.cost.CPU_SHARE``).
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
WAITING = re.compile(r"rrfp self-driving: (predicting from steps .*)")
FIXED_PEAK = re.compile(r"\(fixed schedule ([\d.]+) MiB\)")


def run(extra: tuple[str, ...], steps: int) -> str:
    """The console of one training run of the documents job with ``extra`` options."""
    dump = os.path.join("outputs", "self_driving_real")
    return run_job(dump, "--rrfp.trace_folder", "", "--rrfp.no-advise", *extra, steps=steps,
                   job=["-m", "torchtitan_ext.train", "--job.config_file", CONFIG,
                        "--job.dump_folder", dump, "--metrics.no-enable-tensorboard"])


def seconds(out: str, steps: int) -> float:
    """The schedule's step times summed over steps 2..``steps`` (torchtitan counts from 1)."""
    times = {int(step): int(ms) / 1000 for step, ms in STEP_LINE.findall(out)}
    if sorted(times) != list(range(1, steps + 1)):
        raise RuntimeError(f"logged steps {sorted(times)}:\n{out[-3000:]}")
    return sum(times[s] for s in range(2, steps + 1))


def budget_of(out: str) -> str:
    """The fixed schedule's busiest rank's peak activation bytes plus half, in MiB."""
    peaks = [float(v) for v in FIXED_PEAK.findall(out)]
    if not peaks:
        raise RuntimeError(f"no peak activations in the summary:\n{out[-3000:]}")
    return f"{math.ceil(1.5 * max(peaks))}MiB"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=120)
    args = parser.parse_args(argv)
    started = time.time()
    budget = budget_of(run(("--rrfp.policy", "fixed"), 4))
    variants = {"fixed": ("--rrfp.policy", "fixed"), "default": (),
                "self-driving": ("--rrfp.tune_within", budget)}
    rounds, decisions = [], []
    for round_ in range(args.rounds):
        measured = {}
        for name in in_alternating_order(list(variants), round_):
            load = os.getloadavg()[0]
            out = run(variants[name], args.steps)
            measured[name] = (seconds(out, args.steps), load)
            if name == "self-driving":
                decisions.append(DECISION.findall(out)
                                 or [f"(none: {w})" for w in WAITING.findall(out)[-1:]])
            print(f"round {round_ + 1} {name}: {measured[name][0]:.1f} s (load {load:.1f})",
                  flush=True)
        rounds.append(measured)
    ratio = {name: [r["fixed"][0] / r[name][0] for r in rounds]
             for name in ("default", "self-driving")}
    command = " ".join(["python -m benchmarks.self_driving_real",
                        *(sys.argv[1:] if argv is None else argv)])
    lines = [
        "# Self-driving RRFP on real compute: the torchtitan documents job (CPU)", "",
        f"Regenerate with `{command}` ({(time.time() - started) / 60:.0f} min; the method: "
        "`benchmarks/self_driving_real.py`'s docstring). Budget "
        f"`--rrfp.tune_within {budget}` (the fixed schedule's peak plus half). Seconds: the "
        f"schedule's step times summed over steps 2-{args.steps}; in parentheses the "
        "1-minute load average before the run; ratio: fixed / the run (above 1: faster). "
        f"Machine: {os.cpu_count()} CPUs shared with other jobs.", "",
        "| round | fixed s | default s | self-driving s | default / fixed | "
        "self-driving / fixed | the mode's decisions |", "|---|---|---|---|---|---|---|"]
    for i, (measured, said) in enumerate(zip(rounds, decisions), start=1):
        lines.append(
            f"| {i} | " + " | ".join(f"{measured[n][0]:.1f} ({measured[n][1]:.1f})"
                                     for n in variants)
            + f" | {ratio['default'][i - 1]:.3f}x | {ratio['self-driving'][i - 1]:.3f}x | "
            + ("<br>".join(said) or "(none: still measuring)") + " |")
    ratio["self-driving / default"] = [r["default"][0] / r["self-driving"][0] for r in rounds]
    lines += ["", *(f"Median ratio {name}{'' if '/' in name else ' / fixed'} over rounds: "
                    f"**{statistics.median(values):.3f}x** (min {min(values):.3f}x, max "
                    f"{max(values):.3f}x)." for name, values in ratio.items())]
    print("wrote", write_page("self_driving_real.md", lines))


if __name__ == "__main__":
    main()
