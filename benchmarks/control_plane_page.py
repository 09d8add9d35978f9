"""The page of ``benchmarks.control_plane_scale``: its before and after runs side by
side, a plot against K, and an extrapolation to 16k ranks from the store's measured cost
per operation."""

from __future__ import annotations

import json
from pathlib import Path
from statistics import mean

EXTRAPOLATE_TO = 16384
COMMAND = "python -m benchmarks.control_plane_scale --label after --ranks 64 256 1024 4096"
BEFORE_COMMAND = ("python -m benchmarks.control_plane_scale --label before --ranks 64 256 1024 "
                  "--results <this checkout>/benchmarks/results")
NOTES = [
    "What the figures are: *idle* counts every store call a rank made over the idle phase "
    "(35 s), divided by its length; the watch's wait is one call (a wait that times out "
    "costs the server a second message, its cancel). *ops per sized step* include the first "
    "step's checks of each pipeline peer's fits (later steps: a write and a read), over the "
    "sized steps each rank ran in the phase (in brackets: the fewest and most; fewer "
    "steps weigh the first one's checks more). The "
    "before code's step loop read the store every 0.1 s while waiting; the simulated loop "
    "looks once a second, so its before figures are a lower bound. *watches armed*: from "
    "the go to the last rank's watch connected (each rank makes its watch once it has "
    "agreed, as the runtime does before its first step; the code before had no watch "
    "connection).",
    "",
    "The store is served on an IPv4 socket of its own (`rrfp.testing.store_ops.SERVE`). An "
    "earlier after run had it on the IPv6 socket torch opens by itself, and its last rank at "
    "K = 1024 raised 55 s after the failure. That was the harness: torch's server looks up "
    "the name of each client that connects, on its one thread; a client of an IPv6 socket "
    "is `::ffff:127.0.0.1`, which this host's hosts file does not name, so each lookup asks "
    "the name server, which drops queries sent at once; each dropped one held every "
    "connection behind it for the resolver's timeout (5 s, retried). The watches, then made "
    "all at once as the idle phase began, took up to minutes to connect, and a rank whose "
    "watch was not yet waiting learned of the failure only once it was. By hand: 512 "
    "clients connecting at once from 4 processes took up to 50 s on the IPv6 socket, 1.0 s "
    "on the IPv4 one. What the runtime changed with it: a watch connects when it is made, "
    "so a rank is armed before its first step. The clients' own lookups (torch's client "
    "looks up the store's address as it connects, until a lookup fails in the process) "
    "cost a worker one resolver timeout (1 s, `RES_OPTIONS`) the first time: most of the "
    "arming time at small K.",
    "",
    "The before figures are those measured before this change (the store on torch's IPv6 "
    "socket, which the code before connected to once per rank, before the go). The code "
    "before was not run at K = 4096: its settings agreement has every rank read every rank's "
    "settings, 16.8 million key reads, minutes of this store's capacity and beyond the "
    "benchmark's cap on a start (`AGREE_CAP_S`).",
    "",
    "No other work ran beside the after run (the store served the `check` operations below "
    "against 78,248 `check`/s in the before run). Its K = 1024 "
    "figures are close to an earlier run of the same code on a quiet host (commit d983eb1: last "
    "rank raised 0.47 s after the failure, hang report 0.42 s); on a host shared with other "
    "work the same K gave 14.6 s and 14.4 s.",
    "",
    "K = 4096 meets every figure: the last rank raised 2.0 s after the failure (the first "
    "0.42 s), and the hang report took 1.9 s. The failure phase (table above) cost the "
    "worker processes 3.5 s of CPU, 0.85 ms a simulated rank (its watch's wake and read, its "
    "step loop's raise and told state, and its worker's own polling of the driver), and the "
    "store's process 0.39 s: 85% of this host's 2 cores over the phase. The reach at this K "
    "is this host's CPU running every rank's share; a real rank runs its share on its own "
    "host.",
    "",
    "The workers run at a 0.5 s switch interval (`SWITCH_INTERVAL_S`). At CPython's 5 ms, a "
    "thread waiting for its interpreter's lock wakes every 5 ms to ask for it, and at a "
    "failure every watch and step loop of a worker (256 threads) waits for it at once: two "
    "runs of K = 4096 at 5 ms stalled (a load of 1,800-2,900 on 2 cores for minutes; 87 and "
    "275 of 4,095 ranks had raised when the runs were cut at 5 and 7 minutes), and earlier "
    "runs at 5 ms gave 8.6 s, 5.2 s and 355 s. The simulated ranks' threads release the lock "
    "at every store call and wait, so the longer interval costs them nothing else; a real "
    "rank has a few threads in its interpreter."]


