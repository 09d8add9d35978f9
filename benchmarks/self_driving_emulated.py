"""Self-driving RRFP against torch's fixed 1F1B on an emulated device (4 ranks).

    python -m benchmarks.self_driving_emulated          # writes results/self_driving_emulated.md

Per family of ``rrfp.testing.self_driving_world`` (one that gains, one where a static
rule loses, one whose timings change regime half way), ``--rounds`` rounds, each running
torch's Schedule1F1B and then ScheduleRRFP with ``tune_within`` (a byte budget per rank)
over the same ``--steps`` steps: the throughput ratio over every step after the first
(the measuring and the in-run A/B's steps counted), every step's metered peak bytes
against the budget, the step at which each rank's setting changed, whether the gradients
were bitwise torch's in every step, and the decisions. The predictions run as in a job, in
a child process at ``nice 19``, so a decision lands when it is done, within ``--cpu-share``
of the host's CPU since the first step (default: no bound, labelled on the page: a run
of a hundred short emulated steps stands for the first minutes of a job whose 1% share,
``rrfp.advise.cost.CPU_SHARE``, pays for them; under 1% here no prediction would start in
the run); with ``--inline``
(a machine whose cores are busy with other work, where the child would get little CPU)
on the deciding rank at once, their time counted in its steps. Emulated device
time: the compute sleeps as a kernel would run; every figure is emulated.
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import time

from benchmarks.pages import write_page
from rrfp.advise.cost import CPU_SHARE
from rrfp.core.settings import parse_buffer_limit
from rrfp.testing.self_driving_world import self_driving_world
from rrfp.testing.worlds import run_local_world

FAMILIES = ("gains", "static-loses", "regime-change")
BUDGET = "24KiB"
"""Per rank: twice what the fixed schedule's busiest rank holds here (12 KiB)."""


def first_change(values: list) -> int | None:
    return next((i for i in range(1, len(values)) if values[i] != values[i - 1]), None)


def family_rows(family: str, rounds: list[list[dict]], budget_bytes: int) -> list[str]:
    rows = []
    for number, ranks in enumerate(rounds, start=1):
        ratio = (sum(ranks[0]["fixed_times"][1:]) / sum(ranks[0]["times"][1:]))
        peak = max(max(b for b in r["bytes"] if b is not None) for r in ranks)
        switched = sorted({first_change(r["limits"]) for r in ranks}, key=str)
        decisions = ranks[0]["decisions"]
        same = all(r["decisions"] == decisions for r in ranks)
        rows.append(
            f"| {family} | {number} | {ratio:.3f} | {peak} / {budget_bytes} | "
            f"{', '.join(map(str, switched))} | {'yes' if same else 'NO'} | "
            f"{'yes' if all(all(r['bitwise']) for r in ranks) else 'NO'} | "
            + "<br>".join(decisions or ["(none)"]) + " |")
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=120)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--base-ms", type=float, default=5.0)
    parser.add_argument("--families", default=",".join(FAMILIES))
    parser.add_argument("--inline", action="store_true",
                        help="predict on the deciding rank at once (its steps pay for it)")
    parser.add_argument("--cpu-share", type=float, default=math.inf,
                        help="the share of the host's CPU the child predictions may take "
                        "(default: %(default)s, no bound; a job's: rrfp.advise.cost.CPU_SHARE)")
    parser.add_argument("--out", default="self_driving_emulated.md")
    args = parser.parse_args(argv)
    start = time.time()
    budget_bytes = parse_buffer_limit(BUDGET).budget_bytes
    lines, ratios = [], []
    for family in args.families.split(","):
        rounds = [run_local_world(args.ranks, self_driving_world, family, args.steps, BUDGET,
                                  seed, args.base_ms / 1000,
                                  "advisor" if args.inline else None, args.cpu_share,
                                  timeout=1800)
                  for seed in range(args.rounds)]
        ratios += [sum(r[0]["fixed_times"][1:]) / sum(r[0]["times"][1:]) for r in rounds]
        lines += family_rows(family, rounds, budget_bytes)
        print(family, "done", flush=True)
    command = " ".join(["python -m benchmarks.self_driving_emulated",
                        *(sys.argv[1:] if argv is None else argv)])
    page = [
        "# Self-driving RRFP against torch's fixed 1F1B (emulated device, "
        f"{args.ranks} ranks)", "",
        f"Regenerate with `{command}` ({(time.time() - start) / 60:.0f} min). The method: "
        "`benchmarks/self_driving_emulated.py`'s docstring. Budget "
        f"`tune_within={BUDGET!r}` per rank; {args.steps} steps per run, "
        f"{4 * args.ranks} microbatches, {args.base_ms:g} ms per emulated action. "
        "*throughput*: torch's step time over the mode's, summed over every step after the "
        "first; *peak bytes*: the most any rank's saved activations held in any step "
        "(metered on the tensors every step) / the budget; *switched at*: the step at which "
        "each rank's microbatch limit first changed (one value: every rank at the same step); "
        "*same*: every rank logged the same decisions; *bitwise*: every step's gradients "
        "equal torch's on every rank. Predictions: "
        + ("inline, on the deciding rank, their time counted in its steps (`--inline`)."
           if args.inline else "in a child process at `nice 19`, as in a job, "
           + ("their CPU not bounded by a share of the host's (`--cpu-share inf`; a job's "
              f"share is {CPU_SHARE:.0%}, which on these short emulated runs would start "
              "none)." if math.isinf(args.cpu_share)
              else f"within {args.cpu_share:.1%} of the host's CPU since the first step.")),
        "",
        f"**Lowest throughput: {min(ratios):.3f}x the fixed schedule.**", "",
        "| family | round | throughput | peak bytes / budget | switched at | same | bitwise | "
        "decisions (on every rank) |", "|---|---|---|---|---|---|---|---|", *lines]
    print("wrote", write_page(args.out, page))


if __name__ == "__main__":
    main()
