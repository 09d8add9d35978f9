"""Dispatch overhead of two versions of rrfp, alternating in one run.

    python -m benchmarks.overhead_ab --before 6802122 [--rounds 5]

Checks the ``--before`` commit out into a temporary worktree and runs the same runtime
benchmark case (``benchmarks.runtime_bench``: 1F1B, emulated asynchronous device, A/B pairs
of the fixed order and RRFP) with that tree's code and with this tree's, alternating (each
first in every other round), each in fresh processes. Reports each run's dispatch overhead:
the median over ranks and steps of the time per action the rank's thread spent choosing
actions and keeping the books (``StepStats.overhead_per_action``, on the wall clock), the
same region's CPU time per action (``benchmarks.overhead_probe``), and per case the median
of the rounds' ratios now / before of each. Writes
benchmarks/results/dispatch_overhead.md.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import shutil
import tempfile
import time

from benchmarks.pages import write_page

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CASES = (("4", "jitter", "hint"), ("4", "jitter", "hint+2"))
"""(ranks, workload, limit) of the runtime benchmark cases measured."""
PROBE = os.path.join(ROOT, "benchmarks", "overhead_probe.py")

_MEASURE = """
import json, sys
from benchmarks.runtime_bench import Config, run
pp, workload, limit = sys.argv[1:4]
result = run(Config(int(pp), workload, limit, pairs=int(sys.argv[4])))
print(json.dumps({"overhead_us": result["overhead_us"], "ratio": result["ratio_median"]}))
"""


def measure(tree: str, case: tuple[str, str, str], pairs: int) -> dict[str, float]:
    """One run of ``case`` with the code of ``tree``: the stats' dispatch overhead
    (``overhead_us``, wall clock) and, by ``benchmarks.overhead_probe``, the decision
    region's CPU time per action (``cpu_us``), each the median over ranks."""
    with tempfile.TemporaryDirectory(prefix="rrfp-probe-") as probe:
        site, out = os.path.join(probe, "site"), os.path.join(probe, "out")
        os.makedirs(site)
        os.makedirs(out)
        shutil.copy(PROBE, os.path.join(site, "sitecustomize.py"))
        env = {**os.environ, "PYTHONPATH": os.pathsep.join((site, tree)), "RRFP_PROBE_DIR": out}
        with subprocess.Popen([sys.executable, "-c", _MEASURE, *case, str(pairs)], cwd=tree,
                              env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True) as run:
            stdout, stderr = run.communicate(timeout=900)
        if run.returncode:
            raise RuntimeError(f"the run with {tree} failed:\n{stderr[-3000:]}")
        ranks = []
        # The run's own process also drives step loops: the simulator's prediction.
        for name in set(os.listdir(out)) - {f"{run.pid}.json"}:
            with open(os.path.join(out, name)) as f:
                ranks.append(json.load(f))
    if len(ranks) != int(case[0]):
        raise RuntimeError(f"the probe heard from {len(ranks)} ranks of {case[0]}")
    result = json.loads(stdout.strip().splitlines()[-1])
    result["cpu_us"] = statistics.median(r["cpu_s"] / r["launches"] for r in ranks) * 1e6
    return result


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
                runs: dict[str, list[dict[str, float]]] = {"before": [], "now": []}
                for round_ in range(args.rounds):
                    # Each tree runs first in every other round: a run's speed depends on
                    # the one before it (caches, the fork server's pages).
                    order = (("before", before), ("now", ROOT))
                    for name, tree in order if round_ % 2 == 0 else order[::-1]:
                        runs[name].append(measure(tree, case, args.pairs))
                rows.append((case, runs))
                print(case, {name: [(round(r["overhead_us"]), round(r["cpu_us"])) for r in rs]
                             for name, rs in runs.items()}, flush=True)
        finally:
            subprocess.run(["git", "-C", ROOT, "worktree", "remove", "--force", before],
                           check=False, capture_output=True)
    lines = [
        "# Dispatch overhead before and after (emulated asynchronous device)", "",
        f"Regenerate with `python -m benchmarks.overhead_ab --before {args.before} --rounds "
        f"{args.rounds} --pairs {args.pairs}` ({time.time() - started:.0f} s; 1-minute load "
        f"{load:.1f} at the start, on a 2-core machine). Each run: `benchmarks.runtime_bench` "
        "on the case named, in fresh processes, with the code of `--before` and with this "
        "tree's, alternating (each first in every other round). Two figures per run, each "
        "the median over ranks, in microseconds per action: *wall*, what the stats report "
        "(`StepStats.overhead_per_action`: the time the rank's thread spent choosing "
        "actions and keeping the books, on the wall clock, waits for the GIL or a CPU "
        "included), and *CPU*, the same region's CPU time on that thread, measured from "
        "outside either tree's code by `benchmarks/overhead_probe.py`. The same work costs "
        "a run more or less time from one run to the next on a shared machine, so each "
        "round's two runs, back to back, give a ratio now / before; the ratio columns give "
        "the median of those ratios and their range.", "",
        "| ranks | workload | limit | wall: median before / now (us) | wall now / before | "
        "CPU: median before / now (us) | CPU now / before |",
        "|---|---|---|---|---|---|---|",
    ]
    for (pp, workload, limit), runs in rows:
        cells = []
        for key in ("overhead_us", "cpu_us"):
            before_runs = [r[key] for r in runs["before"]]
            now_runs = [r[key] for r in runs["now"]]
            ratios = [now / before for now, before in zip(now_runs, before_runs)]
            cells.append(f"{statistics.median(before_runs):.0f} / "
                         f"{statistics.median(now_runs):.0f} | "
                         f"{statistics.median(ratios):.3f} ({min(ratios):.2f}-{max(ratios):.2f})")
        lines.append(f"| {pp} | {workload} | {limit} | {' | '.join(cells)} |")
    lines += ["", "Each run, before and now (wall, CPU):", ""]
    for (pp, workload, limit), runs in rows:
        lines.append(f"- {pp} ranks, {workload}, `{limit}`: " + "; ".join(
            f"{name} " + ", ".join(f"{r['overhead_us']:.0f}/{r['cpu_us']:.0f}" for r in rs)
            for name, rs in runs.items()))
    print(f"wrote {write_page('dispatch_overhead.md', lines)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
