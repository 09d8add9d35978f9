"""RRFP's defaults against torch's fixed schedules on real compute: torchtitan llama3 debug, CPU.

    python -m benchmarks.real_compute_ab            # writes results/real_compute_ab.md (6-12 min)
    python -m benchmarks.real_compute_ab --rounds 10 --no-busiest
                                    # the defaults only: results/real_compute_ab_defaults.md (~10 min)

**Measured, real compute** (no emulated time): torchtitan 0.2.2's llama3 debug model
(``train_configs/llama3_debug_cpu.toml``: 8 microbatches of 1 x 128 tokens, AdamW), trained
16 steps by ``torchrun --nproc-per-node 2 -m torchtitan_ext.train`` with one thread per
process (``OMP_NUM_THREADS=1``), in two pairs:

* PP 2 x 2 stages: the bare ``RRFP`` name (Interleaved1F1B hint, every default: policy,
  ``buffer_limit``, launch depth, the sampled activation meter) vs torch's
  ``Interleaved1F1B``;
* PP 2 x 1 stage: ``RRFP-1F1B`` vs torch's ``1F1B``;

and in each pair RRFP also with ``--rrfp.buffer_limit busiest`` (every rank may hold the
activation bytes the fixed schedule's busiest rank holds: the job's peak unchanged), to
decide whether the names should default to it.

Each run's figure is the median of torchtitan's logged tokens per second (``tps``, the
rank that logs: the last stage's) over steps 5-16 (the first steps include warm-up and
RRFP's metered first step). A round runs every pair's runs back to back, in
alternating order from round to round (A B C, then C B A), so that a change in the machine's
load falls on both; the page lists every round, its ratio and the 1-minute load average
before each run, and the median ratio over rounds. Traces off (``--rrfp.trace_folder ""``);
everything else as the config ships it.
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import time

from benchmarks.pages import write_page
from rrfp.testing.ab import in_alternating_order

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIG = "train_configs/llama3_debug_cpu.toml"
STEPS = 16
FIRST_TIMED_STEP = 5
PAIRS = (("PP 2 x 2 stages", "RRFP", "Interleaved1F1B"),
         ("PP 2 x 1 stage", "RRFP-1F1B", "1F1B"))
"""(placement, RRFP's name, torch's schedule it is compared with)."""
STEP_LINE = re.compile(r"step:\s*(\d+)\s.*?tps:\s*([\d,]+)")
ANSI = re.compile(r"\x1b\[[0-9;]*m")


BUSIEST = ("--rrfp.buffer_limit", "busiest")


def label(schedule: str, extra: tuple[str, ...]) -> str:
    return f"{schedule} busiest" if extra == BUSIEST else schedule


def run(schedule: str, extra: tuple[str, ...] = (), timeout: float = 300) -> dict[int, float]:
    """Tokens per second per step of one 16-step training run; ``extra``: more options."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2", "--standalone",
           "-m", "torchtitan_ext.train", "--job.config_file", CONFIG,
           "--parallelism.pipeline_parallel_schedule", schedule,
           "--training.steps", str(STEPS), "--rrfp.trace_folder", "",
           "--metrics.no-enable-tensorboard",
           "--job.dump_folder", os.path.join("outputs", "real_compute_ab"), *extra]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1",
           "PYTHONPATH": os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")]))}
    env.pop("LOG_RANK", None)
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=timeout)
    out = ANSI.sub("", done.stdout + done.stderr)
    if done.returncode != 0:
        raise RuntimeError(f"{schedule} run failed ({done.returncode}):\n{out[-3000:]}")
    tps = {int(step): float(value.replace(",", "")) for step, value in STEP_LINE.findall(out)}
    if sorted(tps) != list(range(1, STEPS + 1)):
        raise RuntimeError(f"{schedule}: logged steps {sorted(tps)}:\n{out[-3000:]}")
    return tps


def median_tps(tps: dict[int, float]) -> float:
    return statistics.median(tps[s] for s in range(FIRST_TIMED_STEP, STEPS + 1))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--busiest", action=argparse.BooleanOptionalAction, default=True,
                        help="also run RRFP at buffer_limit='busiest' (default: on)")
    args = parser.parse_args(argv)
    started = time.time()
    rows: dict[str, list[dict[str, tuple[float, float]]]] = {p[0]: [] for p in PAIRS}
    for round_ in range(args.rounds):
        for placement, ours, theirs in PAIRS:
            runs = [(ours, ()), (ours, BUSIEST), (theirs, ())] if args.busiest else [
                (ours, ()), (theirs, ())]
            measured = {}
            for schedule, extra in in_alternating_order(runs, round_):
                load = os.getloadavg()[0]
                name = label(schedule, extra)
                measured[name] = (median_tps(run(schedule, extra)), load)
                print(f"round {round_ + 1} {placement} {name}: {measured[name][0]:.0f} "
                      f"tokens/s (load {load:.1f})", flush=True)
            rows[placement].append(measured)
    lines = [
        "# RRFP's defaults vs torch's fixed schedules, real compute (torchtitan llama3 debug, CPU)",
        "",
        f"Regenerate with `python -m benchmarks.real_compute_ab --rounds {args.rounds}"
        f"{'' if args.busiest else ' --no-busiest'}` (the module docstring has the "
        f"method). Median tokens/s of steps {FIRST_TIMED_STEP}-{STEPS} per run, "
        f"{args.rounds} alternating rounds, 2 processes x 1 thread; machine: "
        f"{os.cpu_count()} CPUs shared with other jobs (in parentheses: the 1-minute load "
        "average before the run).",
        "",
    ]
    for placement, ours, theirs in PAIRS:
        names = [ours, label(ours, BUSIEST), theirs] if args.busiest else [ours, theirs]
        lines += [f"## {placement}: `{ours}` vs `{theirs}`", "",
                  "| round | " + " | ".join(f"{n} tokens/s" for n in names)
                  + "".join(f" | {n} / {theirs}" for n in names[:-1]) + " |",
                  "|---" * (2 * len(names)) + "|"]
        ratios: dict[str, list[float]] = {n: [] for n in names[:-1]}
        for i, measured in enumerate(rows[placement], 1):
            for name in ratios:
                ratios[name].append(measured[name][0] / measured[theirs][0])
            lines.append(f"| {i} | " + " | ".join(
                f"{measured[n][0]:.0f} ({measured[n][1]:.1f})" for n in names) + " | "
                + " | ".join(f"{ratios[n][-1]:.3f}x" for n in ratios) + " |")
        lines.append("")
        for name, values in ratios.items():
            lines.append(f"Median ratio `{name}` / `{theirs}` over rounds: "
                         f"**{statistics.median(values):.3f}x** (min {min(values):.3f}x, "
                         f"max {max(values):.3f}x).")
        lines.append("")
    lines.append(f"({time.time() - started:.0f} s.)")
    page = "real_compute_ab.md" if args.busiest else "real_compute_ab_defaults.md"
    print(f"wrote {write_page(page, lines)}")


if __name__ == "__main__":
    main()
