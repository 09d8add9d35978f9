"""Per-rank scenarios of the advisor's multi-process tests (run through ``run_local_world``)."""

from __future__ import annotations

import torch.distributed as dist

from rrfp import ScheduleRRFP
from rrfp.device import EmulatedDevice
from rrfp.emulation import EmulatedDeviceTime
from tests.workers import (bitwise_equal, build_stages, loss_fn, make_batch, make_chain,
                           run_steps, torch_schedule)


def in_run_ab(rank: int, world_size: int, steps: int, fixed_every: int) -> dict:
    """GPipe on 2 ranks, emulated device time with one slow forward (stage 0, microbatch
    4: 0.6 s against 0.02 s; the last stage's backwards 0.1 s): ``steps`` training steps of
    ScheduleRRFP (plain readiness-first at the hint's memory) with ``fixed_every``, and
    the same steps under torch's GPipe. Returns every rank's trace events per step, and
    whether gradients and losses were bitwise torch's at every step."""
    n_microbatches = 8
    chain = make_chain(world_size)
    x, y = make_batch(n_microbatches)

    def device_time(stage: int, block):
        backward = 0.1 if stage == world_size - 1 else 0.02
        return EmulatedDeviceTime(block, n_microbatches,
                                  lambda mb: 0.6 if (stage == 0 and mb == 4) else 0.02,
                                  lambda mb: backward)

    stages, blocks = build_stages(chain, rank, world_size, "loop", wrap=device_time)
    schedule = ScheduleRRFP(stages, n_microbatches, loss_fn=loss_fn, hint="GPipe",
                            policy="hint", device=EmulatedDevice(), launch_depth=1,
                            fixed_every=fixed_every)
    traces = []
    history = []
    for _ in range(steps):
        for stage in stages:
            stage.submod.reset()
        dist.barrier()
        history += run_steps(schedule, stages, blocks, x, y, steps=1)
        gathered: list = [None] * world_size
        dist.all_gather_object(gathered, schedule.last_step_stats)
        traces.append([e for stats in gathered for e in stats.chrome_trace_events()])
    schedule.close()
    fixed_stages, fixed_blocks = build_stages(chain, rank, world_size, "loop")
    reference = run_steps(torch_schedule("GPipe", fixed_stages, n_microbatches), fixed_stages,
                          fixed_blocks, x, y, steps=steps)
    return {"traces": traces, "bitwise": bitwise_equal(history, reference)}
