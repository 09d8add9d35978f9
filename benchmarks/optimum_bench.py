"""How much of the achievable gain each policy captures (simulated).

    python -m benchmarks.optimum_bench            # writes results/optimum.md (~25 min)
    python -m benchmarks.optimum_bench --reuse    # reuse CP-SAT's results in results/optimum.json
    python -m benchmarks.optimum_bench --first-seed 5 --seeds 20 --workloads spikes \
        --limits hint             # held-out seeds: results/optimum_5-24_spikes_hint.md (~16 min)
    python -m benchmarks.optimum_bench --first-seed 100 --seeds 5 --workloads all \
        --limits hint+2 --time-limit 20   # every workload family, held out (~20 min)
    python -m benchmarks.optimum_bench --first-seed 100 --seeds 20 --workloads documents \
        documents-latency multimodal-unpacked multimodal-unpacked-latency jitter bursty \
        --limits hint+2 --time-limit 20 --sizes-known --reuse   # sizes told to the policies

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
captures when its estimates are exact. The ``informed`` column runs it knowing all that has
happened on every rank and every true duration, but the step's latencies only as an
unordered set: what the rule captures when latency cannot be foreseen (with no latency, as
under jitter and multimodal, it is ``clairvoyant``). ``foresight-critical`` ranks ready
actions as the default ``critical`` does, by the longest chain of work behind each, but
costs the chains by the step's true durations and latencies; ``informed-critical`` costs
them by all that has happened on every rank (an action whose microbatch has ended its
forward on that stage: that forward's duration times its kind's cost): what ``critical``'s
rule captures with perfect foresight, and with all knowledge a rank could be given.
``--sizes-known`` tells every policy each step's microbatch sizes (the workloads whose
variability comes from the data have them: ``rrfp.sim.workloads.SIZE_WORKLOADS``). Seeds
other than 0-4 (``--first-seed``) check a policy on steps its defaults were not chosen on. Every figure
is simulated.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Mapping, Sequence

from benchmarks.pages import result_path, write_page
from rrfp.core.hints import build_hint
from rrfp.core.limits import resolve_buffer_limits
from rrfp.sim.foresight import FORESIGHT_CRITICAL, INFORMED_CRITICAL
from rrfp.sim.optimum import optimum
from rrfp.sim.study import compare
from rrfp.sim.workloads import make_timing, WORKLOADS as ALL_WORKLOADS

CACHE = "optimum.json"
"""CP-SAT's results and the policies' makespans, in ``benchmarks/results``."""
WORKLOADS = ("jitter", "multimodal", "spikes")
LIMITS = ("hint", "hint+2")
POLICIES = (None, "hint", "lookahead", "arrival", "critical", "window", "BF", "clairvoyant",
            "informed", FORESIGHT_CRITICAL, INFORMED_CRITICAL)
"""None: what ScheduleRRFP picks at that limit. ``clairvoyant``: lookahead's rule knowing
every duration and when every message arrives or, not yet sent, could arrive at the
earliest; ``informed``: the same rule knowing all but which latency each message to come
draws; ``foresight-critical``: critical's ranking by every true duration and latency;
``informed-critical``: critical's ranking by all that has happened on every rank
(yardsticks no rank can run)."""
RUNNABLE = ("default", "hint", "lookahead", "arrival", "critical", "window", "BF")
SIZES_KNOWN = "/sizes-known"
"""What a step's cache key ends with where the policies were told the microbatch sizes."""
UNSIZED_DEFAULT = "default, sizes unknown"
"""With ``--sizes-known``, the column of the default policy not told the sizes."""
PER_STEP_BEST = "best runnable per step"
"""The column of the best of the ``RUNNABLE`` policies on each step, chosen after the fact:
what any rule that picks one of them per step (from whatever signal) could capture at
most."""


DEFAULT_TIME_LIMIT_S = 45.0
"""CP-SAT's time per step unless ``--time-limit`` says otherwise."""

def _label(policy: str | None) -> str:
    return "default" if policy is None else policy


