"""How much of the achievable gain each policy captures (simulated).

    python -m benchmarks.optimum_bench            # writes results/optimum.md (~25 min)
    python -m benchmarks.optimum_bench --reuse    # reuse CP-SAT's results in results/optimum.json

For each step (1F1B hint, 8 ranks, 32 microbatches; compute jitter, multimodal, and
heavy-tailed P2P latency: mean half a forward, 5% of transfers 5-20x slower; seeds 0-4),
at the hint's memory and at ``hint+2``: the fixed schedule's makespan, the memory-aware
lower bound, the best schedule known (``rrfp.sim.optimum``: CP-SAT over per-rank orders
with full knowledge of every duration and latency, within a time limit, or a policy's if
better), and each policy's speedup and **fraction of the achievable gain** it captures:
``(fixed / policy - 1) / (fixed / best - 1)``. The ``clairvoyant`` column is not a policy a
rank could run: it is ``lookahead``'s rule (run a ready action ranked below the hint's next
only if it ends before that action's input arrives) with the simulator's exact durations
and arrival times (for an input not yet sent, the earliest it could arrive): what that rule
captures when its estimates are exact. Every figure is simulated.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Mapping

from benchmarks.pages import result_path, write_page
from rrfp.hints import build_hint
from rrfp.sim.optimum import optimum
from rrfp.sim.study import compare, resolve_limit
from rrfp.sim.workloads import make_timing

CACHE = "optimum.json"
"""CP-SAT's results and the policies' makespans, in ``benchmarks/results``."""
WORKLOADS = ("jitter", "multimodal", "spikes")
LIMITS = ("hint", "hint+2")
POLICIES = (None, "hint", "lookahead", "arrival", "critical", "window", "BF", "clairvoyant")
"""None: what ScheduleRRFP picks at that limit. ``clairvoyant``: lookahead's rule knowing
every duration and when every message arrives or, not yet sent, could arrive at the
earliest (a yardstick no rank can run)."""


def _label(policy: str | None) -> str:
    return "default" if policy is None else policy


def solve(seeds: int, time_limit_s: float, solved: Mapping[str, dict]) -> dict:
    """Per step: the fixed schedule, the bound, CP-SAT's best (taken from ``solved`` where
    it has the step) and every policy's makespan."""
    hint = build_hint("1F1B", num_ranks=8, num_stages=8, n_microbatches=32)
    rows = {}
    for workload in WORKLOADS:
        for limit in LIMITS:
            for seed in range(seeds):
                key = f"{workload}/{limit}/{seed}"
                started = time.time()
                if key in solved:
                    cp_sat, proven = solved[key]["cp_sat"], solved[key]["proven"]
                else:
                    timing = make_timing(workload, 8, 32, seed)
                    best = optimum(hint, timing.duration, timing.latency,
                                   resolve_limit(limit, hint), time_limit_s=time_limit_s)
                    cp_sat, proven = best.makespan, best.proven
                runs = {_label(p): compare(hint, workload, seed, limit=limit, policy=p)
                        for p in POLICIES}
                first = runs["default"]
                rows[key] = {
                    "fixed": first.fixed.makespan, "bound": first.bounds.tighter,
                    "cp_sat": cp_sat, "proven": proven,
                    "policies": {name: c.rrfp.makespan for name, c in runs.items()},
                    "default_policy": first.policy,
                }
                print(f"{workload} {limit} seed {seed}: fixed {first.fixed.makespan:.2f}, "
                      f"best {cp_sat:.2f} ({'proven' if proven else 'found'}, "
                      f"{time.time() - started:.0f} s)", flush=True)
    return rows


def render(rows: dict, seeds: int, time_limit_s: float) -> list[str]:
    lines = [
        "# Fraction of the achievable gain captured (simulated)",
        "",
        "Regenerate with `python -m benchmarks.optimum_bench` (CP-SAT "
        f"{time_limit_s:.0f} s per step; `--reuse` takes CP-SAT's results from `optimum.json` "
        "where it has them and re-simulates the policies). See the "
        "module docstring for the method. Per cell, means over seeds "
        f"0-{seeds - 1}: speedup over fixed 1F1B, then in brackets the fraction of the "
        "achievable gain captured, and the lowest speedup of any seed. *best known*: the better of CP-SAT's best schedule "
        "(proven optimal where marked) and every policy's.",
        "",
    ]
    for limit in LIMITS:
        lines += [f"## Limit `{limit}` (8 ranks, 32 microbatches, 1F1B)", "",
                  "| workload | fixed / bound | best known speedup (proven) | " +
                  " | ".join(_label(p) for p in POLICIES) + " |",
                  "|---|---|---|" + "---|" * len(POLICIES)]
        captured_all: dict[str, list[float]] = {_label(p): [] for p in POLICIES}
        for workload in WORKLOADS:
            cells = [rows[f"{workload}/{limit}/{seed}"] for seed in range(seeds)]
            best = [min(c["cp_sat"], *c["policies"].values()) for c in cells]
            fixed = [c["fixed"] for c in cells]
            gain = [f / b - 1 for f, b in zip(fixed, best)]

            def summary(policy: str) -> str:
                speedups = [f / c["policies"][policy] for f, c in zip(fixed, cells)]
                captured = [(s - 1) / g if g > 1e-9 else 1.0 for s, g in zip(speedups, gain)]
                captured_all[policy] += captured
                return (f"{statistics.mean(speedups):.3f} ({statistics.mean(captured):.0%}), "
                        f"min {min(speedups):.3f}")

            proven = sum(c["proven"] for c in cells)
            lines.append(
                f"| {workload} | {statistics.mean(f / c['bound'] for f, c in zip(fixed, cells)):.3f} "
                f"| {statistics.mean(f / b for f, b in zip(fixed, best)):.3f} ({proven}/{seeds}) | "
                + " | ".join(summary(_label(p)) for p in POLICIES) + " |")
        lines.append("| all steps: fraction captured | | | " + " | ".join(
            f"{statistics.mean(captured_all[_label(p)]):.0%}" for p in POLICIES) + " |")
        lines.append("")
    return lines


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seeds", type=int, default=5)
    parser.add_argument("--time-limit", type=float, default=45.0,
                        help="CP-SAT seconds per step")
    parser.add_argument("--reuse", action="store_true",
                        help="take CP-SAT's results from results/optimum.json where it has "
                             "the step (re-simulating the policies), solve the others")
    args = parser.parse_args(argv)
    solved = {}
    if args.reuse:
        with open(result_path(CACHE)) as f:
            solved = json.load(f)
    rows = solve(args.seeds, args.time_limit, solved)
    with open(result_path(CACHE), "w") as f:
        json.dump(rows, f, indent=1)
    print(f"wrote {write_page('optimum.md', render(rows, args.seeds, args.time_limit))}")


if __name__ == "__main__":
    main()
