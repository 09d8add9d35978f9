"""Microbatch sizes at run time: RRFP told them vs not vs torch's fixed 1F1B, alternating.

    python -m benchmarks.sizes_ab [--rounds 5] [--unit-ms 15]

4 ranks on CPU/gloo, an emulated asynchronous device whose time follows each microbatch's
tokens on every stage (``rrfp.testing.sized_world``: 1F1B, 8 microbatches, ``hint+2``);
each round runs the three variants in alternating order. Per round, a variant's step time
is the slowest rank's; the page gives the medians over rounds, the speedups, and the
simulator's for the same durations. Writes benchmarks/results/sizes_ab.md.
"""

from __future__ import annotations

import argparse
import os
import statistics

from benchmarks.pages import write_page
from rrfp.testing.sized_world import (BACKWARD_PER_FORWARD, HINT, LIMIT, RANKS, simulated_step_times,
                                      sized_steps, TOKENS, VARIANTS)
from rrfp.testing.worlds import run_local_world


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--unit-ms", type=float, default=15.0,
                        help="emulated forward milliseconds per token")
    args = parser.parse_args(argv)
    unit_s = args.unit_ms / 1000
    load = os.getloadavg()[0]
    ranks = run_local_world(RANKS, sized_steps, args.rounds, unit_s, timeout=900)
    measured = {kind: statistics.median(max(r["times"][kind][i] for r in ranks)
                                        for i in range(args.rounds)) for kind in VARIANTS}
    simulated = simulated_step_times(unit_s, ranks[0]["predicted"])
    emulated = simulated_step_times(unit_s)
    sharing_ms = max(r["sharing_s"] / r["sized_steps"] for r in ranks) * 1000
    rows = [("sizes over no sizes", "no sizes", "sizes"), ("sizes over fixed", "fixed", "sizes"),
            ("no sizes over fixed", "fixed", "no sizes")]
    lines = [
        "# Microbatch sizes at run time (emulated device)", "",
        f"Regenerate with `python -m benchmarks.sizes_ab --rounds {args.rounds} --unit-ms "
        f"{args.unit_ms:g}` (load average {load:.1f} at the start). {HINT}, {RANKS} ranks on "
        f"CPU/gloo, {len(TOKENS)} microbatches of {', '.join(map(str, TOKENS))} tokens, "
        f"`buffer_limit=\"{LIMIT}\"`, default policy; on every stage a forward takes "
        f"{args.unit_ms:g} ms per token and a backward {BACKWARD_PER_FORWARD:g} times that "
        "(`rrfp.testing.sized_world`). RRFP told the sizes (`step(mb_sizes=...)`), RRFP not "
        "told them and torch's own schedule, in alternating order each round, after "
        "the learning rounds; a round's step time is its slowest rank's. *Simulated*: the "
        "simulator on the durations the runtime measured (each stage's fitted duration "
        "of each microbatch, launch and bookkeeping overheads included), without link "
        "latency; *simulated, emulated*: on the emulated durations alone.", "",
        "| step time (s) | measured, median | simulated | simulated, emulated |",
        "|---|---|---|---|",
        *(f"| {kind} | {measured[kind]:.3f} | {simulated[kind]:.3f} | {emulated[kind]:.3f} |"
          for kind in VARIANTS),
        "", "| speedup | measured | simulated | difference | simulated, emulated |",
        "|---|---|---|---|---|",
    ]
    for label, base, kind in rows:
        m, s = measured[base] / measured[kind], simulated[base] / simulated[kind]
        lines.append(f"| {label} | {m:.3f} | {s:.3f} | {m - s:+.3f} | "
                     f"{emulated[base] / emulated[kind]:.3f} |")
    lines += ["", f"Fit sharing (one store write and one read of the others' fits per sized "
              f"step): at most {sharing_ms:.2f} ms a step on any rank."]
    print("\n".join(lines))
    print(f"wrote {write_page('sizes_ab.md', lines)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