def solve(seeds: Sequence[int], workloads: Sequence[str], limits: Sequence[str],
          time_limit_s: float, solved: Mapping[str, dict], cached: dict,
          sizes_known: bool = False) -> dict:
    """Per step: the fixed schedule, the bound, CP-SAT's best (taken from ``solved`` where
    it has the step) and every policy's makespan (``sizes_known``: told the microbatch
    sizes, and the default without them besides); each step is written into ``cached``
    and the cache file as soon as it is done, so that an interrupted run keeps it."""
    hint = build_hint("1F1B", num_ranks=8, num_stages=8, n_microbatches=32)
    rows = {}
    for workload in workloads:
        for limit in limits:
            for seed in seeds:
                key = f"{workload}/{limit}/{seed}"
                started = time.time()
                # CP-SAT's answer does not depend on what the policies know.
                known = solved.get(key) or solved.get(key + SIZES_KNOWN)
                if known is not None:
                    cp_sat, proven = known["cp_sat"], known["proven"]
                else:
                    timing = make_timing(workload, 8, 32, seed)
                    best = optimum(hint, timing.duration, timing.latency,
                                   resolve_buffer_limits(limit, hint), time_limit_s=time_limit_s)
                    cp_sat, proven = best.makespan, best.proven
                runs = {_label(p): compare(hint, workload, seed, limit=limit, policy=p,
                                           sizes_known=sizes_known)
                        for p in POLICIES}
                if sizes_known:
                    runs[UNSIZED_DEFAULT] = compare(hint, workload, seed, limit=limit)
                first = runs["default"]
                if sizes_known:
                    key += SIZES_KNOWN
                rows[key] = {
                    "fixed": first.fixed.makespan, "bound": first.bounds.tighter,
                    "cp_sat": cp_sat, "proven": proven,
                    "policies": {name: c.rrfp.makespan for name, c in runs.items()},
                    "default_policy": first.policy,
                }
                cached[key] = rows[key]
                with open(result_path(CACHE), "w") as f:
                    json.dump(cached, f, indent=1)
                print(f"{workload} {limit} seed {seed}: fixed {first.fixed.makespan:.2f}, "
                      f"best {cp_sat:.2f} ({'proven' if proven else 'found'}, "
                      f"{time.time() - started:.0f} s)", flush=True)
    return rows


def render(rows: dict, seeds: Sequence[int], workloads: Sequence[str], limits: Sequence[str],
           command: str, time_limit_s: float, sizes_known: bool = False) -> list[str]:
    suffix = SIZES_KNOWN if sizes_known else ""
    lines = [
        "# Fraction of the achievable gain captured (simulated)",
        "",
        f"Regenerate with `{command}` (CP-SAT "
        f"{time_limit_s:.0f} s per step; `--reuse` takes CP-SAT's results from `optimum.json` "
        "where it has them and re-simulates the policies). See the "
        "module docstring for the method. Per cell, means over seeds "
        f"{seeds[0]}-{seeds[-1]}: speedup over fixed 1F1B, then in brackets the fraction of the "
        "achievable gain captured, and the lowest speedup of any seed. *best known*: the better of CP-SAT's best schedule "
        "(proven optimal where marked) and every policy's. *Fraction of the mean gain*: the "
        "policy's mean speedup over all the limit's steps, less one, over the best known's. "
        f"*{PER_STEP_BEST}*: on each step the best of {', '.join(RUNNABLE)}, chosen after the "
        "fact: no rank can run it; it is what a rule picking one of them per step could "
        "capture at most.",
        "",
    ]
    columns = [*(_label(p) for p in POLICIES), PER_STEP_BEST]
    if sizes_known:
        lines += [
            "**Sizes known**: every policy's ranks are told each step's microbatch sizes "
            "(`Timing.sizes`: tokens, sum of squared document lengths, images; never the "
            "durations) and predict durations from them by what the two earlier steps "
            "measured (`rrfp.core.sizes`); workloads without sizes run as without. "
            f"*{UNSIZED_DEFAULT}*: the default not told them.", ""]
        columns.insert(1, UNSIZED_DEFAULT)
    for limit in limits:
        lines += [f"## Limit `{limit}` (8 ranks, 32 microbatches, 1F1B)", "",
                  "| workload | fixed / bound | best known speedup (proven) | " +
                  " | ".join(columns) + " |",
                  "|---|---|---|" + "---|" * len(columns)]
        captured_all: dict[str, list[float]] = {name: [] for name in columns}
        speedups_all: dict[str, list[float]] = {name: [] for name in columns}
        best_all: list[float] = []
        for workload in workloads:
            cells = [rows[f"{workload}/{limit}/{seed}{suffix}"] for seed in seeds]
            makespans = [{**c["policies"], PER_STEP_BEST: min(c["policies"][name]
                                                               for name in RUNNABLE)}
                         for c in cells]
            best = [min(c["cp_sat"], *c["policies"].values()) for c in cells]
            fixed = [c["fixed"] for c in cells]
            gain = [f / b - 1 for f, b in zip(fixed, best)]
            best_all += [f / b for f, b in zip(fixed, best)]

            def summary(policy: str) -> str:
                speedups = [f / m[policy] for f, m in zip(fixed, makespans)]
                captured = [(s - 1) / g if g > 1e-9 else 1.0 for s, g in zip(speedups, gain)]
                captured_all[policy] += captured
                speedups_all[policy] += speedups
                return (f"{statistics.mean(speedups):.3f} ({statistics.mean(captured):.0%}), "
                        f"min {min(speedups):.3f}")

            proven = sum(c["proven"] for c in cells)
            lines.append(
                f"| {workload} | {statistics.mean(f / c['bound'] for f, c in zip(fixed, cells)):.3f} "
                f"| {statistics.mean(f / b for f, b in zip(fixed, best)):.3f} ({proven}/{len(seeds)}) | "
                + " | ".join(summary(name) for name in columns) + " |")
        lines.append("| all steps: fraction captured | | | " + " | ".join(
            f"{statistics.mean(captured_all[name]):.0%}" for name in columns) + " |")
        # Steps with almost no gain to take make per-step fractions swing widely.
        mean_gain = statistics.mean(best_all) - 1
        lines.append("| all steps: fraction of the mean gain | | | " + " | ".join(
            f"{(statistics.mean(speedups_all[name]) - 1) / mean_gain:.0%}"
            if mean_gain > 1e-9 else "-" for name in columns) + " |")
        lines.append("")
    return lines


