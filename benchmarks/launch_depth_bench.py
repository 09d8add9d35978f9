"""Launch depth: how far a rank's CPU may run ahead of its device, measured and simulated.

    python -m benchmarks.launch_depth_bench      # writes results/launch_depth.md (~6 min)

On an accelerator a launch returns before the work is done. RRFP decides what to run next
when its device is free (fewer than ``launch_depth`` launched actions incomplete); ahead of
a busy device it launches only the policy's own next action (the hint's next, or for the
``critical`` policy the most critical one). This compares, against the fixed
schedule on the same device and launch cost:

* *before*: how the runtime decided before the device model, which took an action for
  complete when its launch returned: every ready action is launched at once, so the order
  is frozen at launch (``launch_depth=None, reorder_ahead=True``);
* depth 1, 2 and 3 (``reorder_ahead=False``, the default),

with an emulated launch cost of 0, 5% and 20% of a forward.

Runtime part (**measured**, emulated asynchronous device): ``ScheduleRRFP`` on
``rrfp.devices.device.EmulatedDevice`` on gloo, stage compute is emulated device time
(``EmulatedDeviceTime``: the workload model's durations, 10 ms per mean forward, around a
tiny MLP). The fixed schedule is ``ScheduleRRFP(policy="fixed")`` on the same device with
no depth bound (a fixed order needs no decisions, so its CPU runs ahead as torch's
schedules do on CUDA). Every variant runs the same drawn timings, alternating within each
pair. Beside each figure: the simulator's prediction for the same timings. Simulator part
(**simulated**): the same contrast over hints, depths and workloads; and the BF/BFW rules at
depth 1 (the rule applied when the device frees) against depth 2 (the rule's pick launched
ahead when it is the hint's next action), per seed, in both directions.
"""

from __future__ import annotations

import argparse
import math
import statistics
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining._utils import generate_stage_to_rank_mapping

from benchmarks.pages import write_page
from rrfp import Settings
from rrfp.core.hints import build_hint
from rrfp.sim.study import compare
from rrfp.sim.workloads import make_timing, Timing
from rrfp.testing.ab import in_alternating_order
from rrfp.testing.emulation import EmulatedDevice, EmulatedDeviceTime
from rrfp.testing.study import Study, StudySchedule
from rrfp.testing.worlds import run_local_world

DIM = 16
COSTS = (0.0, 0.05, 0.2)
"""Launch cost, in forwards."""
DEPTHS = (1, 2, 3)
BEFORE = "before"


@dataclass(frozen=True)
class Config:
    hint: str
    stages_per_rank: int
    pp: int
    workload: str
    limit: str | int
    microbatches: int = 16
    pairs: int = 3
    unit_s: float = 0.01


def _timing(config: Config, pair: int) -> Timing:
    return make_timing(config.workload, config.pp * config.stages_per_rank,
                       config.microbatches, seed=2000 + pair)


