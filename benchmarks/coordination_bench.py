"""TP coordination cost: python -m benchmarks.coordination_bench

PP=2 x TP=2 on 4 gloo processes, hint Interleaved1F1B (2 stages per rank), 8 microbatches,
a DTensor column/row-parallel MLP per stage. Stage compute is **emulated device time**
(10 ms forward, 20 ms backward per microbatch, lognormal jitter with sigma 0.3 drawn
separately on each TP rank, so the ranks of a TP group see different timings). Compares
torch's fixed Interleaved1F1B (no coordination needed) with ScheduleRRFP (plain
readiness-first, limit hint+1) under "leader" and "agree", A/B/C per step. Writes
benchmarks/results/coordination.md.
"""

from __future__ import annotations

import math
import random
import statistics
import time

import torch
import torch.distributed as dist

from benchmarks.pages import write_page
from rrfp import ScheduleRRFP
from rrfp.emulation import EmulatedDeviceTime
from rrfp.local import run_local_world

M, STEPS, UNIT = 8, 6, 0.01


def _rank_main(rank: int, world_size: int) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.pipelining import PipelineStage
    from torch.distributed.pipelining.schedules import ScheduleInterleaved1F1B
    from torch.distributed.tensor.parallel import (
        ColwiseParallel, parallelize_module, RowwiseParallel)

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "tp"))
    pp, tp = mesh["pp"].get_local_rank(), mesh["tp"].get_local_rank()
    tp_group = mesh["tp"].get_group()
    rng = random.Random(rank)

    def jitter() -> float:
        return math.exp(rng.gauss(-0.045, 0.3))

    def stages():
        built = []
        for s in (pp, pp + 2):
            torch.manual_seed(s)
            block = torch.nn.Sequential()
            block.add_module("up", torch.nn.Linear(64, 128))
            block.add_module("act", torch.nn.Tanh())
            block.add_module("down", torch.nn.Linear(128, 64))
            block = parallelize_module(block, mesh["tp"], {"up": ColwiseParallel(), "down": RowwiseParallel()})
            timed = EmulatedDeviceTime(block, M, lambda mb: UNIT * jitter(), lambda mb: 2 * UNIT * jitter())
            built.append(PipelineStage(timed, s, 4, torch.device("cpu"), group=mesh["pp"].get_group()))
        return built

    loss_fn = torch.nn.functional.mse_loss
    runs = {"fixed": (s := stages(), ScheduleInterleaved1F1B(s, M, loss_fn=loss_fn))}
    for mode in ("leader", "agree"):
        s = stages()
        runs[mode] = (s, ScheduleRRFP(s, M, loss_fn=loss_fn, hint="Interleaved1F1B",
                                      buffer_limit="hint+1", policy="hint",
                                      coordination_group=tp_group, coordination=mode))
    x, y = torch.randn(M * 2, 64), torch.randn(M * 2, 64)
    times = {k: [] for k in runs}
    per_step = {k: [] for k in runs if k != "fixed"}
    for step in range(STEPS + 1):
        for name, (st, schedule) in runs.items():
            dist.barrier()
            start = time.perf_counter()
            schedule.step(*((x,) if pp == 0 else ()), target=y)
            dist.barrier()
            if step == 0:
                for stage in st:
                    stage.submod.reset()
                continue
            times[name].append(time.perf_counter() - start)
            if name != "fixed":
                stats = schedule.last_step_stats
                per_step[name].append((stats.coordination_rounds, stats.coordination_deferrals,
                                       stats.coordination_time, stats.dispatched))
    # Raw cost of the collectives themselves, one int64 on the 2-rank gloo TP group.
    one, gathered = torch.zeros(1, dtype=torch.int64), [torch.zeros(1, dtype=torch.int64)] * 2
    raw = {}
    for name, op in (("all_gather", lambda: dist.all_gather(gathered, one, group=tp_group)),
                     ("broadcast", lambda: dist.broadcast(one, src=dist.get_global_rank(tp_group, 0), group=tp_group))):
        samples = []
        for _ in range(200):
            start = time.perf_counter()
            op()
            samples.append(time.perf_counter() - start)
        raw[name] = statistics.median(samples)
    return {"rank": rank, "tp": tp, "times": times, "per_step": per_step, "raw": raw}


def main() -> None:
    started = time.time()
    ranks = run_local_world(4, _rank_main, timeout=900)
    lines = [
        "# TP coordination: leader-decides vs agree-on-proposals (measured, emulated device time)",
        "",
        __doc__.split("\n", 2)[2].strip().replace("\n", " "),
        f"({STEPS} steps after a warm-up step; {time.time() - started:.0f} s on this machine.)",
        "",
        "| schedule | median step ms | settlements per step | deferrals per step | settle time per step (ms, leader / followers) | per settlement (us, leader / followers) |",
        "|---|---|---|---|---|---|",
    ]
    fixed_ms = statistics.median(ranks[0]["times"]["fixed"]) * 1e3
    lines.append(f"| torch Interleaved1F1B | {fixed_ms:.0f} | - | - | - | - |")
    for mode in ("leader", "agree"):
        step_ms = statistics.median(ranks[0]["times"][mode]) * 1e3
        leaders = [r for r in ranks if r["tp"] == 0]
        followers = [r for r in ranks if r["tp"] == 1]

        def median(group, index):
            return statistics.median(s[index] for r in group for s in r["per_step"][mode])

        def per_settlement(group):
            return statistics.median(s[2] / s[0] for r in group for s in r["per_step"][mode]) * 1e6

        lines.append(
            f"| RRFP, {mode} | {step_ms:.0f} | {median(ranks, 0):.0f} | {median(ranks, 1):.0f} | "
            f"{median(leaders, 2) * 1e3:.1f} / {median(followers, 2) * 1e3:.1f} | "
            f"{per_settlement(leaders):.0f} / {per_settlement(followers):.0f} |")
    raw = {k: statistics.median(r["raw"][k] for r in ranks) * 1e6 for k in ("all_gather", "broadcast")}
    lines += [
        "",
        f"Raw latency of one int64 collective on the 2-rank gloo group (median of 200): "
        f"all_gather {raw['all_gather']:.0f} us, broadcast {raw['broadcast']:.0f} us.",
        "Settle time counts everything spent settling an action: the collective, and for a "
        "follower (or after a deferral) the wait until the leader decides or new input "
        "arrives; it is not all overhead.",
    ]
    write_page("coordination.md", lines)
    print("\n".join(lines))


if __name__ == "__main__":
    main()