def _at_least_one(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seeds", type=_at_least_one, default=5, help="how many seeds")
    parser.add_argument("--first-seed", type=int, default=0,
                        help="the first of them; other seeds, workloads or limits than the "
                             "defaults get a page of their own, named after them")
    parser.add_argument("--workloads", nargs="+", choices=(*ALL_WORKLOADS, "all"),
                        default=list(WORKLOADS),
                        help="all: every workload family of rrfp.sim.workloads")
    parser.add_argument("--limits", nargs="+", choices=(*LIMITS, "busiest"), default=list(LIMITS),
                        help="busiest: every rank may hold what fixed 1F1B's busiest rank holds")
    parser.add_argument("--time-limit", type=float, default=DEFAULT_TIME_LIMIT_S,
                        help="CP-SAT seconds per step")
    parser.add_argument("--reuse", action="store_true",
                        help="take CP-SAT's results from results/optimum.json where it has "
                             "the step (re-simulating the policies), solve the others")
    parser.add_argument("--sizes-known", action="store_true",
                        help="tell the policies each step's microbatch sizes (the workloads "
                             "with sizes: documents, multimodal-unpacked and their -latency "
                             "forms); adds the default without them as a column")
    args = parser.parse_args(argv)
    seeds = range(args.first_seed, args.first_seed + args.seeds)
    named_workloads = args.workloads
    if "all" in args.workloads:
        args.workloads = list(ALL_WORKLOADS)
    try:
        with open(result_path(CACHE)) as f:
            cached = json.load(f)
    except FileNotFoundError:
        cached = {}
    rows = solve(seeds, args.workloads, args.limits, args.time_limit,
                 dict(cached) if args.reuse else {}, cached, args.sizes_known)
    command, page = "python -m benchmarks.optimum_bench", ["optimum"]
    if (args.first_seed, args.seeds) != (0, 5):
        command += f" --first-seed {args.first_seed} --seeds {args.seeds}"
        page.append(f"{seeds[0]}-{seeds[-1]}")
    if args.workloads != list(WORKLOADS):
        command += " --workloads " + " ".join(named_workloads)
        page += named_workloads
    if args.limits != list(LIMITS):
        command += " --limits " + " ".join(args.limits)
        page += args.limits
    if args.time_limit != DEFAULT_TIME_LIMIT_S:
        command += f" --time-limit {args.time_limit:g}"
    if args.sizes_known:
        command += " --sizes-known"
        page.append("sizes-known")
    lines = render(rows, seeds, args.workloads, args.limits, command, args.time_limit,
                   args.sizes_known)
    print(f"wrote {write_page('_'.join(page) + '.md', lines)}")


if __name__ == "__main__":
    main()
