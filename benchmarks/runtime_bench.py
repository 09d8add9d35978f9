"""Runtime benchmark: ScheduleRRFP vs the fixed schedule on gloo, A/B in one invocation.

    python -m benchmarks.runtime_bench            # PP=4 and PP=8, writes results/runtime.md

Stage compute is **emulated device time** on the **emulated asynchronous device**
(``rrfp.devices.device.EmulatedDevice``): each forward/backward sleeps for the duration the
workload model (rrfp/sim/workloads.py) draws, 10 ms per mean forward, on the device's
thread; the model itself is a tiny MLP. The baseline is the fixed schedule on the same
device and transport: ``ScheduleRRFP(policy="fixed", launch_depth=None)`` (the hint's
order, launched as far ahead as it likes, as torch's schedules do on CUDA); torch's own
schedules run synchronously and cannot take the injected link latency (``send_delay``).
Each pair runs the baseline and RRFP on the same drawn timings; the simulator's prediction
for those timings stands beside each measurement.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.pipelining import PipelineStage

from benchmarks.pages import result_path, write_page
from rrfp import Settings
from rrfp.core.hints import build_hint
from rrfp.sim.study import compare
from rrfp.sim.workloads import make_timing, Timing
from rrfp.testing.emulation import EmulatedDevice, EmulatedDeviceTime
from rrfp.testing.study import Study, StudySchedule
from rrfp.testing.worlds import run_local_world

DIM = 16


@dataclass(frozen=True)
class Config:
    pp: int
    workload: str
    limit: str | int
    microbatches: int = 16
    pairs: int = 5
    unit_s: float = 0.01


def _timing(config: Config, pair: int) -> Timing:
    return make_timing(config.workload, config.pp, config.microbatches, seed=1000 + pair)


def _rank_main(rank: int, world_size: int, config: Config) -> dict:
    current: dict[str, Timing] = {"timing": _timing(config, 0)}
    unit = config.unit_s

    def stage(kind: str) -> PipelineStage:
        torch.manual_seed(rank)
        block = torch.nn.Sequential(torch.nn.Linear(DIM, DIM), torch.nn.Tanh())
        timed = EmulatedDeviceTime(
            block, config.microbatches,
            forward_time=lambda mb: current["timing"].forward[rank][mb] * unit,
            backward_time=lambda mb: (current["timing"].backward_input[rank][mb]
                                      + current["timing"].backward_weight[rank][mb]) * unit)
        return PipelineStage(timed, rank, world_size, torch.device("cpu"))

    latency = config.workload in ("latency", "spikes")

    def send_delay(edge, mb):
        return current["timing"].latency(edge, mb) * unit

    loss_fn = torch.nn.functional.mse_loss
    baseline_stage, rrfp_stage = stage("baseline"), stage("rrfp")
    delay = send_delay if latency else None
    baseline = StudySchedule(baseline_stage, config.microbatches, loss_fn=loss_fn, hint="1F1B",
                             settings=Settings(policy="fixed", launch_depth=None),
                             study=Study(send_delay=delay, device=EmulatedDevice()))
    rrfp = StudySchedule(rrfp_stage, config.microbatches, loss_fn=loss_fn, hint="1F1B",
                         settings=Settings(buffer_limit=config.limit),
                         study=Study(send_delay=delay, device=EmulatedDevice()))
    x = torch.randn(config.microbatches * 2, DIM)
    y = torch.randn(config.microbatches * 2, DIM)
    times: dict[str, list[float]] = {"baseline": [], "rrfp": []}
    overheads, stats = [], None
    for pair in range(config.pairs + 1):  # pair 0 warms up (shape inference, history)
        current["timing"] = _timing(config, pair)
        for name, schedule, st in (("baseline", baseline, baseline_stage), ("rrfp", rrfp, rrfp_stage)):
            dist.barrier()
            start = time.perf_counter()
            schedule.step(*((x,) if rank == 0 else ()), target=y)
            dist.barrier()  # the step ends when its last rank ends
            elapsed = time.perf_counter() - start
            if pair == 0:
                st.submod.reset()
            else:
                times[name].append(elapsed)
        if pair > 0:
            overheads.append(rrfp.last_step_stats.overhead_per_action)
            stats = rrfp.last_step_stats
    baseline.close()
    rrfp.close()
    return {"times": times, "overhead": statistics.median(overheads), "idle": stats.idle_fraction,
            "peak": stats.peak_in_flight, "hint_peak": stats.hint_peak_in_flight,
            "policy": rrfp.policy, "baseline": "fixed order (same device)"}


def run(config: Config) -> dict:
    ranks = run_local_world(config.pp, _rank_main, config, timeout=600)
    baseline = ranks[0]["times"]["baseline"]
    rrfp = ranks[0]["times"]["rrfp"]
    ratios = [b / r for b, r in zip(baseline, rrfp)]
    hint = build_hint("1F1B", num_ranks=config.pp, num_stages=config.pp,
                      n_microbatches=config.microbatches)
    predicted = [compare(hint, _timing(config, pair), 0, limit=config.limit,
                         policy=ranks[0]["policy"]) for pair in range(1, config.pairs + 1)]
    return {
        "config": config.__dict__,
        "baseline": ranks[0]["baseline"],
        "policy": ranks[0]["policy"],
        "baseline_ms": statistics.median(baseline) * 1e3,
        "rrfp_ms": statistics.median(rrfp) * 1e3,
        "ratio_median": statistics.median(ratios),
        "ratio_min": min(ratios),
        "ratio_max": max(ratios),
        "sim_baseline_ms": statistics.median(p.fixed.makespan for p in predicted) * config.unit_s * 1e3,
        "sim_rrfp_ms": statistics.median(p.rrfp.makespan for p in predicted) * config.unit_s * 1e3,
        "sim_ratio": statistics.median(p.speedup for p in predicted),
        "idle": [r["idle"] for r in ranks],
        "peak": {s: p for r in ranks for s, p in r["peak"].items()},
        "hint_peak": {s: p for r in ranks for s, p in r["hint_peak"].items()},
        "overhead_us": statistics.median(r["overhead"] for r in ranks) * 1e6,
    }


CONFIGS = [Config(pp, w, limit) for pp in (4, 8)
           for w, limit in (("uniform", "hint"), ("jitter", "hint"), ("jitter", "hint+2"),
                            ("multimodal", "hint+2"), ("spikes", "hint"), ("spikes", "hint+2"),
                            ("latency", 32))]


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--pp", type=int, nargs="*", default=[4, 8])
    parser.add_argument("--pairs", type=int, default=5)
    args = parser.parse_args(argv)
    started = time.time()
    results = []
    for config in CONFIGS:
        if config.pp not in args.pp:
            continue
        config = Config(config.pp, config.workload, config.limit, pairs=args.pairs)
        result = run(config)
        results.append(result)
        print(f"PP={config.pp} {config.workload:10s} limit {config.limit!s:7s} "
              f"{result['baseline']}: {result['baseline_ms']:.0f} ms, RRFP ({result['policy']}): "
              f"{result['rrfp_ms']:.0f} ms, ratio {result['ratio_median']:.3f} "
              f"[{result['ratio_min']:.3f}, {result['ratio_max']:.3f}], sim {result['sim_ratio']:.3f} "
              f"({result['sim_baseline_ms']:.0f} / {result['sim_rrfp_ms']:.0f} ms), overhead "
              f"{result['overhead_us']:.0f} us/action", flush=True)
    with open(result_path("runtime.json"), "w") as f:
        json.dump(results, f, indent=1)
    worst = max(abs(r["ratio_median"] - r["sim_ratio"]) for r in results)
    excess = statistics.mean(r[k] / r[f"sim_{k}"] - 1 for r in results
                             for k in ("baseline_ms", "rrfp_ms"))
    lines = [
        "# Runtime benchmark: ScheduleRRFP vs the fixed schedule (gloo, emulated asynchronous device)",
        "",
        f"Regenerate with `python -m benchmarks.runtime_bench` ({time.time() - started:.0f} s "
        "on this 2-core machine). Hint 1F1B, one stage per rank, 16 microbatches, "
        f"{args.pairs} A/B pairs after a warm-up pair. Compute is **emulated device time** "
        "on the emulated asynchronous device (sleeps of the workload model's durations, 10 "
        "ms per mean forward, around a tiny MLP); the baseline is the fixed order on the "
        "same device; step time is measured on rank 0 between barriers. Ratio: baseline / RRFP "
        "step time per pair, `median [min, max]`. *sim*: the simulator's prediction for the "
        "same drawn timings (median). Overhead: median over ranks and steps of the "
        "arbiter's decision time per action.",
        "",
        f"Reading it: measured ratios are within {worst:.3f} of the simulator's (largest "
        f"difference over the rows). Absolute step times run {excess:.0%} above the simulated "
        "ones on average for *both* schedules: the simulator counts no communication time "
        "or per-action overhead, while here every action also pays a loopback gloo "
        "transfer, sleep overshoot and Python dispatch, with up to 8 processes sharing 2 "
        "cores.",
        "",
        "| ranks | workload | limit | baseline | baseline ms | RRFP policy | RRFP ms | ratio | "
        "sim ms (base / RRFP) | sim ratio | idle per rank | peak in flight (hint) | overhead us/action |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        c = r["config"]
        peaks = ", ".join(f"{r['peak'][s]} ({r['hint_peak'][s]})" for s in sorted(r["peak"], key=int))
        lines.append(
            f"| {c['pp']} | {c['workload']} | {c['limit']} | {r['baseline']} | {r['baseline_ms']:.0f} | "
            f"{r['policy']} | {r['rrfp_ms']:.0f} | {r['ratio_median']:.3f} [{r['ratio_min']:.3f}, "
            f"{r['ratio_max']:.3f}] | {r['sim_baseline_ms']:.0f} / {r['sim_rrfp_ms']:.0f} | "
            f"{r['sim_ratio']:.3f} | {', '.join(f'{i:.0%}' for i in r['idle'])} | {peaks} | "
            f"{r['overhead_us']:.0f} |")
    print(f"wrote {write_page('runtime.md', lines)}")


if __name__ == "__main__":
    main()
