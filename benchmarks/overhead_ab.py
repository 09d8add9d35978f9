"""Dispatch overhead of two versions of rrfp, alternating in one run.

    python -m benchmarks.overhead_ab --before 6802122 [--rounds 5]

Checks the ``--before`` commit out into a temporary worktree and runs the same runtime
benchmark case (``benchmarks.runtime_bench``: 1F1B, emulated asynchronous device, A/B pairs
of the fixed order and RRFP) with that tree's code and with this tree's, alternating (each
first in every other round), each in fresh processes. Reports each run's dispatch overhead:
the median over ranks and steps of the time per action the rank's thread spent choosing
actions and keeping the books (``StepStats.overhead_per_action``, on the wall clock), and
per case the median of the rounds' ratios now / before. Writes
benchmarks/results/dispatch_overhead.md.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

from benchmarks.pages import write_page

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CASES = (("4", "jitter", "hint"), ("4", "jitter", "hint+2"))
"""(ranks, workload, limit) of the runtime benchmark cases measured."""

_MEASURE = """
import json, sys
from benchmarks.runtime_bench import Config, run
pp, workload, limit = sys.argv[1:4]
result = run(Config(int(pp), workload, limit, pairs=int(sys.argv[4])))
print(json.dumps({"overhead_us": result["overhead_us"], "ratio": result["ratio_median"]}))
"""


def measure(tree: str, case: tuple[str, str, str], pairs: int) -> dict:
    """One run of ``case`` with the code of ``tree``."""
    env = {**os.environ, "PYTHONPATH": tree}
    out = subprocess.run([sys.executable, "-c", _MEASURE, *case, str(pairs)], cwd=tree,
                         env=env, capture_output=True, text=True, timeout=900, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--before", required=True, help="the commit to compare against")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--pairs", type=int, default=3, help="A/B pairs per run")
    args = parser.parse_args(argv)
    started, load = time.time(), os.getloadavg()[0]
    rows = []
    with tempfile.TemporaryDirectory(prefix="rrfp-before-") as parent:
        before = os.path.join(parent, "tree")
        subprocess.run(["git", "-C", ROOT, "worktree", "add", "--detach", before, args.before],
                       check=True, capture_output=True)
        try:
            for case in CASES:
                runs: dict[str, list[float]] = {"before": [], "now": []}
                for round_ in range(args.rounds):
                    # Each tree runs first in every other round: a run's speed depends on
                    # the one before it (caches, the fork server's pages).
                    order = (("before", before), ("now", ROOT))
                    for name, tree in order if round_ % 2 == 0 else order[::-1]:
                        runs[name].append(measure(tree, case, args.pairs)["overhead_us"])
                rows.append((case, runs))
                print(case, {k: [round(v) for v in vs] for k, vs in runs.items()}, flush=True)
        finally:
            subprocess.run(["git", "-C", ROOT, "worktree", "remove", "--force", before],
                           check=False, capture_output=True)
    lines = [
        "# Dispatch overhead before and after (emulated asynchronous device)", "",
        f"Regenerate with `python -m benchmarks.overhead_ab --before {args.before} --rounds "
        f"{args.rounds} --pairs {args.pairs}` ({time.time() - started:.0f} s; 1-minute load "
        f"{load:.1f} at the start, on a 2-core machine). Each run: `benchmarks.runtime_bench` "
        "on the case named, in fresh processes, with the code of `--before` and with this "
        "tree's, alternating; the figure is the run's median over ranks and steps of the "
        "time per action the rank's thread spent choosing actions and keeping the books "
        "(`StepStats.overhead_per_action`, on the wall clock: waits for the GIL or a CPU "
        "included), in microseconds. The same work costs a run more or less CPU time "
        "from one run to the next on a shared machine, so each round's two runs, back to "
        "back and in alternating order, give a ratio now / before; the last column is the "
        "median of those ratios and their range.", "",
        "| ranks | workload | limit | before (each run) | now (each run) | median before | "
        "median now | now / before, per round: median (range) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for (pp, workload, limit), runs in rows:
        ratios = [now / before for now, before in zip(runs["now"], runs["before"])]
        lines.append(
            f"| {pp} | {workload} | {limit} | {', '.join(f'{v:.0f}' for v in runs['before'])} | "
            f"{', '.join(f'{v:.0f}' for v in runs['now'])} | "
            f"{statistics.median(runs['before']):.0f} | {statistics.median(runs['now']):.0f} | "
            f"{statistics.median(ratios):.3f} ({min(ratios):.2f}-{max(ratios):.2f}) |")
    print(f"wrote {write_page('dispatch_overhead.md', lines)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
