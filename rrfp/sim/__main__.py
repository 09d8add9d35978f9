"""Simulate fixed schedule vs RRFP on seeded workloads (or replayed timings).

    python -m rrfp.sim --pp 8 --microbatches 64 --hint 1F1B --workload multimodal \\
        --limit hint+2 --seeds N [--plot outputs/timeline.png] [--sweep outputs/tradeoff.png]

Times are in units of one mean forward (replayed timings: in ms). Every figure is simulated.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import math
import os
import statistics
import time

from rrfp.core.hints import build_hint, Hint, HINT_NAMES, RULE_NAMES, rule_reference
from rrfp.core.limits import resolve_buffer_limits
from rrfp.core.settings import (BUFFER_LIMIT_HELP, DEFAULT_LAUNCH_DEPTH, LAUNCH_DEPTH_HELP,
                                parse_buffer_limit, parse_launch_depth, parse_policy, policy_help)
from rrfp.core.text import counted
from rrfp.sim.engine import SIM_POLICIES
from rrfp.sim.study import compare, SWEEP_LIMITS, sweep_limits, timing_for
from rrfp.sim.workloads import SIZE_WORKLOADS, Timing, WORKLOADS, WorkloadParams

PROG = "python -m rrfp.sim"
TWO_CHUNK_HINTS = {"interleaved1f1b", "loopedbfs", "interleavedzerobubble", "zbvzerobubble",
                   "dualpipev"}
V_HINTS = {"zbvzerobubble", "dualpipev"}
DEFAULT_WORKLOAD = "jitter"
DEFAULT_SEEDS = 5
DEFAULT_PP, DEFAULT_MICROBATCHES = 8, 32


def _limit(text: str) -> str:
    try:
        parse_buffer_limit(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return text


def _policy(text: str) -> str | None:
    try:
        return parse_policy(text, SIM_POLICIES)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _at_least_one(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be an integer >= 1, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be an integer >= 1, got {value}")
    return value


def _launch_depth(text: str) -> float:
    try:
        depth = parse_launch_depth(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return math.inf if depth is None else depth


def _non_negative(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number >= 0, got {text!r}") from None
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"must be a number >= 0, got {value}")
    return value


def _option(name: str) -> str:
    return "--" + name.replace("_", "-")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n")[0],
                                     epilog="Times are in units of one mean forward (replayed "
                                            "timings: ms); every figure is simulated.")
    pipeline = parser.add_argument_group("pipeline")
    pipeline.add_argument("--pp", type=_at_least_one,
                          help=f"pipeline ranks (default: {DEFAULT_PP}; with --replay, what "
                               "the timings file holds)")
    pipeline.add_argument("--microbatches", type=_at_least_one,
                          help=f"microbatches per step (default: {DEFAULT_MICROBATCHES}; with "
                               "--replay, what the timings file holds)")
    pipeline.add_argument("--hint", default="1F1B",
                          help=f"the schedule RRFP takes as its hint and compares with: one of "
                               f"{', '.join(HINT_NAMES)}, or a CSV in torch's compute-only "
                               f"format (default: %(default)s)")
    pipeline.add_argument("--stages-per-rank", type=_at_least_one,
                          help="model chunks per rank (default: 2 for interleaved and V "
                               "hints, else 1)")
    pipeline.add_argument("--layout", choices=("loop", "v"),
                          help=f"stage placement for the {' and '.join(RULE_NAMES)} rules "
                               "(default: loop); other hints fix their own (V for "
                               "ZBVZeroBubble and DualPipeV, else loop)")

    timings = parser.add_argument_group("timings")
    timings.add_argument("--workload", choices=WORKLOADS,
                         help=f"seeded timing model (default: {DEFAULT_WORKLOAD})")
    timings.add_argument("--seeds", type=_at_least_one,
                         help=f"simulate the steps drawn with seeds 0..N-1 (default: "
                              f"{DEFAULT_SEEDS})")
    timings.add_argument("--replay", metavar="TIMINGS_JSON",
                         help="simulate one measured step instead of a workload: a timings "
                              "file from python -m rrfp.sim.replay (not with --workload, "
                              "--seeds or the workload knobs)")

    rrfp = parser.add_argument_group("RRFP")
    rrfp.add_argument("--limit", type=_limit, default="hint",
                      help=f"buffer limit, as ScheduleRRFP's buffer_limit: {BUFFER_LIMIT_HELP} "
                           "(default: %(default)s)")
    rrfp.add_argument("--policy", type=_policy,
                      help=f"{policy_help(SIM_POLICIES)} (clairvoyant, informed, "
                           "foresight-critical and informed-critical: the simulator's "
                           "yardsticks, which see what no rank can)")
    rrfp.add_argument("--launch-depth", type=_launch_depth, default=DEFAULT_LAUNCH_DEPTH,
                      help=f"{LAUNCH_DEPTH_HELP} (default: %(default)s, as ScheduleRRFP)")
    rrfp.add_argument("--launch-cost", type=_non_negative, default=0.0,
                      help="CPU time of each launch, in forwards; the fixed schedule pays "
                           "it too (default: %(default)s)")
    rrfp.add_argument("--sizes-known", action="store_true",
                      help="tell RRFP's ranks each step's microbatch sizes (never the "
                           "durations), as ScheduleRRFP is where they are given: the "
                           f"workloads {', '.join(SIZE_WORKLOADS)} and replay files with "
                           "sizes have them; the policies predict durations from them by "
                           "what earlier steps measured")

    charts = parser.add_argument_group("charts (need the [sim] extra: matplotlib)")
    charts.add_argument("--plot", metavar="PNG",
                        help="write fixed vs RRFP timelines of the first seed to this file")
    charts.add_argument("--sweep", metavar="PNG",
                        help=f"write speedup and memory for the limits {SWEEP_LIMITS} to "
                             "this file")

    knobs = parser.add_argument_group("workload knobs (the workload each shapes in brackets)")
    for f in dataclasses.fields(WorkloadParams):
        knobs.add_argument(_option(f.name), type=type(f.default),
                           help=f"{f.metadata['help']} (default: {f.default})")
    return parser


def _stages_per_rank(args: argparse.Namespace) -> int:
    return args.stages_per_rank or (2 if args.hint.lower() in TWO_CHUNK_HINTS else 1)


def _replayed(parser: argparse.ArgumentParser, args: argparse.Namespace) -> Timing | None:
    """The replayed timings (None without --replay); ``--pp`` and ``--microbatches``
    default to theirs, and to ``DEFAULT_PP`` and ``DEFAULT_MICROBATCHES`` otherwise."""
    timing = None
    if args.replay:
        if not os.path.isfile(args.replay):
            parser.error(f"--replay {args.replay}: no such file; write one from a run's trace "
                         f"with python -m rrfp.sim.replay TRACE_JSON -o {args.replay}")
        try:
            timing = Timing.load(args.replay)
        except ValueError as e:
            parser.error(f"--replay {args.replay}: {e}")
        per_rank = _stages_per_rank(args)
        if args.pp is None and timing.num_stages % per_rank:
            parser.error(f"--replay {args.replay}: its {timing.num_stages} stages do not make "
                         f"{per_rank} per rank: give --pp and --stages-per-rank")
    args.pp = args.pp or (timing.num_stages // _stages_per_rank(args) if timing else DEFAULT_PP)
    args.microbatches = args.microbatches or (timing.n_microbatches if timing
                                              else DEFAULT_MICROBATCHES)
    return timing


def _hint(parser: argparse.ArgumentParser, args: argparse.Namespace) -> Hint:
    name = args.hint.lower()
    per_rank = _stages_per_rank(args)
    layout = args.layout or ("v" if name in V_HINTS else "loop")
    try:
        hint = build_hint(args.hint, num_ranks=args.pp, num_stages=args.pp * per_rank,
                          n_microbatches=args.microbatches, layout=layout)
    except ValueError as e:
        parser.error(str(e))
    try:
        resolve_buffer_limits(args.limit, hint, fixed_order=args.policy == "fixed")
    except ValueError as e:
        parser.error(f"--limit {args.limit}: {e}")
    if args.layout and args.layout != hint.layout:
        parser.error(f"--layout {args.layout} does not fit hint {hint.name}, which places its "
                     f"stages in a {hint.layout} layout: drop --layout (only the "
                     f"{' and '.join(RULE_NAMES)} rules take a placement)")
    return hint


def _fixed_name(hint: Hint) -> str:
    """The fixed schedule a hint is compared with: itself, or a rule's reference schedule
    (a rule has no fixed form of its own)."""
    if hint.policy == "hint":
        return hint.name
    per_rank = hint.num_stages // hint.num_ranks
    reference = rule_reference(hint.policy, hint.layout, per_rank).__name__
    return f"{reference.removeprefix('Schedule')} (the {hint.name} rule's reference)"


def _workload(parser: argparse.ArgumentParser, args: argparse.Namespace,
              hint: Hint, replayed: Timing | None) -> str | Timing:
    """The workload name, or the replayed timings."""
    if replayed is None:
        return args.workload or DEFAULT_WORKLOAD
    workload_options = [_option(name) for name in ("workload", "seeds")
                        + tuple(f.name for f in dataclasses.fields(WorkloadParams))
                        if getattr(args, name) is not None]
    if workload_options:
        parser.error(f"--replay simulates one measured step, so {', '.join(workload_options)} "
                     "would be ignored: drop them, or drop --replay to simulate a workload")
    try:
        return timing_for(hint, replayed, seed=0)
    except ValueError as e:
        parser.error(f"--replay {args.replay}: {e}")


def _make_chart_folders(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    charts = [path for path in (args.plot, args.sweep) if path]
    if charts and importlib.util.find_spec("matplotlib") is None:
        parser.error("--plot and --sweep draw with matplotlib: pip install -e '.[sim]'")
    for path in charts:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)


def main(argv: list[str] | None = None) -> None:
    parser = build_parser()
    args = parser.parse_args(argv)
    replayed = _replayed(parser, args)
    hint = _hint(parser, args)
    workload = _workload(parser, args, hint, replayed)
    _make_chart_folders(parser, args)
    params = WorkloadParams(**{f.name: getattr(args, f.name)
                               for f in dataclasses.fields(WorkloadParams)
                               if getattr(args, f.name) is not None})
    seeds = 1 if args.replay else args.seeds or DEFAULT_SEEDS
    label = f"replay {args.replay}" if args.replay else f"workload {workload}"

    start = time.perf_counter()
    rows = [compare(hint, workload, seed, limit=args.limit, policy=args.policy, params=params,
                    launch_depth=args.launch_depth, launch_cost=args.launch_cost,
                    sizes_known=args.sizes_known)
            for seed in range(seeds)]
    elapsed = time.perf_counter() - start
    print(f"{hint.name}: {counted(args.pp, 'rank')} x "
          f"{counted(hint.num_stages // args.pp, 'stage')} ({hint.layout}), "
          f"{counted(args.microbatches, 'microbatch')}, {label}, limit {args.limit!r}, "
          f"policy {rows[0].policy}, launch depth {args.launch_depth}, launch cost "
          f"{args.launch_cost}{', sizes known' if args.sizes_known else ''} (simulated)")
    # Replayed timings are in seconds, shown in ms; workloads in units of one mean forward.
    scale, unit = (1e3, " ms") if replayed else (1.0, "")
    print(f"{'seed':>4} {'fixed' + unit:>9} {'rrfp' + unit:>9} {'speedup':>8} "
          f"{'bound' + unit:>9} {'rrfp/bound':>10} {'fixed/bound':>11} {'memory':>7}")
    for r in rows:
        bound = r.bounds.tighter
        print(f"{r.seed:>4} {r.fixed.makespan * scale:9.2f} {r.rrfp.makespan * scale:9.2f} "
              f"{r.speedup:8.3f} {bound * scale:9.2f} {r.rrfp.makespan / bound:10.3f} "
              f"{r.fixed.makespan / bound:11.3f} {r.memory_ratio:6.2f}x")
    print("bound: the tighter of the critical path and the busiest rank's work plus its "
          "fill and drain; memory: most loaded rank's activations vs the fixed schedule's")
    speedups = [r.speedup for r in rows]
    print(f"speedup mean {statistics.mean(speedups):.3f}, min {min(speedups):.3f}, "
          f"max {max(speedups):.3f} ({elapsed:.2f} s for {seeds} seeds)")
    if args.plot:
        from rrfp.sim.plot import plot_timelines

        first = rows[0]
        plot_timelines({f"fixed {_fixed_name(hint)}": first.fixed,
                        f"RRFP ({first.policy}, limit {args.limit})": first.rrfp},
                       args.plot, title=f"{hint.name}, {label}, seed 0 (simulated)",
                       time_unit="seconds" if replayed else "forward = 1")
        print(f"wrote {args.plot}")
    if args.sweep:
        from rrfp.sim.plot import plot_tradeoff

        sweep = sweep_limits(hint, workload, seeds, policy=args.policy, params=params,
                             sizes_known=args.sizes_known)
        plot_tradeoff({label: sweep}, args.sweep,
                      title=f"{hint.name}, {args.pp} ranks, {args.microbatches} microbatches (simulated)")
        for limit, comparisons in sweep.items():
            print(f"limit {limit:>8}: speedup mean "
                  f"{statistics.mean(c.speedup for c in comparisons):.3f}, activation "
                  f"memory {statistics.mean(c.memory_ratio for c in comparisons):.2f}x the hint's")
        print(f"wrote {args.sweep}")


if __name__ == "__main__":
    main()