def summarize(run: dict) -> dict:
    """One K's figures: per rank and in total, each phase."""
    ranks = [rank for worker in run["workers"] for rank in worker["ranks"]]
    started, count = run["started"], run["ranks"]
    agreed = [rank["agreed_at"] for rank in ranks if rank["agreed_at"] is not None]
    armed = [rank["armed_at"] for rank in ranks if rank.get("armed_at") is not None]
    errors = sorted({rank["error"] for rank in ranks if rank["error"]})
    idle = _rates(run["workers"], "idle", "sized")
    sized = _differences(run["workers"], "sized", "fail")
    steps = [rank["sized_steps"] for rank in ranks]
    published = next((rank["published_at"] for rank in ranks if rank["published_at"]), None)
    raised = [rank["raised_at"] for rank in ranks if rank["raised_at"] is not None]
    report = next((rank["report_s"] for rank in ranks if rank["report_s"] is not None), None)
    return {
        "ranks": count, "errors": errors,
        "agree_s": max(agreed) - started["agree"] if len(agreed) == count else None,
        "armed_s": max(armed) - started["agree"] if len(armed) == count else None,
        "agree_calls": mean(rank["agree_ops"][0] for rank in ranks),
        "agree_calls_max": max(rank["agree_ops"][0] for rank in ranks),
        "agree_keys": mean(rank["agree_ops"][1] for rank in ranks),
        "agree_keys_max": max(rank["agree_ops"][1] for rank in ranks),
        "idle_per_rank": mean(idle) if idle else None,
        "idle_total": sum(idle) if idle else None,
        "step_calls": (sum(calls for calls, _ in sized) / max(1, sum(steps))) if sized else None,
        "steps_range": (min(steps), max(steps)),
        "step_keys": (sum(keys for _, keys in sized) / max(1, sum(steps))) if sized else None,
        "raised": len(raised),
        "reach_first": min(raised) - published if raised and published else None,
        "reach_last": max(raised) - published if raised and published else None,
        "report_s": report,
        **_failure_cpu(run),
    }


def _failure_cpu(run: dict) -> dict:
    """The failure phase (from the driver's go to its stop): its length, and the CPU
    seconds the worker processes (all their ranks) and the store's process used in it
    (runs measured before these were kept have none)."""
    store = run.get("store_cpu")
    snaps = [worker["snapshots"] for worker in run["workers"]]
    if not store or not all(len(s.get("fail", ())) > 2 and "stop" in s for s in snaps):
        return {}
    return {"fail_wall": run["started"]["stop"] - run["started"]["fail"],
            "fail_cpu_ranks": sum(s["stop"][2] - s["fail"][2] for s in snaps),
            "fail_cpu_store": store["stop"] - store["fail"], "cores": run["cores"]}


