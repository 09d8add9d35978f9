"""Activation checkpointing and RRFP's byte limits: torchtitan llama3 debug, CPU.

    python -m benchmarks.ac_bytes_bench      # results/ac_bytes_<torchtitan>.md

For each of torchtitan's activation checkpointing modes (0.2.2: ``none``, ``selective``
(every second layer), ``selective`` per op, ``full``; 0.3: ``none``, ``selective`` (per
op), ``full``), the main job (PP 2 x 2 stages, the Interleaved1F1B hint, 8 microbatches)
trains ``--steps`` steps at the default with traces. From its traces: the bytes one
microbatch saves per stage (the byte meter, first training step), what the fixed
schedule's busiest rank holds, the microbatch limits ``"busiest"`` and a byte budget give
(the budget: what the fixed schedule's busiest rank holds *without* checkpointing, i.e. the
memory the job had before it checkpointed), and ``rrfp.advise``'s predicted speedup at those
limits and at ``"hint+2"`` (from the same run's steps). Real compute: the predictions are
only as large as this job's timing variability allows.
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import time

from benchmarks.pages import write_page
from benchmarks.titan_runs import activation_checkpoint_args, run_job, VERSION, version_label
from rrfp.advise import read_run
from rrfp.advise.predict import limits_of, predict, replay, Setting
from rrfp.advise.report import size
from rrfp.core.limits import fixed_peak_bytes

OUT = os.path.join("outputs", "ac_bytes")


def modes() -> list[str]:
    return ["none", "selective", "selective-op", "full"] if VERSION == (0, 2) else [
        "none", "selective", "full"]


def measure(steps: int) -> list[dict]:
    rows = []
    for mode in modes():
        folder = os.path.join(OUT, mode)
        run_job(folder, "--rrfp.trace_folder", "traces", *activation_checkpoint_args(mode),
                steps=steps)
        run, _ = read_run(folder)
        rows.append({"mode": mode, "run": run})
        print(f"{mode}: bytes per microbatch {run.bytes_per_microbatch}", flush=True)
    return rows


def describe(rows: list[dict]) -> None:
    """Add each mode's limits and predictions (the budget: mode none's busiest peak)."""
    first = rows[0]["run"]
    budget = max(fixed_peak_bytes(first.hint, first.bytes_per_microbatch).values())
    spelled = f"{math.floor(budget / (1 << 10))}KiB"
    for row in rows:
        run = row["run"]
        baseline = replay(run)
        row["fixed"] = fixed_peak_bytes(run.hint, run.bytes_per_microbatch)
        row["step_ms"] = statistics.median(s.step_time for s in run.own_steps) * 1e3
        for name, limit in (("busiest", "busiest"), ("budget", spelled), ("hint+2", "hint+2")):
            setting = Setting(run.hint.name, limit)
            try:
                row[name] = predict(run, setting, baseline)
            except ValueError as e:  # a budget below what the fixed order holds
                row[name] = str(e)
        row["hint"] = limits_of(Setting(run.hint.name, "hint"), run.hint, None)
    rows[0]["budget_spelled"] = spelled


def limits_text(prediction, hint_limits) -> str:
    if isinstance(prediction, str):
        return f"refused: {prediction}"
    limits = prediction.limits
    extra = {r: limits.per_rank[r] - hint_limits.per_rank[r] for r in limits.per_rank}
    return (f"stages {dict(limits.per_stage)}, ranks {dict(limits.per_rank)} "
            f"(+{'/+'.join(str(e) for e in extra.values())} microbatches over `hint`)")


def page(rows: list[dict], steps: int, seconds: float) -> list[str]:
    stages = list(rows[0]["run"].bytes_per_microbatch)
    lines = [
        f"# Activation checkpointing and byte limits (torchtitan {version_label()}, llama3 "
        "debug, CPU)",
        "",
        f"Regenerate with `python -m benchmarks.ac_bytes_bench --steps {steps}` under "
        f"torchtitan {version_label()} ({seconds:.0f} s here; the module docstring has the "
        "method). Bytes: the byte meter (`rrfp.runtime.meter.ActivationMeter`: the tensors autograd "
        "saves, parameters excluded), per microbatch, in the first training step. The job: "
        "PP 2 x 2 stages, Interleaved1F1B hint, 8 microbatches of 1 x 128 tokens, float32.",
        "",
        "## Bytes one microbatch saves, per stage",
        "",
        "| activation_checkpoint | " + " | ".join(f"stage {s}" for s in stages)
        + " | fixed schedule's busiest rank holds | step time (median) |",
        "|---" * (len(stages) + 3) + "|",
    ]
    for row in rows:
        run = row["run"]
        lines.append(f"| {row['mode']} | " + " | ".join(
            size(run.bytes_per_microbatch[s]) for s in stages)
            + f" | {size(max(row['fixed'].values()))} | {row['step_ms']:.0f} ms |")
    lines += [
        "",
        "## The limits each byte setting gives, and what the advisor predicts there",
        "",
        f"Budget: {rows[0]['budget_spelled']} per rank, what the fixed schedule's busiest rank "
        "holds without checkpointing. Predicted: speedup over the fixed schedule, median over "
        "the run's measured steps (`rrfp.advise`).",
        "",
        "| activation_checkpoint | `busiest`: limits | predicted | budget: limits | predicted "
        "| `hint+2`: predicted, busiest rank may hold |",
        "|---|---|---|---|---|---|",
    ]
    for row in rows:
        cells = [row["mode"]]
        for name in ("busiest", "budget"):
            cells += [limits_text(row[name], row["hint"]),
                      "-" if isinstance(row[name], str) else f"{row[name].speedup:.3f}x"]
        plus2 = row["hint+2"]
        cells.append(f"{plus2.speedup:.3f}x, {size(max(plus2.allowed_bytes.values()))}")
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=8)
    args = parser.parse_args(argv)
    started = time.time()
    rows = measure(args.steps)
    describe(rows)
    version = "_".join(version_label().split(".")[:2])
    print(f"wrote {write_page(f'ac_bytes_{version}.md', page(rows, args.steps, time.time() - started))}")


if __name__ == "__main__":
    main()