def _rank_main(rank: int, world_size: int, config: Config) -> dict:
    current: dict[str, Timing] = {"timing": _timing(config, 0)}
    unit, M = config.unit_s, config.microbatches
    num_stages = world_size * config.stages_per_rank
    mapping = generate_stage_to_rank_mapping(world_size, num_stages, style="loop")
    local = [s for s in range(num_stages) if mapping[s] == rank]

    def stages() -> list[PipelineStage]:
        built = []
        for s in local:
            torch.manual_seed(s)
            block = torch.nn.Sequential(torch.nn.Linear(DIM, DIM), torch.nn.Tanh())
            timed = EmulatedDeviceTime(
                block, M,
                forward_time=lambda mb, s=s: current["timing"].forward[s][mb] * unit,
                backward_time=lambda mb, s=s: (current["timing"].backward_input[s][mb]
                                               + current["timing"].backward_weight[s][mb]) * unit)
            built.append(PipelineStage(timed, s, num_stages, torch.device("cpu")))
        return built

    loss_fn = torch.nn.functional.mse_loss
    x = torch.randn(M * 2, DIM)
    y = torch.randn(M * 2, DIM)
    times: dict[str, list[float]] = {}
    for cost in COSTS:
        variants = {"fixed": (None, "fixed"), BEFORE: (None, None),
                    **{f"depth {d}": (d, None) for d in DEPTHS}}
        runs = {}
        for name, (depth, policy) in variants.items():
            st = stages()
            settings = Settings(buffer_limit=config.limit, policy=policy, launch_depth=depth)
            study = Study(reorder_ahead=name == BEFORE,
                          device=EmulatedDevice(launch_cost=cost * unit))
            runs[name] = (StudySchedule(st, M, loss_fn=loss_fn, hint=config.hint,
                                        settings=settings, study=study), st)
        for pair in range(config.pairs + 1):  # pair 0 warms up (shape inference, history)
            current["timing"] = _timing(config, pair)
            for name in in_alternating_order(list(runs), pair - 1):  # the first measured in order
                schedule, st = runs[name]
                for stage in st:
                    stage.submod.reset()
                dist.barrier()
                start = time.perf_counter()
                schedule.step(*((x,) if rank == 0 else ()), target=y)
                dist.barrier()  # the step ends when its last rank ends
                if pair > 0:
                    times.setdefault(f"{name} @ {cost}", []).append(time.perf_counter() - start)
        for schedule, _ in runs.values():
            schedule.close()
    return times


def run(config: Config) -> list[dict]:
    times = run_local_world(config.pp, _rank_main, config, timeout=1200)[0]
    hint = build_hint(config.hint, num_ranks=config.pp,
                      num_stages=config.pp * config.stages_per_rank,
                      n_microbatches=config.microbatches)
    rows = []
    for cost in COSTS:
        fixed = times[f"fixed @ {cost}"]
        for name in (BEFORE, *(f"depth {d}" for d in DEPTHS)):
            measured = times[f"{name} @ {cost}"]
            depth = math.inf if name == BEFORE else int(name.split()[1])
            predicted = [compare(hint, _timing(config, pair), 0, limit=config.limit,
                                 launch_depth=depth, launch_cost=cost,
                                 reorder_ahead=name == BEFORE)
                         for pair in range(1, config.pairs + 1)]
            rows.append({
                "config": config, "cost": cost, "variant": name,
                "fixed_ms": statistics.median(fixed) * 1e3,
                "rrfp_ms": statistics.median(measured) * 1e3,
                "ratio": statistics.median(f / m for f, m in zip(fixed, measured)),
                "sim_fixed_ms": statistics.median(p.fixed.makespan for p in predicted)
                * config.unit_s * 1e3,
                "sim_rrfp_ms": statistics.median(p.rrfp.makespan for p in predicted)
                * config.unit_s * 1e3,
                "sim_ratio": statistics.median(p.speedup for p in predicted),
            })
    return rows


RUNTIME_CONFIGS = (
    Config("Interleaved1F1B", 2, 4, "uniform", "hint"),
    Config("1F1B", 1, 4, "jitter", "hint+2"),
)
SIM_HINTS = (("1F1B", 1, "loop"), ("Interleaved1F1B", 2, "loop"), ("ZBVZeroBubble", 2, "v"))
SIM_CASES = (("uniform", "hint"), ("jitter", "hint"), ("jitter", "hint+2"),
             ("multimodal", "hint+2"), ("latency", "hint+2"))


