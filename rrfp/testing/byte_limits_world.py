"""A world for the byte limits (``buffer_limit="busiest"``, a byte budget): stages that save
known, different bytes per microbatch, on an emulated asynchronous device, under torch's
1F1B and under ScheduleRRFP at several limits (``tests/test_byte_limits.py`` asserts on it,
``benchmarks/byte_limits_bench.py`` measures with it)."""

from __future__ import annotations

import random
import time

import torch

from rrfp.core.actions import Edge
from rrfp.core.settings import Settings
from rrfp.core.stats import StepStats
from rrfp.runtime.meter import ActivationMeter, MeteredModule
from rrfp.testing.chains import build_stages, loss_fn, torch_schedule
from rrfp.testing.emulation import EmulatedDevice, EmulatedDeviceTime
from rrfp.testing.probes import held_from_order
from rrfp.testing.study import Study, StudySchedule
from rrfp.testing.timing import LATE_S

WIDTH, ROWS = 32, 8
"""Features and rows per microbatch of every stage's input and output (float64)."""
UNIT = WIDTH * ROWS * 8
"""Bytes a stage of widening 1 saves per microbatch."""
WIDENING = (1, 2, 1, 1)
"""Per stage: how many copies of its input it saves (stage 1 saves twice as much, as a
wider block would). Under 1F1B on 4 ranks stage 1's rank, holding 3 microbatches, is then
the busiest in bytes (6 units), rank 0 (4 microbatches) the busiest in microbatches."""


class Widened(torch.nn.Module):
    """Concatenates ``k`` copies of its input, then projects back: the projection saves the
    widened input (``k * UNIT`` bytes per microbatch), and nothing else is saved (the
    weight is a parameter; the repeat saves only shapes)."""

    def __init__(self, k: int):
        super().__init__()
        self.k = k
        self.project = torch.nn.Linear(k * WIDTH, WIDTH, dtype=torch.float64)

    def forward(self, x):
        return self.project(x.repeat(1, self.k))


class StepClock:
    """Emulated device times that depend only on (stage, step, microbatch, kind), so that
    torch's schedule and RRFP run the same work: ``base_s``, and one microbatch in five several
    times longer (a long sequence), drawn afresh for every step."""

    def __init__(self, seed: int, base_s: float):
        self.seed = seed
        self.base_s = base_s
        self.step = 0

    def seconds(self, stage: int, mb: int, kind: str) -> float:
        rng = random.Random(f"{self.seed}/{stage}/{self.step}/{mb}/{kind}")
        return self.base_s * (4 if rng.random() < 0.2 else 1)

    def wrap(self, stage: int, block: torch.nn.Module) -> EmulatedDeviceTime:
        return EmulatedDeviceTime(block, self.n_microbatches,
                                  lambda mb: self.seconds(stage, mb, "F"),
                                  lambda mb: self.seconds(stage, mb, "B"))


