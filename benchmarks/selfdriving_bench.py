"""Self-driving RRFP against the fixed schedule and the best single setting (simulated).

    python -m benchmarks.selfdriving_bench              # writes results/selfdriving.md
    python -m benchmarks.selfdriving_bench --seeds 2 --families documents,uniform --out x.md
    python -m benchmarks.selfdriving_bench --tune-hints --out selfdriving_hints.md

Each family of ``rrfp.sim.families`` runs ``--steps`` steps per seed under the tuner
(``rrfp.sim.selfdriving.run``, budget the family's), every step counted (the measuring
steps and the in-run A/B's fixed-order steps too). Per family: the run's throughput over
the fixed schedule's (mean and lowest seed), the best single setting within the budget
chosen with hindsight (``hindsight``), the share of its gain the mode captures, the step at
which the mode's last decision took effect, and the decisions taken. A plot per family
shows one seed's step times over the run: fixed, the best single setting, the mode.
``--tune-hints``: the candidates (the mode's and the best single setting's) include the
interchangeable hints (``Settings.tune_hints``), and the page counts the seeds whose best
single setting, and whose mode's decisions, rank by another hint.
Every figure is simulated (time unit: one mean forward).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from multiprocessing import Pool

from benchmarks.pages import result_path, write_page
from rrfp.core.hints import build_hint, Hint
from rrfp.sim import selfdriving
from rrfp.sim.families import FAMILIES, Family

FLOOR = 0.99
"""The mode's throughput must stay at or above this share of the fixed schedule's."""
CAPTURE = 0.90
"""On the families that gain, the share of the best single setting's gain to capture."""
NOTABLE_GAIN = 0.01
"""A best single setting below this gain leaves no share worth stating."""


def hint_of(family: Family) -> Hint:
    return build_hint(family.hint, num_ranks=family.num_ranks, num_stages=family.num_stages,
                      n_microbatches=family.n_microbatches,
                      layout="v" if family.num_stages > family.num_ranks else "loop")


def _job(args: tuple[str, int, int, bool]) -> dict:
    name, seed, steps, hints = args
    family = FAMILIES[name]
    hint, timings = hint_of(family), family.timings(seed, steps)
    settings = selfdriving.candidates(hint, family.budget, hints=hints,
                                      sizes=any(t.sizes is not None for t in timings))
    run = selfdriving.run(hint, timings, budget=family.budget, settings=settings)
    predicted = selfdriving.predict(hint, timings, settings)  # each setting alone
    best = max(predicted, key=lambda p: p.speedup)
    own_best = max(p.speedup for p in predicted if p.setting.hint is None)
    return {"family": name, "seed": seed, "mode": run.speedup, "best": best.speedup,
            "best_setting": best.setting.describe(), "best_hint": best.setting.hint,
            "own_hint_best": own_best,
            "settled": run.settled_at,
            "other_hints": [d.setting.hint for d in run.decisions if d.setting.hint],
            "decisions": [d.line() for d in run.decisions],
            "reasons": [d.reason for d in run.decisions],
            "step_times": run.step_times, "fixed_times": run.fixed_times,
            "best_times": selfdriving.setting_times(hint, timings, best.setting)}


def capture(row: dict) -> float | None:
    gain = row["best"] - 1
    return (row["mode"] - 1) / gain if gain >= NOTABLE_GAIN else None


def family_lines(name: str, rows: list[dict], hints: bool) -> list[str]:
    family = FAMILIES[name]
    modes = [r["mode"] for r in rows]
    captures = [c for c in map(capture, rows) if c is not None]
    reasons = [reason for r in rows for reason in r["reasons"][1:]]
    counted = {reason: reasons.count(reason) for reason in dict.fromkeys(reasons)}
    mean_gain = statistics.mean(r["best"] for r in rows) - 1
    share = ((statistics.mean(modes) - 1) / mean_gain if mean_gain >= NOTABLE_GAIN
             else None)
    return [f"| {name} | {family.kind} | {family.hint} `{family.budget}` | "
            f"{statistics.mean(modes):.3f}, min {min(modes):.3f}"
            f"{'' if min(modes) >= FLOOR else ' **BELOW**'} | "
            f"{statistics.mean(r['best'] for r in rows):.3f} | "
            + (f"{share:.0%} ({min(captures):.0%}-{max(captures):.0%})" if share is not None
               and captures else "-")
            + f" | {statistics.median(r['settled'] for r in rows):.0f} | "
            + ", ".join(f"{n} {reason}" for reason, n in counted.items()) + " |"
            + (f" {hint_counts(rows)} |" if hints else "")]


