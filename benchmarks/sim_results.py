"""Regenerate the simulation results page: python -m benchmarks.sim_results

Writes benchmarks/results/simulation.md and its PNGs. Every figure is simulated (time
unit: one mean forward); see rrfp/sim/workloads.py for the workload models.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from multiprocessing import Pool

from benchmarks.pages import result_path, write_page
from rrfp.core.hints import build_hint
from rrfp.sim.plot import plot_timelines, plot_tradeoff
from rrfp.sim.study import compare, SWEEP_LIMITS
from rrfp.sim.workloads import WORKLOADS

# hint -> (stages per rank, placement)
HINTS = {"1F1B": (1, "loop"), "Interleaved1F1B": (2, "loop"), "ZBVZeroBubble": (2, "v"),
         "BF": (1, "loop"), "BFW": (1, "loop")}
STATIC_HINTS = {"1F1B": (1, "loop"), "Interleaved1F1B": (2, "loop"),
                "InterleavedZeroBubble": (1, "loop"), "ZBVZeroBubble": (2, "v")}


def _hint(name: str, pp: int, m: int, layouts=None):
    per_rank, layout = (layouts or {**HINTS, **STATIC_HINTS})[name]
    return build_hint(name, num_ranks=pp, num_stages=pp * per_rank, n_microbatches=m, layout=layout)


def _job(args):
    name, pp, m, workload, seed, limit, policy = args
    c = compare(_hint(name, pp, m), workload, seed, limit=limit, policy=policy)
    return args, c.speedup, c.memory_ratio, c.rrfp.makespan / c.bounds.tighter, \
        c.fixed.makespan / c.bounds.tighter, c.policy, c.worst_rank_memory_ratio


def _run(jobs, pool):
    return {r[0]: r[1:] for r in pool.map(_job, jobs, chunksize=4)}


def _cell(values, fmt="{:.3f}") -> str:
    return f"{fmt.format(statistics.mean(values))} [{fmt.format(min(values))}, {fmt.format(max(values))}]"


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seeds", type=int, default=5)
    parser.add_argument("--processes", type=int, default=os.cpu_count() or 1)
    args = parser.parse_args(argv)
    seeds = range(args.seeds)
    started = time.time()
    lines: list[str] = []
    out = lines.append
    with Pool(args.processes) as pool:
        # 1. Policies at the hint's own memory.
        policies = ["hint", "window", "lookahead"]
        jobs = [(h, 8, 32, w, s, "hint", p) for h in STATIC_HINTS for w in WORKLOADS
                for p in policies for s in seeds]
        jobs += [(r, 8, 32, w, s, "hint", None) for r in ("BF", "BFW") for w in WORKLOADS
                 for s in seeds]
        policy_rows = _run(jobs, pool)
        # 2. Speed and memory against the buffer limit, PP8 x 32 microbatches.
        jobs = [(h, 8, 32, w, s, limit, None) for h in HINTS for w in WORKLOADS
                for limit in SWEEP_LIMITS for s in seeds]
        limit_rows = _run(jobs, pool)
        # 3. Depth and microbatches.
        grid = [(pp, m) for pp in (4, 8, 16) for m in (16, 32, 64)]
        jobs = [(h, pp, m, w, s, limit, None) for h in ("1F1B", "BFW") for pp, m in grid
                for w in WORKLOADS for limit in ("hint", "hint+2", 32) for s in seeds]
        grid_rows = _run(jobs, pool)
        # 4. The paper's Table 1 structure and depth scaling (limit 32, as the paper).
        jobs = [(h, pp, m, w, s, 32, None) for h in ("BF", "BFW") for pp in (8, 16)
                for m in (32, 64) for w in ("latency", "multimodal") for s in seeds]
        jobs += [(h, pp, 4 * pp, w, s, 32, None) for h in ("BF",) for pp in (4, 8, 16, 32)
                 for w in ("latency", "multimodal", "jitter") for s in seeds]
        paper_rows = _run(jobs, pool)

    def rows_for(table, **fixed):
        keys = ("hint", "pp", "m", "workload", "seed", "limit", "policy")
        return [v for k, v in table.items()
                if all(k[keys.index(name)] == value for name, value in fixed.items())]

    out("# Simulated results: RRFP vs the fixed schedule")
    out("")
    out("Regenerate with `python -m benchmarks.sim_results` (this run: "
        f"{args.seeds} seeds per cell, {time.time() - started:.0f} s on this machine). Every "
        "figure is **simulated** by `rrfp.sim`, which runs the runtime's own step loop and "
        "arbiter (launch depth 2, no launch cost); time unit one mean forward; I = W = F, "
        "B = I + W. Cells: speedup of RRFP over the fixed schedule with the same hint, `mean "
        "[min, max]` over seeds. *Memory*: microbatches of activations held (from a "
        "microbatch's F until its last backward piece, B or W) by the busiest rank, at the "
        "moment it holds most (the maximum over time of the sum over its stages, not a sum of "
        "per-stage peaks), over the fixed schedule's busiest rank; *worst rank*: the largest "
        "ratio of a rank's own peak to the same rank's peak under the fixed schedule. "
        "Workloads (`rrfp/sim/workloads.py`): **uniform**; **jitter** "
        "(lognormal sigma 0.3 per action); **multimodal** (first quarter of the stages is a "
        "vision encoder whose cost scales with 0-8 images per microbatch); **straggler** (one "
        "stage 3x slower on 20% of its actions); **latency** (P2P latency lognormal, mean half "
        "a forward, sigma 1.2: p95/p5 about 50); **spikes** (mean latency half a forward, 5% "
        "of transfers 5-20x slower); **encoder** (the first stage 2.5x the others); "
        "**correlated** (a microbatch's cost alike on every stage); **slowrank** (one stage "
        "1.3x slower on every action); **bursty** (slow transfers in bursts of consecutive "
        "microbatches of a link).")
    out("")
    out("## 1. Policies at the hint's own memory (`buffer_limit='hint'`), 8 ranks, 32 microbatches")
    out("")
    out("`hint`: plain readiness-first (the paper's runtime). `window`: forwards may not pass "
        "the hint's next pending backward. `lookahead`: a lower-ranked ready action runs "
        "only if, by estimates from two earlier steps (other seeds), it ends before the "
        "hint's next action's input is expected. BF/BFW rows use the paper's rules on "
        "1F1B / InterleavedZeroBubble streams.")
    out("")
    out("| hint | policy | " + " | ".join(WORKLOADS) + " |")
    out("|---|---|" + "---|" * len(WORKLOADS))
    for h in STATIC_HINTS:
        for p in policies:
            cells = [_cell([r[0] for r in rows_for(policy_rows, hint=h, workload=w, policy=p)])
                     for w in WORKLOADS]
            out(f"| {h} | {p} | " + " | ".join(cells) + " |")
    for r in ("BF", "BFW"):
        cells = [_cell([x[0] for x in rows_for(policy_rows, hint=r, workload=w)]) for w in WORKLOADS]
        out(f"| {r} rule | {r} | " + " | ".join(cells) + " |")
    worst = {p: min(r[0] for k, r in policy_rows.items() if k[6] == p) for p in policies}
    out("")
    out("Worst case over all hints, workloads and seeds: " +
        ", ".join(f"{p} {v:.3f}" for p, v in worst.items()) + ".")
    out("")
    out("## 2. Speed and memory against the buffer limit (8 ranks, 32 microbatches)")
    out("")
    out("Default policy per limit, as `ScheduleRRFP` picks it: `lookahead` at the hint's "
        "memory and wherever some rank has less than 2 microbatches of slack; with that slack, "
        "the most critical ready action (`critical`) for one stage per rank (1F1B), "
        "readiness-first until the drain, then the hint's order (`drain`), for ZBVZeroBubble, "
        "plain readiness-first (`hint`) for InterleavedZeroBubble, `lookahead` "
        "for Interleaved1F1B; BF/BFW keep their rules. Cells: speedup "
        "`mean [min, max]`, then memory of the busiest rank and of the worst rank (means over "
        "seeds). Limits count per stage and per rank: `hint+k` allows k microbatches more on "
        "each stage and on each rank.")
    out("")
    for h in HINTS:
        out(f"**{h}**")
        out("")
        out("| limit | " + " | ".join(WORKLOADS) + " |")
        out("|---|" + "---|" * len(WORKLOADS))
        sweeps = {}
        for limit in SWEEP_LIMITS:
            cells = []
            for w in WORKLOADS:
                rs = rows_for(limit_rows, hint=h, workload=w, limit=limit)
                cells.append(f"{_cell([r[0] for r in rs])}, mem "
                             f"{statistics.mean(r[1] for r in rs):.2f}x (worst rank "
                             f"{statistics.mean(r[5] for r in rs):.2f}x)")
            out(f"| {limit} | " + " | ".join(cells) + " |")
        out("")
        png = f"tradeoff_{h}.png"
        sweeps = {w: {str(limit): [_Row(*r) for r in rows_for(limit_rows, hint=h, workload=w, limit=limit)]
                      for limit in SWEEP_LIMITS} for w in WORKLOADS}
        plot_tradeoff(sweeps, result_path(png), title=f"{h}, 8 ranks, 32 microbatches (simulated)")
        out(f"![{h} speed/memory trade-off]({png})")
        out("")
    out("## 3. Depth and microbatches (speedup at limit hint / hint+2 / 32)")
    out("")
    for h in ("1F1B", "BFW"):
        out(f"**{h}**")
        out("")
        out("| ranks x microbatches | " + " | ".join(WORKLOADS) + " |")
        out("|---|" + "---|" * len(WORKLOADS))
        for pp, m in grid:
            cells = [" / ".join(f"{statistics.mean(r[0] for r in rows_for(grid_rows, hint=h, pp=pp, m=m, workload=w, limit=limit)):.2f}"
                                for limit in ("hint", "hint+2", 32)) for w in WORKLOADS]
            out(f"| {pp} x {m} | " + " | ".join(cells) + " |")
        out("")
    out("## 4. The paper's Table 1 structure (limit 32)")
    out("")
    out("The paper (Megatron, 128 PCIe RTX 4090s) reports 1.43-1.77x over fixed 1F1B for "
        "GPT3-Large and up to 2.77x for LLM + ViT. *LLM* here is the latency workload (uniform "
        "compute, heavy-tailed P2P), *multimodal* the vision-encoder workload. `rrfp/bound`: "
        "RRFP's makespan over the tighter lower bound; `fixed/bound` the same for the fixed "
        "schedule.")
    out("")
    out("| rule | ranks | microbatches | workload | speedup | rrfp/bound | fixed/bound | memory |")
    out("|---|---|---|---|---|---|---|---|")
    for h in ("BF", "BFW"):
        for pp in (8, 16):
            for m in (32, 64):
                for w in ("latency", "multimodal"):
                    rs = rows_for(paper_rows, hint=h, pp=pp, m=m, workload=w)
                    out(f"| {h} | {pp} | {m} | {'LLM (latency)' if w == 'latency' else w} | "
                        f"{_cell([r[0] for r in rs])} | {statistics.mean(r[2] for r in rs):.3f} | "
                        f"{statistics.mean(r[3] for r in rs):.3f} | {statistics.mean(r[1] for r in rs):.2f}x |")
    out("")
    out("**Depth scaling** (BF, limit 32, microbatches = 4 x ranks): speedup over fixed 1F1B.")
    out("")
    out("| ranks | latency | multimodal | jitter |")
    out("|---|---|---|---|")
    for pp in (4, 8, 16, 32):
        cells = [_cell([r[0] for r in rows_for(paper_rows, hint="BF", pp=pp, m=4 * pp, workload=w)])
                 for w in ("latency", "multimodal", "jitter")]
        out(f"| {pp} | " + " | ".join(cells) + " |")
    out("")
    out("## 5. The measurement issue's targets, as measured here")
    out("")
    jitter2 = {h: _cell([r[0] for r in rows_for(limit_rows, hint=h, workload="jitter", limit="hint+2")])
               for h in HINTS}
    latency32 = {h: rows_for(limit_rows, hint=h, workload="latency", limit=32) for h in HINTS}
    out("* Uniform times, zero latency: RRFP's makespan equals the fixed schedule's at the "
        "default limit and policy for every named hint, and fixed 1F1B equals (M+N-1)(F+B) "
        "(both are tests in `tests/test_sim.py`).")
    out(f"* Best policy at equal memory (`lookahead`): worst seed {worst['lookahead']:.3f}x "
        "over all hints and workloads of section 1 (target: never below 1.00x); plain "
        f"readiness-first: {worst['hint']:.3f}x.")
    out("* Slack `hint+2`, compute jitter, 8 ranks x 32 microbatches (target >= 1.05x): " +
        ", ".join(f"{h} {v}" for h, v in jitter2.items()) + ".")
    out("* Heavy-tailed P2P latency (mean half a forward), limit 32, 8 ranks x 32 microbatches "
        "(target >= 1.5x and within 5% of the tighter bound): " + ", ".join(
            f"{h} {statistics.mean(r[0] for r in rs):.3f}x at "
            f"{statistics.mean(r[2] for r in rs):.3f}x the bound" for h, rs in latency32.items())
        + f"; with 64 microbatches BF reaches "
        f"{statistics.mean(r[0] for r in rows_for(paper_rows, hint='BF', pp=8, m=64, workload='latency')):.3f}x. "
        "Here the fixed schedule sits about 1.5x above the bound, so there is less to gain "
        "than in a model where it sits 1.9x above.")
    out("")
    out("## 6. Timelines")
    out("")
    for h, w, limit in (("1F1B", "multimodal", "hint+2"), ("BFW", "latency", 32)):
        c = compare(_hint(h, 8, 32), w, 0, limit=limit)
        png = f"timeline_{h}_{w}.png"
        plot_timelines({f"fixed {h}": c.fixed, f"RRFP ({c.policy}, limit {limit})": c.rrfp},
                       result_path(png), title=f"{h}, {w}, 8 ranks x 32 microbatches, seed 0 (simulated)")
        out(f"![{h} {w}]({png})")
        out("")
    path = write_page("simulation.md", lines)
    print(f"wrote {path} in {time.time() - started:.0f} s")


class _Row:
    """A comparison row in the shape plot_tradeoff reads."""

    def __init__(self, speedup, memory_ratio, *_):
        self.speedup = speedup
        self.memory_ratio = memory_ratio


if __name__ == "__main__":
    main()