def byte_limits_world(rank: int, world_size: int, runs: list[tuple[str, str | None]],
                      steps: int = 4, seed: int = 0, base_s: float = 0.002,
                      late_gradient: bool = False) -> dict:
    """1F1B on ``world_size`` ranks, one ``Widened`` stage each, 4 microbatches per rank:
    torch's Schedule1F1B metered by an ``ActivationMeter`` around the stage (its peak bytes
    per step), then ScheduleRRFP at each ``(buffer_limit, policy)`` of ``runs`` (metered
    every step; policy None: the default); per run, keyed ``"limit/policy"``, the
    last step's stats, the microbatches held recomputed from the realized order, the step
    times (wall clock around ``step``, both schedules alike), and whether the gradients
    are bitwise torch's. ``late_gradient``: in ScheduleRRFP's last step stage 0's first
    gradient comes ``LATE_S`` late, so that rank 0 has the time to run forwards ahead as
    far as its limit lets it."""
    num_stages, M = world_size, 4 * world_size
    torch.manual_seed(0)
    chain = [Widened(WIDENING[s % len(WIDENING)]) for s in range(num_stages)]
    g = torch.Generator().manual_seed(1)
    x = torch.randn(M * ROWS, WIDTH, generator=g, dtype=torch.float64)
    y = torch.randn(M * ROWS, WIDTH, generator=g, dtype=torch.float64)
    inputs = (x,) if rank == 0 else ()

    def run(make_schedule, meter: ActivationMeter | None = None) -> dict:
        clock = StepClock(seed, base_s)
        clock.n_microbatches = M

        def late_in_last_step(edge: Edge, mb: int) -> float:
            late = late_gradient and (edge, mb, clock.step) == (Edge(1, 0), 0, steps - 1)
            return LATE_S if late else 0.0

        def wrap(s, block):
            timed = clock.wrap(s, block)
            return MeteredModule(timed, meter) if meter is not None else timed

        stages, blocks = build_stages(chain, rank, world_size, "loop", wrap=wrap)
        schedule = make_schedule(stages, late_in_last_step)
        optimizer = torch.optim.SGD([p for b in blocks for p in b.parameters()], lr=0.1)
        grads, times, fixed_bytes = [], [], []
        for step in range(steps):
            clock.step = step
            for stage in stages:
                (stage.submod.inner if meter is not None else stage.submod).reset()
            if meter is not None:
                meter.reset(p for b in blocks for p in b.parameters())
            optimizer.zero_grad(set_to_none=True)
            start = time.perf_counter()
            schedule.step(*inputs, target=y, return_outputs=False)
            if meter is not None:
                fixed_bytes.append(meter.peak)
            times.append(time.perf_counter() - start)
            grads.append([p.grad.clone() for b in blocks for p in b.parameters()])
            optimizer.step()
        return {"schedule": schedule, "grads": grads, "times": times,
                "fixed_bytes": fixed_bytes}

    fixed = run(lambda stages, _: torch_schedule("1F1B", stages, M), meter=ActivationMeter())
    # From the second step: the first also runs torch's shape inference.
    results: dict = {"fixed_bytes": max(fixed["fixed_bytes"][1:]), "fixed_times": fixed["times"],
                     "fixed_held": held_from_order(
                         a for a in fixed["schedule"].pipeline_order[rank] if a is not None)[1],
                     "per_microbatch": WIDENING[rank % len(WIDENING)] * UNIT}
    for limit, policy in runs:
        key = f"{limit}/{policy}"
        try:
            settings = Settings(buffer_limit=limit, policy=policy, stall_timeout=60,
                                meter_every=1)
            outcome = run(lambda stages, send_delay: StudySchedule(
                stages, M, loss_fn=loss_fn, hint="1F1B", settings=settings,
                study=Study(device=EmulatedDevice(), send_delay=send_delay)))
        except ValueError as e:
            results[key] = {"error": str(e)}
            continue
        schedule = outcome["schedule"]
        stats = schedule.last_step_stats
        schedule.close()
        results[key] = _outcome(stats, outcome, fixed["grads"])
    return results


def _outcome(stats: StepStats, run: dict, fixed_grads: list) -> dict:
    """What is read of one ScheduleRRFP run: its last step's stats, the microbatches held
    recomputed from its realized order, its step times, whether its gradients are bitwise
    ``fixed_grads``."""
    return {
        "policy": stats.policy,
        "peak_bytes": stats.peak_activation_bytes,
        "held": held_from_order(stats.realized_order)[1],
        "rank_limit": stats.rank_buffer_limit,
        "hint_rank_peak": stats.hint_rank_peak,
        "per_microbatch": stats.activation_bytes_per_microbatch,
        "budget": stats.rank_budget_bytes, "limit_bytes": stats.rank_limit_bytes,
        "busiest_bytes": stats.busiest_rank_peak_bytes,
        "out_of_order": stats.out_of_hint_order,
        "times": run["times"],
        "bitwise": all(torch.equal(a, b) for ga, gb in zip(run["grads"], fixed_grads)
                       for a, b in zip(ga, gb)),
    }
