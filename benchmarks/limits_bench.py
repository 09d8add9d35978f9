"""The default policy at every limit the sweeps name, on every workload family (simulated).

    python -m benchmarks.limits_bench                 # writes results/limits.md
    python -m benchmarks.limits_bench --seeds 3 --hints 1F1B --policies critical,lookahead

For each hint (1F1B, Interleaved1F1B, ZBVZeroBubble; 8 ranks, 32 microbatches), each
buffer limit (``hint``, ``hint+1``, ``hint+2``, ``busiest``: what the fixed schedule's
busiest rank holds, on every rank, ``2x hint``, 32) and each workload of
``rrfp.sim.workloads`` (the widened ones and those whose variability comes from the data
included), seeds 0..N-1: RRFP's speedup over the fixed schedule under the default policy
(what ScheduleRRFP picks at that limit), on the workloads with sizes also with the sizes
told to the ranks, and under any other ``--policies``. Per cell: mean speedup, and the
lowest of any seed. The page states whether the default's lowest, with sizes or without,
stays at or above 0.995x everywhere. Every figure is simulated (time unit: one mean
forward).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from multiprocessing import Pool

from benchmarks.pages import write_page
from rrfp.core.hints import build_hint
from rrfp.sim.study import compare
from rrfp.sim.workloads import SIZE_WORKLOADS, WORKLOADS

HINTS = {"1F1B": (1, "loop"), "Interleaved1F1B": (2, "loop"), "ZBVZeroBubble": (2, "v")}
LIMITS = ("hint", "hint+1", "hint+2", "busiest", "2x hint", 32)
FLOOR = 0.995
"""The default must never fall below this speedup over the fixed schedule."""


SIZED = "default, sizes known"
"""The column of the default told each step's microbatch sizes (workloads with sizes)."""


def _job(args):
    name, pp, m, workload, seed, limit, policy = args
    per_rank, layout = HINTS[name]
    hint = build_hint(name, num_ranks=pp, num_stages=pp * per_rank, n_microbatches=m,
                      layout=layout)
    sized = policy == SIZED
    c = compare(hint, workload, seed, limit=limit, policy=None if sized else policy,
                sizes_known=sized)
    return args, c.speedup, c.policy, c.memory_ratio


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seeds", type=int, default=10)
    parser.add_argument("--first-seed", type=int, default=0)
    parser.add_argument("--hints", default=",".join(HINTS))
    parser.add_argument("--workloads", default=",".join(WORKLOADS))
    parser.add_argument("--limits", default=",".join(map(str, LIMITS)))
    parser.add_argument("--policies", default="",
                        help="comma-separated policies to report besides the default")
    parser.add_argument("--pp", type=int, default=8)
    parser.add_argument("--microbatches", type=int, default=32)
    parser.add_argument("--processes", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--out", default="limits.md", help="page name under results/")
    args = parser.parse_args(argv)
    hints = args.hints.split(",")
    workloads = args.workloads.split(",")
    limits = [int(x) if x.isdigit() else x for x in args.limits.split(",")]
    policies = [None, SIZED] + [p for p in args.policies.split(",") if p]
    seeds = range(args.first_seed, args.first_seed + args.seeds)
    jobs = [(h, args.pp, args.microbatches, w, s, lim, p) for h in hints for lim in limits
            for w in workloads for p in policies for s in seeds
            if p != SIZED or w in SIZE_WORKLOADS]
    started = time.time()
    with Pool(args.processes) as pool:
        results = pool.map(_job, jobs, chunksize=4)
    elapsed = time.time() - started
    by_cell: dict[tuple, list[float]] = {}
    chosen: dict[tuple, set[str]] = {}
    memory: dict[tuple, float] = {}
    for (h, _, _, w, _, lim, p), speedup, used, mem in results:
        by_cell.setdefault((h, lim, w, p), []).append(speedup)
        if p is None:
            chosen.setdefault((h, lim), set()).add(used)
            memory[(h, lim)] = max(memory.get((h, lim), 0.0), mem)
    command = "python -m benchmarks.limits_bench" + "".join(
        f" {a}" for a in (argv if argv is not None else sys.argv[1:]))
    defaults = (None, SIZED)
    default_min = min(min(v) for (h, lim, w, p), v in by_cell.items() if p in defaults)
    worst = min(((min(v), h, str(lim), w + (", sizes known" if p else ""))
                 for (h, lim, w, p), v in by_cell.items() if p in defaults),
                key=lambda row: row[0])
    lines = [
        "# The default policy at every limit, on every workload family (simulated)",
        "",
        f"Regenerate with `{command}` ({elapsed / 60:.0f} min on {args.processes} "
        "processes). See the module docstring for the method. "
        f"{args.pp} ranks x {args.microbatches} microbatches, seeds "
        f"{seeds.start}-{seeds.stop - 1}. Per cell: mean speedup over the fixed schedule, "
        "then the lowest of any seed. *default*: what ScheduleRRFP picks at that limit (named "
        "per hint and limit). *busiest*: every stage and rank may hold what the fixed "
        "schedule's busiest rank holds; *memory*: the busiest rank's peak under the default "
        "over the fixed schedule's busiest rank (most over the cells' seeds). "
        f"*{SIZED}*: the default told each step's microbatch sizes (workloads "
        f"{', '.join(SIZE_WORKLOADS)}; the others have none, `-`).",
        "",
        f"**The default's lowest speedup anywhere, with sizes or without: {default_min:.3f}x** "
        f"({worst[1]}, limit `{worst[2]}`, {worst[3]}); "
        + (f"never below {FLOOR}x." if default_min >= FLOOR else f"BELOW {FLOOR}x."),
        "",
    ]
    for h in hints:
        lines += [f"## {h}", "",
                  "| limit | default (memory) | workload | "
                  + " | ".join("default" if p is None else p for p in policies) + " |",
                  "|---|---|---|" + "---|" * len(policies)]
        for lim in limits:
            label = f"{', '.join(sorted(chosen[(h, lim)]))} ({memory[(h, lim)]:.2f}x)"
            for i, w in enumerate(workloads):
                cells = []
                for p in policies:
                    v = by_cell.get((h, lim, w, p))
                    if v is None:
                        cells.append("-")
                        continue
                    cell = f"{statistics.mean(v):.3f}, min {min(v):.3f}"
                    if p in defaults and min(v) < FLOOR:
                        cell = f"**{cell}**"
                    cells.append(cell)
                lines.append(f"| `{lim}` | {label if i == 0 else ''} | {w} | "
                             + " | ".join(cells) + " |")
        lines.append("")
    path = write_page(args.out, lines)
    print(f"wrote {path}: default's lowest {default_min:.3f}x ({elapsed:.0f} s)")


if __name__ == "__main__":
    main()
