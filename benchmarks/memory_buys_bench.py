"""What memory buys: speedup against the buffer limit, per hint family and variability
(simulated).

    python -m benchmarks.memory_buys_bench     # writes results/memory_buys.md and its PNGs

For each hint family (1F1B, Interleaved1F1B, ZBVZeroBubble, the BF rule, the BFW rule; 8
ranks, 32 microbatches), each buffer limit (``hint``, ``hint+1``, ``hint+2``,
``busiest``, ``2x hint``, ``4x hint``, 32) and each variability level of the unpacked
documents workload (``rrfp.sim.workloads``: the lognormal sigma of document lengths, from
0.3, a language stage's cost varying by a coefficient of variation near 0.2 as packed
sequences do, to 0.85, near 1.0, unpacked), seeds 0..N-1: the default policy's speedup
over the fixed schedule with the same hint (BF: fixed 1F1B; BFW: fixed zero-bubble, its
rule's reference, and fixed 1F1B too), the ranks told each step's microbatch sizes, and
the busiest rank's activation memory over the fixed schedule's busiest rank. Every figure
is simulated (time unit: one mean forward).
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import time
from multiprocessing import Pool

from benchmarks.pages import result_path, write_page
from rrfp.core.hints import build_hint
from rrfp.sim.engine import simulate
from rrfp.sim.plot import LimitSeries, plot_speedup_and_memory
from rrfp.sim.study import compare
from rrfp.sim.workloads import make_timing, WorkloadParams

FAMILIES = {"1F1B": (1, "loop"), "Interleaved1F1B": (2, "loop"), "ZBVZeroBubble": (2, "v"),
            "BF": (1, "loop"), "BFW": (1, "loop")}
"""Hint -> (stages per rank, placement)."""
LIMITS = ("hint", "hint+1", "hint+2", "busiest", "2x hint", "4x hint", 32)
SIGMAS = (0.3, 0.5, 0.7, 0.85)
"""Lognormal sigmas of document length: packed-like to unpacked."""
WORKLOAD = "documents"
AGAINST_1F1B = "fixed 1F1B"
"""BFW's second baseline."""


def _hint(name: str):
    per_rank, layout = FAMILIES[name]
    return build_hint(name, num_ranks=8, num_stages=8 * per_rank, n_microbatches=32,
                      layout=layout)


def _job(args):
    name, sigma, seed, limit = args
    params = WorkloadParams(document_sigma=sigma)
    c = compare(_hint(name), WORKLOAD, seed, limit=limit, params=params, sizes_known=True)
    return args, (c.fixed.makespan, c.rrfp.makespan, max(c.fixed.rank_peaks.values()),
                  max(c.rrfp.rank_peaks.values()), c.policy)


def _fixed_1f1b(args):
    sigma, seed = args
    timing = make_timing(WORKLOAD, 8, 32, seed, WorkloadParams(document_sigma=sigma))
    fixed = simulate(_hint("1F1B"), timing.duration, latency=timing.latency, policy="fixed",
                     launch_depth=math.inf)
    return args, (fixed.makespan, max(fixed.rank_peaks.values()))


def variability(sigma: float, seeds: range) -> float:
    """Coefficient of variation of the forwards' costs of the documents workload."""
    costs = [x for seed in seeds
             for row in make_timing(WORKLOAD, 8, 32, seed, WorkloadParams(document_sigma=sigma)).forward
             for x in row]
    return statistics.pstdev(costs) / statistics.mean(costs)


def _series(runs: dict, name: str, sigma: float, seeds: range,
            baseline: dict | None = None) -> LimitSeries:
    """Per limit: mean and lowest speedup, mean memory ratio; over ``baseline``'s fixed
    makespans and busiest-rank peaks (per seed) where given, else the hint's own."""
    speedup, lowest, memory = [], [], []
    for limit in LIMITS:
        rows = [(runs[(name, sigma, seed, limit)], seed) for seed in seeds]
        ratios = [(baseline[(sigma, seed)][0] if baseline else fixed) / rrfp
                  for (fixed, rrfp, _, _, _), seed in rows]
        mem = [peak / (baseline[(sigma, seed)][1] if baseline else fixed_peak)
               for (_, _, fixed_peak, peak, _), seed in rows]
        speedup.append(statistics.mean(ratios))
        lowest.append(min(ratios))
        memory.append(statistics.mean(mem))
    return LimitSeries(speedup, lowest, memory)