def _cpu_table(rows: list[dict]) -> list[str]:
    """The failure phase's CPU, per K (rows that measured it)."""
    rows = [row for row in rows if "fail_wall" in row]
    if not rows:
        return []
    lines = ["**after: the CPU of the failure phase** (from the driver's go to its stop, the "
             "hang report written; the host's CPU: its cores times the phase's length)", "",
             "| K | phase (s) | simulated ranks' CPU (s) | per rank (ms) | store's CPU (s) | "
             "of the host's CPU |", "|---:|---:|---:|---:|---:|---:|"]
    for row in rows:
        host = row["cores"] * row["fail_wall"]
        lines.append(
            f"| {row['ranks']} | {row['fail_wall']:.2f} | {row['fail_cpu_ranks']:.2f} "
            f"| {1e3 * row['fail_cpu_ranks'] / row['ranks']:.2f} | {row['fail_cpu_store']:.2f} "
            f"| {(row['fail_cpu_ranks'] + row['fail_cpu_store']) / host:.0%} |")
    return lines + [""]


def _differences(workers: list[dict], start: str, end: str) -> list[tuple[int, int]]:
    """Per rank, (calls, keys) between the snapshots of two phases' starts."""
    out = []
    for worker in workers:
        snaps = worker["snapshots"]
        if start in snaps and end in snaps:
            out += [(b[0] - a[0], b[1] - a[1]) for a, b in zip(snaps[start][1], snaps[end][1])]
    return out


def _rates(workers: list[dict], start: str, end: str) -> list[float]:
    """Per rank, calls a second between two phases' starts."""
    out = []
    for worker in workers:
        snaps = worker["snapshots"]
        if start in snaps and end in snaps:
            seconds = snaps[end][0] - snaps[start][0]
            out += [(b[0] - a[0]) / seconds for a, b in zip(snaps[start][1], snaps[end][1])]
    return out


def _fmt(value, digits: int = 2) -> str:
    if value is None:
        return "—"
    if isinstance(value, float):
        return f"{value:.{digits}f}" if abs(value) < 1e4 else f"{value:.3g}"
    return str(value)


