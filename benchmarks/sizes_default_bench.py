"""The default policy told the microbatch sizes against the same policy not told them
(simulated).

    python -m benchmarks.sizes_default_bench --label after     # this checkout's rule
    python -m benchmarks.sizes_default_bench --page            # results/sizes_default.md

Each family is a 1F1B pipeline at ``hint+2`` (the default policy there is ``critical``, the
one that reads sizes) whose step timings come from ``rrfp.sim.families``: an image-driven
stage (first, middle or last; mean-balanced or the bottleneck; its cost predicted by the
image count or only loosely) beside constant stages, and the size-driven workloads of
``rrfp.sim.workloads``. Per seed, ``--steps`` steps run in order under each of the two
settings, the policy learning from its own earlier steps (``rrfp.sim.selfdriving.predict``):
the throughput over the fixed schedule's, every step counted. ``--label`` names the rule
measured (run it in another checkout to compare rules; the families and this file are the
harness, copied in); ``--page`` writes every label's JSON as one page. Every figure is
simulated (time unit: one mean forward).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from collections.abc import Callable
from multiprocessing import Pool

from benchmarks.pages import result_path, write_page
from rrfp.core.hints import build_hint
from rrfp.core.tuning import Candidate
from rrfp.sim import selfdriving
from rrfp.sim.families import drawn, sized_stage
from rrfp.sim.workloads import Timing

PIPELINES = ((4, 16, 20), (8, 32, 10))
"""(ranks, microbatches, seeds) of the pipelines run (one stage per rank)."""
BUDGET = "hint+2"
WORSE = 1e-3
"""A seed counts as slower told the sizes where its speedup falls by more than this."""

Timings = Callable[[int, int], list[Timing]]


def families(ranks: int, microbatches: int) -> dict[str, Timings]:
    """The families of one pipeline, by name."""
    s, m = ranks, microbatches
    return {
        "encoder-balanced": sized_stage(s, m, stage=0, balanced=True),
        "encoder-bottleneck": sized_stage(s, m, stage=0, balanced=False),
        "encoder-bottleneck-loose": sized_stage(s, m, stage=0, balanced=False, size_noise=0.4),
        "middle-balanced": sized_stage(s, m, stage=s // 2, balanced=True),
        "middle-bottleneck": sized_stage(s, m, stage=s // 2, balanced=False),
        "last-bottleneck": sized_stage(s, m, stage=s - 1, balanced=False),
        **{name: drawn(name, s, m) for name in (
            "documents", "documents-latency", "multimodal-unpacked",
            "multimodal-unpacked-latency")},
    }


def _job(args: tuple[int, int, str, int, int]) -> tuple[str, str, int, float, float]:
    ranks, microbatches, name, seed, steps = args
    hint = build_hint("1F1B", num_ranks=ranks, num_stages=ranks, n_microbatches=microbatches)
    timings = families(ranks, microbatches)[name](seed, steps)
    told, blind = selfdriving.predict(hint, timings, [Candidate(BUDGET, None, True),
                                                      Candidate(BUDGET, None, False)])
    return f"{ranks}x{microbatches}", name, seed, told.speedup, blind.speedup


def measure(label: str, most_seeds: int | None, steps: int, processes: int) -> str:
    jobs = [(r, m, name, seed, steps) for r, m, seeds in PIPELINES for name in families(r, m)
            for seed in range(min(seeds, most_seeds or seeds))]
    start = time.monotonic()
    rows = []
    with Pool(processes) as pool:
        for row in pool.imap_unordered(_job, jobs):
            rows.append(row)
            print(f"{len(rows)} of {len(jobs)}: {row[0]} {row[1]} seed {row[2]}", flush=True)
    rows.sort()
    result = {"label": label, "steps": steps,
              "seconds": round(time.monotonic() - start),
              "rows": [dict(zip(("pipeline", "family", "seed", "told", "not_told"), row))
                       for row in rows]}
    path = result_path(f"sizes_default_{label}.json")
    with open(path, "w") as f:
        json.dump(result, f, indent=1)
    return path


def _table(result: dict) -> list[str]:
    lines = ["| pipeline | family | seeds | told: mean / lowest | not told: mean / lowest "
             "| told slower on |",
             "|---|---|---:|---:|---:|---:|"]
    groups: dict[tuple[str, str], list[dict]] = {}
    for row in result["rows"]:
        groups.setdefault((row["pipeline"], row["family"]), []).append(row)
    for (pipeline, family), rows in groups.items():
        told = [r["told"] for r in rows]
        blind = [r["not_told"] for r in rows]
        slower = sum(r["told"] < r["not_told"] - WORSE for r in rows)
        lines.append(f"| {pipeline} | {family} | {len(rows)} "
                     f"| {statistics.mean(told):.3f} / {min(told):.3f} "
                     f"| {statistics.mean(blind):.3f} / {min(blind):.3f} "
                     f"| {slower} of {len(rows)} |")
    return lines


def page(labels: list[str]) -> str:
    lines = ["# The default told the microbatch sizes, and not told them (simulated)", "",
             "Made by `benchmarks/sizes_default_bench.py` (its docstring says how):", "",
             "```", *(f"python -m benchmarks.sizes_default_bench --label {label}"
                      for label in labels),
             "python -m benchmarks.sizes_default_bench --page", "```", "",
             f"1F1B, one stage per rank, `buffer_limit={BUDGET!r}`, the default policy "
             "(`critical`). Each cell: the throughput over the fixed schedule's over every "
             "step of a seed's run, mean over seeds and the lowest seed. *told slower on*: "
             f"the seeds whose speedup told the sizes is below the one not told by more than "
             f"{WORSE}. Time unit: one mean forward; every figure is simulated."]
    for label in labels:
        with open(result_path(f"sizes_default_{label}.json")) as f:
            result = json.load(f)
        lines += ["", f"## {label}", "",
                  f"{result['steps']} steps per seed, {result['seconds']} s.", "",
                  *_table(result)]
    return write_page("sizes_default.md", lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--label", help="measure this checkout's rule under this name")
    parser.add_argument("--seeds", type=int, help="at most this many seeds per pipeline "
                        "(default: each pipeline's own, PIPELINES)")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--processes", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--page", nargs="*", metavar="LABEL",
                        help="write the page from these labels' results (default: before, "
                             "after)")
    args = parser.parse_args()
    if args.label:
        print(measure(args.label, args.seeds, args.steps, args.processes))
    if args.page is not None:
        print(page(args.page or ["before", "after"]))


if __name__ == "__main__":
    main()