def _panels(runs: dict, one_f_one_b: dict, name: str, label: dict[float, str],
            seeds: range) -> dict[str, dict[str, LimitSeries]]:
    """Baseline -> variability label -> series: the hint's own fixed schedule (a rule's:
    its reference), and for BFW fixed 1F1B too."""
    own = {label[sigma]: _series(runs, name, sigma, seeds) for sigma in SIGMAS}
    if name == "BF":
        return {"against fixed 1F1B (its rule's reference)": own}
    if name == "BFW":
        return {"against fixed zero-bubble (its rule's reference)": own,
                f"against {AGAINST_1F1B}": {
                    label[sigma]: _series(runs, name, sigma, seeds, one_f_one_b)
                    for sigma in SIGMAS}}
    return {f"against fixed {name}": own}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seeds", type=int, default=10)
    parser.add_argument("--processes", type=int, default=os.cpu_count() or 1)
    args = parser.parse_args(argv)
    seeds = range(args.seeds)
    started, load = time.time(), os.getloadavg()[0]
    jobs = [(name, sigma, seed, limit) for name in FAMILIES for sigma in SIGMAS
            for seed in seeds for limit in LIMITS]
    with Pool(args.processes) as pool:
        runs = dict(pool.map(_job, jobs, chunksize=4))
        one_f_one_b = dict(pool.map(_fixed_1f1b, [(sigma, seed) for sigma in SIGMAS
                                                  for seed in seeds]))
    elapsed = time.time() - started
    cvs = {sigma: variability(sigma, seeds) for sigma in SIGMAS}
    label = {sigma: f"CV {cvs[sigma]:.2f} (sigma {sigma})" for sigma in SIGMAS}
    command = "python -m benchmarks.memory_buys_bench" + (
        f" --seeds {args.seeds}" if args.seeds != parser.get_default("seeds") else "")
    lines = [
        "# What memory buys (simulated)",
        "",
        f"Regenerate with `{command}` ({len(jobs)} simulated comparisons, "
        f"{elapsed / 60:.1f} min on {args.processes} processes of a 2-core machine, 1-minute "
        f"load {load:.1f} at the start). "
        "See the module docstring for the method. 8 ranks x 32 microbatches, the unpacked "
        f"documents workload (sizes told to the ranks), seeds {seeds.start}-{seeds.stop - 1}; "
        "variability by the lognormal sigma of document lengths, shown as the coefficient of "
        "variation (CV) of a forward's cost: "
        + ", ".join(label[sigma] for sigma in SIGMAS) + " (packed sequences vary by about "
        "0.2, unpacked documents by about 1). Per cell: mean speedup of the default policy "
        "over the fixed schedule, the lowest seed, and the busiest rank's activations over "
        "the fixed schedule's busiest rank (the job's activation memory: what a gigabyte "
        "buys reads off the two together). The default per limit is named in each table. "
        "BF's baseline is fixed 1F1B (its rule's reference); BFW's is fixed zero-bubble "
        "(`InterleavedZeroBubble`, one stage per rank: its rule's reference) and fixed 1F1B, "
        "both on the same timings.",
        "",
    ]
    for name in FAMILIES:
        panels = _panels(runs, one_f_one_b, name, label, seeds)
        png = f"memory_buys_{name}.png"
        plot_speedup_and_memory(panels, [str(limit) for limit in LIMITS], result_path(png),
                                title=f"{name}, 8 ranks x 32 microbatches, documents (simulated)")
        lines += [f"## {name}", "", f"![{name}: speedup and memory against the limit]({png})", ""]
        policies = ", ".join(f"`{limit}` {'/'.join(sorted({runs[(name, s, seed, limit)][4] for s in SIGMAS for seed in seeds}))}"
                             for limit in LIMITS)
        lines += [f"Default per limit: {policies}.", ""]
        for panel, series in panels.items():
            lines += [f"**{name} {panel}**", "",
                      "| variability | " + " | ".join(f"`{limit}`" for limit in LIMITS) + " |",
                      "|---|" + "---|" * len(LIMITS)]
            for sigma_label, line in series.items():
                lines.append(f"| {sigma_label} | " + " | ".join(
                    f"{s:.3f} (min {low:.3f}), mem {m:.2f}x"
                    for s, low, m in zip(line.speedup, line.lowest, line.memory)) + " |")
            lines.append("")
    path = write_page("memory_buys.md", lines)
    print(f"wrote {path} in {elapsed:.0f} s")


if __name__ == "__main__":
    main()