def _table(label: str, rows: list[dict]) -> list[str]:
    lines = [f"**{label}**", "",
             "| K | idle ops/s per rank | idle ops/s total | start (s) | watches armed (s) | "
             "start ops per rank (mean / max) | keys named at start per rank (mean / max) | ops per sized step "
             "per rank | keys per sized step per rank | failure reach first / last (s) | "
             "ranks raised | hang report (s) |",
             "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for row in rows:
        lines.append(
            f"| {row['ranks']} | {_fmt(row['idle_per_rank'], 3)} | {_fmt(row['idle_total'], 1)} "
            f"| {_fmt(row['agree_s'])} | {_fmt(row['armed_s'])} "
            f"| {_fmt(row['agree_calls'], 1)} / "
            f"{row['agree_calls_max']} | {_fmt(row['agree_keys'], 1)} / {row['agree_keys_max']} "
            f"| {_fmt(row['step_calls'], 1)} ({row['steps_range'][0]}-{row['steps_range'][1]} "
            f"steps) | {_fmt(row['step_keys'], 1)} "
            f"| {_fmt(row['reach_first'])} / {_fmt(row['reach_last'])} "
            f"| {row['raised']} of {row['ranks'] - 1} | {_fmt(row['report_s'])} |")
    errors = [f"K={row['ranks']}: {e}" for row in rows for e in row["errors"]]
    if errors:
        lines += ["", "Errors the simulated ranks raised: " + "; ".join(errors)]
    return lines + [""]


def _plot(runs: dict[str, list[dict]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [("idle_per_rank", "idle store ops/s per rank"), ("agree_s", "start (agreement), s"),
              ("reach_last", "failure reach (last rank), s"), ("report_s", "hang report, s")]
    fig, axes = plt.subplots(1, 4, figsize=(16, 3.8))
    for ax, (key, title) in zip(axes, panels):
        for label, rows in runs.items():
            points = [(row["ranks"], row[key]) for row in rows if row[key] is not None]
            if points:
                ax.plot(*zip(*points), marker="o", label=label)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("simulated ranks K")
        ax.set_title(title)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def _extrapolation(capacity: float, after: dict, before: dict | None) -> list[str]:
    n = EXTRAPOLATE_TO
    cost_us = 1e6 / capacity
    steady = after["idle_per_rank"] * n
    start_ops = after["agree_keys"] * n
    failure_ops = (1 + 2 + 2) * n  # the wake multi_set's key, a read, a told state
    lines = [
        f"The store served {capacity:,.0f} `check` operations per second from 16 client "
        f"threads in 4 processes ({cost_us:.1f} us each). At {n:,} ranks, with the per-rank "
        f"figures measured at K={after['ranks']} (the largest K measured):", "",
        f"* steady state: {after['idle_per_rank']:.3f} ops/s per rank, {steady:,.0f} ops/s in "
        f"all: {100 * steady / capacity:.2f}% of the store's capacity;",
        f"* start: {after['agree_keys']:.1f} keys named per rank on average (the first rank "
        f"waits for and reads every rank's), {start_ops:,.0f} in all: "
        f"{start_ops / capacity:.1f} s of the store's time;",
        f"* failure: one `multi_set` of {n:,} wake keys, then each rank reads the failure and "
        f"tells its state: about {failure_ops:,} key operations, {failure_ops / capacity:.1f} s "
        "of the store's time before the last rank has raised and told.",
    ]
    if before is not None and before["idle_per_rank"] is not None:
        demand = before["idle_per_rank"] * n
        lines.append(f"* before: {before['idle_per_rank']:.2f} ops/s per rank measured at "
                     f"K={before['ranks']} would ask {demand:,.0f} ops/s at {n:,} ranks, "
                     f"{demand / capacity:.1f}x the store's capacity.")
    lines += ["", "This assumes a store operation costs the server the same whatever the number "
              "of connections and keys (one key of a `multi_set`/`multi_get`/`wait` as one "
              "operation), a store host like this one (2 cores), clients that are not the "
              "bottleneck, and two connections per rank (the rank's client and its watch's): "
              f"{2 * n:,} sockets on the store's host, above many hosts' default `ulimit -n`."]
    return lines


def write_page(results: Path) -> None:
    """``control_plane_scale.md`` and its plot from the before and after JSON files."""
    loaded = {label: json.loads((results / f"control_plane_scale_{label}.json").read_text())
              for label in ("before", "after")
              if (results / f"control_plane_scale_{label}.json").exists()}
    runs = {label: [summarize(run) for run in data["runs"]] for label, data in loaded.items()}
    _plot(runs, results / "control_plane_scale.png")
    after = loaded["after"]
    lines = ["# The control plane against K simulated ranks", "",
             "Made by `benchmarks/control_plane_scale.py` (its docstring says what each phase "
             "does):", "", "```", "# after (this checkout)", COMMAND,
             "# before: the same command in a checkout of the code before, with this file "
             "and rrfp/testing/store_ops.py copied in",
             BEFORE_COMMAND,
             "python -m benchmarks.control_plane_scale --page", "```", "",
             f"Commits: after {after['commit']}"
             + (f", before {loaded['before']['commit']}" if "before" in loaded else "")
             + ". One TCPStore (torch 2.13, libuv server) in a process of its own; worker "
             "processes of simulated ranks on the same 2-core host (after: "
             + ", ".join(f"{run.get('processes', 8)} at K = {run['ranks']}"
                         for run in after["runs"]) + ").", "",
             "![the control plane against K](control_plane_scale.png)", ""]
    for label in ("before", "after"):
        if label in runs:
            lines += _table(label, runs[label])
    lines += _cpu_table(runs["after"])
    lines += NOTES + [""]
    biggest = max(runs["after"], key=lambda row: row["ranks"])
    lines += ["## 16k ranks", ""] + _extrapolation(
        after["capacity"], biggest,
        max(runs["before"], key=lambda row: row["ranks"]) if "before" in runs else None)
    (results / "control_plane_scale.md").write_text("\n".join(lines) + "\n")