def hint_counts(rows: list[dict]) -> str:
    """Seeds whose best single setting ranks by another hint (and what the best gains
    over the best of the run's own hint's settings), and whose mode decided one (with the
    hints named)."""
    best = [r["best_hint"] for r in rows if r["best_hint"]]
    chosen = [hint for r in rows for hint in r["other_hints"]]

    def named(hints: list[str]) -> str:
        return f" ({', '.join(sorted(set(hints)))})" if hints else ""

    over_own = statistics.mean(r["best"] / r["own_hint_best"] for r in rows)
    return (f"best: {len(best)} of {len(rows)}{named(best)}, {over_own:.4f}x the own hint's "
            f"best; mode: {sum(1 for r in rows if r['other_hints'])}{named(chosen)}")


def plot(name: str, row: dict, path: str) -> str:
    from rrfp.sim.plot import pyplot

    plt = pyplot()
    fig, ax = plt.subplots(figsize=(9, 3.2))
    for key, label, style in (("fixed_times", "fixed schedule", dict(color="#888888")),
                              ("best_times", f"best single setting ({row['best_setting']})",
                               dict(color="#55A868")),
                              ("step_times", "self-driving", dict(color="#C44E52"))):
        ax.plot(row[key], label=label, linewidth=0.9, **style)
    ax.set_xlabel("step")
    ax.set_ylabel("step time (forward = 1)")
    ax.set_title(f"{name}, seed {row['seed']}: mode {row['mode']:.3f}x, best single "
                 f"{row['best']:.3f}x the fixed schedule (simulated)")
    ax.legend(fontsize=7, loc="upper right")
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seeds", type=int, default=20)
    parser.add_argument("--first-seed", type=int, default=0)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--families", default=",".join(FAMILIES))
    parser.add_argument("--processes", type=int, default=2)
    parser.add_argument("--out", default="selfdriving.md")
    parser.add_argument("--tune-hints", action="store_true",
                        help="offer the interchangeable hints as candidates too")
    args = parser.parse_args(argv)
    names = args.families.split(",")
    unknown = [n for n in names if n not in FAMILIES]
    if unknown:
        parser.error(f"unknown families {unknown}: use some of {list(FAMILIES)}")
    start = time.time()
    jobs = [(n, seed, args.steps, args.tune_hints) for n in names
            for seed in range(args.first_seed, args.first_seed + args.seeds)]
    with Pool(args.processes) as pool:
        rows = pool.map(_job, jobs, chunksize=1)
    minutes = (time.time() - start) / 60
    stem = os.path.splitext(args.out)[0]
    with open(result_path(f"{stem}.json"), "w") as f:
        json.dump([{k: v for k, v in r.items() if not k.endswith("_times")} for r in rows],
                  f, indent=1)
    by_family = {n: [r for r in rows if r["family"] == n] for n in names}
    command = " ".join(["python -m benchmarks.selfdriving_bench", *sys.argv[1:]]
                       if argv is None else ["python -m benchmarks.selfdriving_bench", *argv])
    lowest = min(r["mode"] for r in rows)
    lines = [
        "# Self-driving RRFP against the fixed schedule and the best single setting "
        "(simulated)", "",
        f"Regenerate with `{command}` ({minutes:.0f} min on {args.processes} processes). "
        "The method: `benchmarks/selfdriving_bench.py`'s docstring; the rules: "
        "`rrfp/core/tuning.py`; the families: `rrfp/sim/families.py`. "
        f"{args.steps} steps per run, seeds {args.first_seed}-"
        f"{args.first_seed + args.seeds - 1}, every step counted. *mode*: the run's "
        "throughput over the fixed schedule's (mean, lowest seed); *best single*: the best "
        "setting within the budget, chosen knowing the whole run (mean over seeds); "
        "*captured*: the mode's mean gain over the best single setting's (in brackets: the "
        "lowest and highest seed), where that gain is at least "
        f"{NOTABLE_GAIN:.0%}; *settled*: the median step from which the last decision ran; "
        "*decisions*: what the tuner did after its first choice's measuring, over all seeds"
        + ("; *other hint*: the seeds whose best single setting ranks by an interchangeable "
           "hint, the best single setting's throughput over the best of the run's own "
           "hint's settings (mean over seeds), and the seeds whose mode chose another hint "
           "(`--tune-hints`: both choose among them)."
           if args.tune_hints else "."), "",
        f"**The mode's lowest run anywhere: {lowest:.3f}x the fixed schedule** "
        f"({'at or above' if lowest >= FLOOR else 'BELOW'} {FLOOR}x).", "",
        "| family | kind | hint, budget | mode | best single | captured | settled | "
        "decisions |" + (" other hint |" if args.tune_hints else ""),
        "|---|---|---|---|---|---|---|---|" + ("---|" if args.tune_hints else "")]
    for name in names:
        lines += family_lines(name, by_family[name], args.tune_hints)
    lines += ["", "Step time over one run (the first seed) per family:", ""]
    for name in names:
        path = plot(name, by_family[name][0], result_path(f"{stem}_{name}.png"))
        lines.append(f"![{name}]({os.path.basename(path)})")
    print("wrote", write_page(args.out, lines))


if __name__ == "__main__":
    main()
