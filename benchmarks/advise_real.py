"""The advisor on real compute: torchtitan llama3 debug, CPU, 2 processes x 1 thread.

    python -m benchmarks.advise_real              # results/advise_real_<torchtitan>.md
    python -m benchmarks.advise_real --cost       # results/advise_cost_<torchtitan>.md

**Measured, real compute** (no emulated time), with the torchtitan this Python has (0.2.2:
the TOML job, 0.3: the config function), the main job as it ships (PP 2 x 2 stages, the
bare ``RRFP`` name: the Interleaved1F1B hint, 8 microbatches of 1 x 128 tokens).

Predictions: a run at the default (``buffer_limit="hint"``, the default policy) of
``--steps`` steps with traces; ``rrfp.advise`` reads its folder and predicts each setting.
Measurements: per setting a run with the in-run A/B (``rrfp.fixed_every=2``): every
second step runs the hint's fixed order; a pair's measured speedup is that step's time
over the mean of the RRFP steps beside it (step time: the slowest rank's schedule step,
``StepStats.step_time``); its median over the pairs stands beside the prediction.

``--cost``: the advisor's price (``rrfp.advise`` on against off), in alternating rounds (on
then off, then off then on): each run's median tokens/s over steps 5 to the last; where
the run is long enough for its first verdict to come in the run, within each pair of
runs, the steps that ran beside the first verdict's child process against the steps after
it (so that a run's own level, which varies more from run to run than the advisor could
cost, cancels out); and the run's own account of it (its summary's ``advisor cost`` line:
the main thread's bookkeeping per step, the child processes' CPU seconds).
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import time

from benchmarks.pages import write_page
from benchmarks.titan_runs import run_job, STEP_LINE, tokens_per_second, version_label
from rrfp.advise import ab_speedups, advise, read_run
from rrfp.advise.predict import predict, replay, Setting
from torchtitan_ext.common.run_advice import FIRST_VERDICT_AFTER

SETTINGS = [("hint", None), ("hint+1", None), ("hint+1", "hint"), ("hint+2", None),
            ("hint+2", "hint"), ("busiest", None)]
"""(buffer_limit, policy; None: the default)."""
OUT = os.path.join("outputs", "advise_real")
FIRST_TIMED_STEP = 5
AT_THE_END = "rrfp: the verdict comes at the end of the run"
COST_LINE = re.compile(r"advisor cost: ([\d.]+) ms per step on this rank's main thread; "
                       r"([\d.]+) s of CPU")


def busiest(step) -> float:
    """The step's busiest rank's device time (seconds)."""
    return max(meta["device_busy_time"] for meta in step.ranks.values())


def predicted_vs_measured(steps: int, pairs: int) -> list[str]:
    started = time.time()
    out = os.path.join(OUT, "default")
    run_job(out, "--rrfp.trace_folder", "traces", steps=steps)
    run, _ = read_run(out)
    advice = advise(run, out)
    baseline = replay(run)
    rows = []
    for buffer_limit, policy in SETTINGS:
        predicted = predict(run, Setting(run.hint.name, buffer_limit, policy), baseline)
        load = os.getloadavg()[0]
        folder = os.path.join(OUT, f"{buffer_limit}-{policy or 'default'}")
        run_job(folder, "--rrfp.trace_folder", "traces", "--rrfp.fixed_every", "2",
                "--rrfp.buffer_limit", buffer_limit, *(["--rrfp.policy", policy] if policy else []),
                steps=2 * pairs + 1)
        paired = read_run(folder)[0].steps
        measured = ab_speedups([(s.fixed_order, s.step_time) for s in paired])
        normalized = ab_speedups([(s.fixed_order, s.step_time / busiest(s)) for s in paired])
        rows.append((buffer_limit, policy, predicted, measured, normalized, load))
        print(f"{buffer_limit} {predicted.policy}: predicted {predicted.speedup:.3f}x, measured "
              f"{statistics.median(measured):.3f}x over {len(measured)} pairs, load {load:.1f}",
              flush=True)
    worst = max(abs(p.speedup - statistics.median(m)) for _, _, p, m, _, _ in rows)
    worst_normalized = max(abs(p.speedup - statistics.median(n)) for _, _, p, _, n, _ in rows)
    lines = [
        f"# The advisor's predictions vs measurements, real compute (torchtitan {version_label()}, "
        "llama3 debug, CPU)",
        "",
        f"Regenerate with `python -m benchmarks.advise_real --steps {steps} --pairs {pairs}` "
        f"under torchtitan {version_label()} ({time.time() - started:.0f} s here; the module "
        f"docstring has the method). Predicted: `rrfp.advise` on {len(run.steps)} steps of a "
        f"run at the default (`buffer_limit='hint'`, policy {run.policy}); measured: the "
        f"in-run A/B (`rrfp.fixed_every=2`), {pairs} pairs per setting, median (min-max) of "
        f"fixed step time / the RRFP steps' beside it. Machine: {os.cpu_count()} CPUs shared "
        "with other jobs (load: the 1-minute load average before the setting's run); on a "
        "loaded machine a step's time varies far more than any setting changes it.",
        "",
        f"**Largest difference, predicted vs measured median: {worst:.3f}** (the issue's "
        f"bound for real compute: 0.05); per unit of compute: {worst_normalized:.3f}.",
        "",
        "*Per unit of compute*: the same pairs, each step's time divided by its busiest "
        "rank's device time first (`StepStats.device_busy_time`): on a shared machine a step's "
        "compute itself runs up to 3x slower than its neighbour's, which no schedule "
        "causes; this column takes that out and keeps how well the order used the compute.",
        "",
        "| buffer_limit | policy | predicted (steps' range) | measured (pairs' range) | "
        "difference | measured per unit of compute | difference | load |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for buffer_limit, policy, predicted, measured, normalized, load in rows:
        median, per_compute = statistics.median(measured), statistics.median(normalized)
        lines.append(
            f"| `{buffer_limit}` | {predicted.policy}{'' if policy else ' (default)'} "
            f"| {predicted.speedup:.3f}x ({min(predicted.speedups):.3f}-{max(predicted.speedups):.3f}) "
            f"| {median:.3f}x ({min(measured):.3f}-{max(measured):.3f}) "
            f"| {median - predicted.speedup:+.3f} "
            f"| {per_compute:.3f}x ({min(normalized):.3f}-{max(normalized):.3f}) "
            f"| {per_compute - predicted.speedup:+.3f} | {load:.1f} |")
    lines += ["", "The advisor on the default run:", "", *[f"    {line}" for line in advice.table(12)],
              "", f"    {advice.verdict()}"]
    return lines


def child_steps(out: str) -> range | None:
    """The steps that ran while the first verdict's child process did: from the one after
    it started to the last logged before its line (None: no first verdict in ``out``)."""
    at = out.find(f"(from steps 2-{FIRST_VERDICT_AFTER + 1})")
    if at < 0:
        return None
    logged = STEP_LINE.findall(out[:at])
    return range(FIRST_VERDICT_AFTER + 2, int(logged[-1][0]) + 1) if logged else None


def within_run(on: dict[int, float], off: dict[int, float], during: range) -> float:
    """Tokens/s while the child ran over after it, in the run with the advisor, against
    the same steps' in the run without (each run's own level cancels out)."""
    # The step that logged the verdict may have run beside the child's end: left out.
    after = range(during.stop + 1, max(on) + 1)

    def level(tps: dict[int, float], steps: range) -> float:
        return statistics.median(tps[s] for s in steps)
    return (level(on, during) / level(on, after)) / (level(off, during) / level(off, after))


def cost(rounds: int, steps: int) -> list[str]:
    started = time.time()
    runs: dict[str, list[tuple[float, float]]] = {"on": [], "off": []}
    per_step: dict[str, list[dict[int, float]]] = {"on": [], "off": []}
    accounts, windows, at_the_end = [], [], 0
    for r in range(rounds):
        order = ("on", "off") if r % 2 == 0 else ("off", "on")
        for which in order:
            load = os.getloadavg()[0]
            out = run_job(os.path.join(OUT, f"cost-{which}"), "--rrfp.trace_folder", "",
                          "--rrfp.advise" if which == "on" else "--rrfp.no-advise", steps=steps)
            tps = tokens_per_second(out)
            per_step[which].append(tps)
            runs[which].append((statistics.median(tps[s] for s in range(FIRST_TIMED_STEP, steps + 1)),
                                load))
            if which == "on":
                accounts.append(COST_LINE.search(out).groups())
                windows.append(child_steps(out))
                at_the_end += AT_THE_END in out
            print(f"round {r + 1} advise {which}: {runs[which][-1][0]:.0f} tokens/s (load {load:.1f})",
                  flush=True)
    within = [within_run(on, off, w) if w is not None and w.stop + 1 <= steps else None
              for on, off, w in zip(per_step["on"], per_step["off"], windows)]
    measured = [w for w in within if w is not None]
    ratios = [on[0] / off[0] for on, off in zip(runs["on"], runs["off"])]
    lines = [
        f"# The advisor's cost in the run (torchtitan {version_label()}, llama3 debug, CPU)",
        "",
        f"Regenerate with `python -m benchmarks.advise_real --cost --rounds {rounds} --steps "
        f"{steps}` under torchtitan {version_label()} ({time.time() - started:.0f} s here). "
        f"The main job, {steps} steps, traces off, `rrfp.advise` on and off in alternating "
        f"rounds; each run's median tokens/s over steps {FIRST_TIMED_STEP}-{steps}. The first "
        f"verdict came at the end of the run in {at_the_end} of the {rounds} runs with the "
        "advisor (the run too short for it to take at most 1% of the CPU time its remaining "
        "steps have); in the others its child process ran beside the steps after step 4. "
        "Machine: "
        f"{os.cpu_count()} CPUs shared with other jobs (in parentheses: the 1-minute load "
        "average before the run).",
        "",
        f"**Median ratio, advise on / off: {statistics.median(ratios):.3f}x** (min "
        f"{min(ratios):.3f}x, max {max(ratios):.3f}x).",
        "",
        "**While the verdict's child process runs**, within each run (a run's own level, which "
        "varies by up to 10% from run to run on this machine, cancels out): tokens/s of the "
        "steps that ran beside the child over the steps after it, in the run with the "
        "advisor, over the same ratio for the same steps in the run without: median "
        + (f"**{statistics.median(measured):.3f}x** (min {min(measured):.3f}x, max "
           f"{max(measured):.3f}x)." if measured else "- (no first verdict before the last step)."),
        "",
        "| round | on tokens/s | off tokens/s | on / off | steps beside the child | within the run "
        "| the run's account: main thread ms/step, child CPU s (both verdicts) |",
        "|---|---|---|---|---|---|---|",
    ]
    for i, (on, off, ratio, account, window, inside) in enumerate(
            zip(runs["on"], runs["off"], ratios, accounts, windows, within), 1):
        steps_beside = "-" if window is None else f"{window.start}-{window.stop - 1}"
        inside_text = "-" if inside is None else f"{inside:.3f}x"
        lines.append(f"| {i} | {on[0]:.0f} ({on[1]:.1f}) | {off[0]:.0f} ({off[1]:.1f}) | "
                     f"{ratio:.3f}x | {steps_beside} | {inside_text} | {account[0]}, {account[1]} |")
    return lines


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--cost", action="store_true", help="measure the advisor's cost")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--pairs", type=int, default=8, help="A/B pairs per setting")
    parser.add_argument("--rounds", type=int, default=5, help="cost rounds")
    args = parser.parse_args(argv)
    version = "_".join(version_label().split(".")[:2])
    if args.cost:
        page = write_page(f"advise_cost_{version}.md", cost(args.rounds, args.steps))
    else:
        page = write_page(f"advise_real_{version}.md", predicted_vs_measured(args.steps, args.pairs))
    print(f"wrote {page}")


if __name__ == "__main__":
    main()
