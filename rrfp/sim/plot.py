"""Timeline and trade-off charts (matplotlib, imported only when plotting)."""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

from rrfp.core.stats import Span
from rrfp.sim.study import Comparison

COLOURS = {"F": "#4C72B0", "B": "#55A868", "I": "#DD8452", "W": "#8172B3"}


def pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


class Timeline(Protocol):
    """A step's actions per rank and its length (a simulated ``SimResult``, or a measured
    step)."""

    spans: Mapping[int, Sequence[Span]]
    makespan: float


def plot_timelines(results: Mapping[str, Timeline], path: str, title: str = "",
                   time_unit: str = "forward = 1") -> None:
    """One panel per run (e.g. fixed, RRFP), a row per rank; white gaps are idle."""
    plt = pyplot()
    ranks = len(next(iter(results.values())).spans)
    end = max(r.makespan for r in results.values())
    fig, axes = plt.subplots(len(results), 1, figsize=(12, 0.35 * ranks * len(results) + 1.2),
                             sharex=True, squeeze=False)
    for ax, (label, result) in zip(axes[:, 0], results.items()):
        for rank, spans in result.spans.items():
            for span in spans:
                if span.kind in COLOURS:
                    ax.barh(rank, span.end - span.start, left=span.start, height=0.8,
                            color=COLOURS[span.kind], edgecolor="white", linewidth=0.3)
        ax.set_ylim(ranks - 0.5, -0.5)
        ax.set_yticks(range(ranks))
        ax.set_ylabel("rank")
        ax.set_title(f"{label}: makespan {result.makespan:.4g}", fontsize=10, loc="left")
        ax.set_xlim(0, end * 1.01)
    axes[-1, 0].set_xlabel(f"time ({time_unit})")
    shown = kinds_shown(results)
    handles = [plt.Rectangle((0, 0), 1, 1, color=COLOURS[kind]) for kind in shown]
    fig.legend(handles, shown, loc="upper right", ncol=len(shown), fontsize=8)
    if title:
        fig.suptitle(title, fontsize=11, x=0.01, ha="left")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def kinds_shown(results: Mapping[str, Timeline]) -> list[str]:
    """The action kinds the runs show, for the legend: a split-backward run has I and W,
    never B."""
    return [kind for kind in COLOURS if any(span.kind == kind for r in results.values()
                                            for spans in r.spans.values() for span in spans)]


def plot_tradeoff(sweeps: Mapping[str, Mapping[str, list[Comparison]]], path: str,
                  title: str = "") -> None:
    """Speedup over the fixed schedule and peak memory (relative to the hint) per limit.

    ``sweeps``: series label (e.g. a workload) -> limit label -> comparisons.
    """
    plt = pyplot()
    fig, (speed, memory) = plt.subplots(1, 2, figsize=(11, 4))
    for label, by_limit in sweeps.items():
        limits = list(by_limit)
        speedups = [[c.speedup for c in by_limit[limit]] for limit in limits]
        means = [statistics.mean(s) for s in speedups]
        speed.errorbar(range(len(limits)), means,
                       yerr=[[m - min(s) for m, s in zip(means, speedups)],
                             [max(s) - m for m, s in zip(means, speedups)]],
                       marker="o", capsize=3, label=label)
        memory.plot(range(len(limits)),
                    [statistics.mean(c.memory_ratio for c in by_limit[limit]) for limit in limits],
                    marker="o", label=label)
    for ax, ylabel in ((speed, "speedup over fixed (mean, min-max)"),
                       (memory, "activation memory of busiest rank / hint")):
        ax.set_xticks(range(len(limits)))
        ax.set_xticklabels(limits)
        ax.set_xlabel("buffer limit")
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
    speed.axhline(1.0, color="grey", linewidth=0.8)
    speed.legend(fontsize=8)
    if title:
        fig.suptitle(title, fontsize=11)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


@dataclass(frozen=True)
class LimitSeries:
    """One line of a speed-and-memory chart: per limit, the mean speedup, the lowest, and
    the busiest rank's activation memory over the baseline's busiest rank."""

    speedup: list[float]
    lowest: list[float]
    memory: list[float]


def plot_speedup_and_memory(panels: Mapping[str, Mapping[str, LimitSeries]],
                            limits: list[str], path: str, title: str = "") -> None:
    """A panel per baseline: speedup against the limit (solid, left axis; bars down to the
    lowest seed) and the busiest rank's memory (dashed, right axis), a colour per series."""
    plt = pyplot()
    fig, axes = plt.subplots(1, len(panels), figsize=(6.5 * len(panels), 4.2), squeeze=False)
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for ax, (panel, series) in zip(axes[0], panels.items()):
        memory_axis = ax.twinx()
        x = range(len(limits))
        for colour, (label, line) in zip(colours, series.items()):
            ax.errorbar(x, line.speedup, yerr=[[m - low for m, low in zip(line.speedup, line.lowest)],
                                               [0.0] * len(limits)],
                        color=colour, marker="o", capsize=3, label=label)
            memory_axis.plot(x, line.memory, color=colour, linestyle="--", marker=".")
        ax.axhline(1.0, color="grey", linewidth=0.8)
        ax.set_xticks(list(x))
        ax.set_xticklabels(limits)
        ax.set_xlabel("buffer_limit")
        ax.set_ylabel("speedup over fixed (solid; bar: lowest seed)")
        memory_axis.set_ylabel("busiest rank's memory / fixed's (dashed)")
        ax.set_title(panel, fontsize=10)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8, loc="upper left")
    if title:
        fig.suptitle(title, fontsize=11)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
