"""Simulate fixed schedule vs RRFP on seeded workloads (or replayed timings).

    python -m rrfp.sim --pp 8 --microbatches 64 --hint 1F1B --workload multimodal \\
        --limit hint+2 --seeds 10 [--plot timeline.png] [--sweep tradeoff.png]

Times are in units of one mean forward. Every figure is simulated.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import time

from rrfp.hints import build_hint, HINT_NAMES
from rrfp.policy import POLICIES
from rrfp.sim.study import compare, SWEEP_LIMITS, sweep_limits
from rrfp.sim.workloads import Timing, WORKLOADS, WorkloadParams

TWO_CHUNK_HINTS = {"interleaved1f1b", "loopedbfs", "interleavedzerobubble", "zbvzerobubble",
                   "dualpipev"}
V_HINTS = {"zbvzerobubble", "dualpipev"}


def _limit(text: str) -> str | int:
    return int(text) if text.isdigit() else text


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--pp", type=int, default=8, help="pipeline ranks")
    parser.add_argument("--microbatches", type=int, default=32)
    parser.add_argument("--hint", default="1F1B", help=f"one of {list(HINT_NAMES)} or a CSV")
    parser.add_argument("--stages-per-rank", type=int,
                        help="default: 2 for interleaved and V hints, else 1")
    parser.add_argument("--layout", choices=("loop", "v"),
                        help="stage placement (default: v for ZBVZeroBubble/DualPipeV)")
    parser.add_argument("--workload", default="jitter", choices=WORKLOADS)
    parser.add_argument("--replay", help="timings JSON (see python -m rrfp.sim.replay)")
    parser.add_argument("--limit", type=_limit, default="hint",
                        help="buffer limit: hint, hint+k, '2x hint' or an int")
    parser.add_argument("--policy", choices=POLICIES,
                        help="arbitration policy (default: what ScheduleRRFP would pick)")
    parser.add_argument("--seeds", type=int, default=5)
    parser.add_argument("--plot", help="PNG of fixed vs RRFP timelines (first seed)")
    parser.add_argument("--sweep", help=f"PNG of speedup and memory for limits {SWEEP_LIMITS}")
    for f in dataclasses.fields(WorkloadParams):
        parser.add_argument("--" + f.name.replace("_", "-"), type=type(f.default),
                            default=f.default, help=f.metadata.get("help"))
    args = parser.parse_args(argv)

    name = args.hint.lower()
    per_rank = args.stages_per_rank or (2 if name in TWO_CHUNK_HINTS else 1)
    layout = args.layout or ("v" if name in V_HINTS else "loop")
    try:
        hint = build_hint(args.hint, num_ranks=args.pp, num_stages=args.pp * per_rank,
                          n_microbatches=args.microbatches, layout=layout)
    except ValueError as e:
        sys.exit(f"error: {e}")
    params = WorkloadParams(**{f.name: getattr(args, f.name) for f in dataclasses.fields(WorkloadParams)})
    workload = Timing.load(args.replay) if args.replay else args.workload
    seeds = 1 if args.replay else args.seeds
    label = f"replay {args.replay}" if args.replay else f"workload {args.workload}"

    start = time.perf_counter()
    rows = [compare(hint, workload, seed, limit=args.limit, policy=args.policy, params=params)
            for seed in range(seeds)]
    elapsed = time.perf_counter() - start
    print(f"{hint.name}: {args.pp} ranks x {per_rank} stages ({hint.layout}), "
          f"{args.microbatches} microbatches, {label}, limit {args.limit!r}, "
          f"policy {rows[0].policy} (simulated)")
    print(f"{'seed':>4} {'fixed':>9} {'rrfp':>9} {'speedup':>8} {'bound':>9} "
          f"{'rrfp/bound':>10} {'fixed/bound':>11} {'memory':>7}")
    for r in rows:
        bound = r.bounds.tighter
        print(f"{r.seed:>4} {r.fixed.makespan:9.2f} {r.rrfp.makespan:9.2f} {r.speedup:8.3f} "
              f"{bound:9.2f} {r.rrfp.makespan / bound:10.3f} {r.fixed.makespan / bound:11.3f} "
              f"{r.memory_ratio:6.2f}x")
    print("bound: the tighter of the critical path and the busiest rank's work plus its "
          "fill and drain; memory: most loaded rank's activations vs the fixed schedule's")
    speedups = [r.speedup for r in rows]
    print(f"speedup mean {statistics.mean(speedups):.3f}, min {min(speedups):.3f}, "
          f"max {max(speedups):.3f} ({elapsed:.2f} s for {seeds} seeds)")
    if args.plot:
        from rrfp.sim.plot import plot_timelines

        first = rows[0]
        plot_timelines({f"fixed {hint.name}": first.fixed,
                        f"RRFP ({first.policy}, limit {args.limit})": first.rrfp},
                       args.plot, title=f"{hint.name}, {label}, seed 0 (simulated)")
        print(f"wrote {args.plot}")
    if args.sweep:
        from rrfp.sim.plot import plot_tradeoff

        sweep = sweep_limits(hint, workload, seeds, policy=args.policy, params=params)
        plot_tradeoff({label: sweep}, args.sweep,
                      title=f"{hint.name}, {args.pp} ranks, {args.microbatches} microbatches (simulated)")
        for limit, comparisons in sweep.items():
            print(f"limit {limit:>8}: speedup mean "
                  f"{statistics.mean(c.speedup for c in comparisons):.3f}, activation "
                  f"memory {statistics.mean(c.memory_ratio for c in comparisons):.2f}x the hint's")
        print(f"wrote {args.sweep}")


if __name__ == "__main__":
    main()