def simulated_grid(seeds: int) -> list[str]:
    lines = [
        "| hint | ranks x microbatches | workload | limit | launch cost | before | depth 1 | "
        "depth 2 | depth 3 |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for name, per_rank, layout in SIM_HINTS:
        for pp, M in ((4, 16), (8, 32)):
            hint = build_hint(name, num_ranks=pp, num_stages=pp * per_rank, n_microbatches=M,
                              layout=layout)
            for workload, limit in SIM_CASES:
                for cost in COSTS:
                    cells = []
                    for depth, ahead in ((math.inf, True), *((d, False) for d in DEPTHS)):
                        cells.append(statistics.mean(
                            compare(hint, workload, seed, limit=limit, launch_depth=depth,
                                    launch_cost=cost, reorder_ahead=ahead).speedup
                            for seed in range(seeds)))
                    lines.append(f"| {name} | {pp} x {M} | {workload} | {limit} | "
                                 f"{cost:.0%} | " + " | ".join(f"{c:.3f}" for c in cells) + " |")
    return lines


RULE_HINTS = (("BF", 1, "loop"), ("BF", 2, "loop"), ("BFW", 2, "loop"), ("BFW", 2, "v"))
"""The BF/BFW rules: (rule, stages per rank, placement)."""
RULE_CASES = tuple((w, lim) for w in ("jitter", "multimodal", "latency", "spikes", "correlated",
                                     "bursty") for lim in ("hint", "hint+2", 32))


def rules_grid(seeds: int) -> list[tuple[tuple, list[float]]]:
    """The BF/BFW rules at launch depth 1 (every choice made when the device frees) and 2,
    launch cost 0: per row (rule, stages per rank, placement, ranks x microbatches,
    workload, limit), each seed's depth-1 makespan over its depth-2 makespan."""
    rows = []
    for rule, per_rank, layout in RULE_HINTS:
        for pp, M in ((4, 16), (8, 32)):
            hint = build_hint(rule, num_ranks=pp, num_stages=pp * per_rank, n_microbatches=M,
                              layout=layout)
            for workload, limit in RULE_CASES:
                makespans = [[compare(hint, workload, seed, limit=limit,
                                      launch_depth=depth).rrfp.makespan for depth in (1, 2)]
                             for seed in range(seeds)]
                rows.append(((rule, per_rank, layout, f"{pp} x {M}", workload, limit),
                             [d1 / d2 for d1, d2 in makespans]))
    return rows


def rules_summary(rows: list[tuple[tuple, list[float]]]) -> list[str]:
    by_config: dict[tuple, list[float]] = {}
    for key, ratios in rows:
        by_config.setdefault(key[:4], []).extend(ratios)
    moved = sum(any(abs(r - 1) > 1e-9 for r in ratios) for _, ratios in rows)
    lines = ["| rule | stages per rank | placement | ranks x microbatches | geometric mean | "
             "min | max | seeds where depth 2 is faster / slower |",
             "|---|---|---|---|---|---|---|---|"]
    for (rule, per_rank, layout, size), ratios in by_config.items():
        mean = math.exp(statistics.mean(map(math.log, ratios)))
        lines.append(f"| {rule} | {per_rank} | {layout} | {size} | {mean:.4f} | "
                     f"{min(ratios):.4f} | {max(ratios):.4f} | "
                     f"{sum(r > 1 + 1e-9 for r in ratios)} / {sum(r < 1 - 1e-9 for r in ratios)} |")
    return [f"Rows where depth 2 moved some seed's makespan: {moved} of {len(rows)}.", "",
            *lines]


def rules_table(rows: list[tuple[tuple, list[float]]]) -> list[str]:
    lines = ["| rule | stages per rank | placement | ranks x microbatches | workload | limit | "
             "depth 1 / depth 2 (mean of seeds) |", "|---|---|---|---|---|---|---|"]
    for key, ratios in rows:
        lines.append("| " + " | ".join(map(str, key)) + f" | {statistics.mean(ratios):.4f} |")
    return lines


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--pairs", type=int, default=3, help="measured A/B rounds per config")
    parser.add_argument("--seeds", type=int, default=4, help="seeds per simulated cell")
    args = parser.parse_args(argv)
    started = time.time()
    rows = []
    for config in RUNTIME_CONFIGS:
        config = Config(**{**config.__dict__, "pairs": args.pairs})
        for row in run(config):
            rows.append(row)
            print(f"{config.hint} PP={config.pp} {config.workload} {config.limit} cost "
                  f"{row['cost']:.0%} {row['variant']:8s}: fixed {row['fixed_ms']:.0f} ms, "
                  f"RRFP {row['rrfp_ms']:.0f} ms, ratio {row['ratio']:.3f} "
                  f"(sim {row['sim_ratio']:.3f})", flush=True)
    runtime_s = time.time() - started
    grid = simulated_grid(args.seeds)
    rule_rows = rules_grid(args.seeds)
    lines = [
        "# Launch depth: deciding when the device is free (emulated asynchronous device)",
        "",
        f"Regenerate with `python -m benchmarks.launch_depth_bench` ({time.time() - started:.0f} s "
        "on this 2-core machine). See the module docstring for the method.",
        "",
        "Ratio: fixed-schedule step time / RRFP step time on the same device and launch "
        "cost, median over the A/B pairs (> 1: RRFP faster). *before*: how the runtime "
        "decided before the device model (an action complete when its launch returns: the "
        "CPU launches every ready action at once; `launch_depth=None, reorder_ahead=True`). "
        "*depth d*: RRFP decides when fewer than d launched "
        "actions are incomplete; ahead of a busy device it launches only the policy's own "
        "next action (the hint's next, or for `critical` the most critical one). Launch "
        "cost in forwards (10 ms).",
        "",
        f"## Measured (emulated asynchronous device, gloo, {args.pairs} pairs per cell, "
        f"{runtime_s:.0f} s)",
        "",
        "| hint | ranks | workload | limit | launch cost | variant | fixed ms | RRFP ms | "
        "ratio | sim ms (fixed / RRFP) | sim ratio |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        c = row["config"]
        lines.append(
            f"| {c.hint} | {c.pp} x {c.stages_per_rank} | {c.workload} | {c.limit} | "
            f"{row['cost']:.0%} | {row['variant']} | {row['fixed_ms']:.0f} | "
            f"{row['rrfp_ms']:.0f} | {row['ratio']:.3f} | {row['sim_fixed_ms']:.0f} / "
            f"{row['sim_rrfp_ms']:.0f} | {row['sim_ratio']:.3f} |")
    worst = max(abs(row["ratio"] - row["sim_ratio"]) for row in rows)
    excess = statistics.mean(row[k] / row[f"sim_{k}"] - 1 for row in rows
                             for k in ("fixed_ms", "rrfp_ms"))
    lines += [
        "",
        f"Runtime vs simulator: every measured ratio within {worst:.3f} of the simulated one. "
        f"Absolute step times are {excess:.0%} above the simulated ones on average, for the "
        "fixed schedule and RRFP alike: the simulator counts no transfer time or Python "
        "dispatch, and here 4 processes share 2 cores.",
        "",
        f"## Simulated (speedup over the fixed schedule, mean of {args.seeds} seeds, default "
        "policy)",
        "",
        *grid,
        "",
        f"## The BF/BFW rules at launch depth 2 (simulated, {args.seeds} seeds per row, launch "
        "cost 0)",
        "",
        "At depth 1 every choice is made when the device frees, on the arrivals so far: the "
        "rule applied at device-free time. At depth 2 the rule's pick is launched behind the "
        "running action when it is the hint's next action (``HintLed``), and a backward "
        "that arrives before the device gets to it does not take its place. Ratio: depth-1 "
        "makespan over depth-2 makespan (> 1: depth 2 faster). Per configuration, the "
        "geometric mean over its rows' seeds:",
        "",
        *rules_summary(rule_rows),
        "",
        *rules_table(rule_rows),
    ]
    print(f"wrote {write_page('launch_depth.md', lines)}")


if __name__ == "__main__":
    main()
