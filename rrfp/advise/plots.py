"""The advisor's charts (matplotlib, imported only when plotting): each setting's predicted
speedup, and one measured step beside its simulated replays."""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from rrfp.advise.report import Advice, size
from rrfp.core.stats import Span
from rrfp.sim.plot import plot_timelines, pyplot

SHOWN = 20
"""Settings on the chart (the best predicted)."""


@dataclass(frozen=True)
class MeasuredTimeline:
    spans: Mapping[int, Sequence[Span]]
    makespan: float


def plot_predictions(advice: Advice, path: str) -> None:
    """Draw ``settings_figure`` into ``path``."""
    plt = pyplot()
    fig = settings_figure(advice)
    fig.savefig(path, dpi=110, bbox_inches="tight")  # the whole x-axis label
    plt.close(fig)


def settings_figure(advice: Advice):
    """A bar per setting: its median predicted speedup over the fixed schedule, the
    measured steps' range as a whisker, coloured by how far it grows the job's peak
    activation bytes, hatched where it is a guess from halved backwards; a legend for
    each."""
    plt = pyplot()
    from matplotlib.patches import Patch

    rows = advice.rows[:SHOWN]
    fig, ax = plt.subplots(figsize=(11, 0.32 * len(rows) + 1.8))
    for i, row in enumerate(rows):
        grows = row.job_peak_extra
        ax.barh(i, row.speedup - 1, left=1, color=_colour(grows), height=0.7,
                hatch="//" if row.even_split else None)
        ax.plot([min(row.speedups), max(row.speedups)], [i, i], color="black", linewidth=0.8)
        label = "" if grows is None else " no peak change" if grows <= 0 else f" +{size(grows)}"
        ax.text(max(row.speedups), i, label, va="center", fontsize=7)
    ax.set_yticks(range(len(rows)))
    ax.set_yticklabels([f"{r.setting.describe(advice.run.hint.name)} ({r.policy})"
                        for r in rows], fontsize=7)
    ax.set_ylim(len(rows) - 0.5, -0.5)
    ax.axvline(1.0, color="grey", linewidth=0.8)
    own = ax.axvline(advice.own_speedup, color="#4C72B0", linewidth=0.8, linestyle="--")
    ax.set_xlabel("predicted speedup over the fixed schedule\n(bar: median; line: the "
                  "measured steps' range; label: growth of the job's activation peak)")
    ax.legend(handles=[
        own, Patch(color=_colour(0)), Patch(color=_colour(1)),
        Patch(facecolor="white", edgecolor="black", hatch="//")], labels=[
        f"this run's setting ({advice.own_speedup:.3f}x)", "keeps the job's peak",
        "grows the job's peak", "~ a guess: backwards halved"], fontsize=8, loc="lower right")
    ax.set_title(f"{advice.source}: {len(advice.run.steps)} measured steps replayed",
                 fontsize=9, loc="left")
    fig.tight_layout()
    return fig


def _colour(grows: int | None) -> str:
    return "#999999" if grows is None else "#55A868" if grows <= 0 else "#DD8452"


def plot_step(advice: Advice, path: str) -> None:
    """The measured step of median length at the run's own setting, its replay in the
    simulator at that setting, and at the best predicted one."""
    run = advice.run
    own = [i for i, s in enumerate(run.steps) if s in run.own_steps]
    times = [run.steps[i].step_time for i in own]
    index = own[times.index(statistics.median_low(times))]
    step = run.steps[index]
    panels = {
        f"measured: step {step.number}": MeasuredTimeline(
            step.spans, max(s.end for spans in step.spans.values() for s in spans)),
        f"simulated at this run's setting ({run.policy})": advice.baseline.own_results[index],
    }
    best = advice.best(None)
    if best is not None:
        panels[f"simulated at {best.setting.describe(run.hint.name)} ({best.policy})"] = (
            best.results[index])
    plot_timelines(panels, path, title=f"{advice.source}: measured vs predicted, one step",
                   time_unit="s")
