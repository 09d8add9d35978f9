"""A pipeline whose emulated device time follows each microbatch's size: torch's 1F1B,
RRFP told the sizes (``step(mb_sizes=...)``) and RRFP not told them, in alternating
rounds, and the simulator's step times for the same durations.

1F1B, 4 ranks, 8 microbatches, ``hint+2``; on every stage a forward takes ``unit_s`` per
token and a backward ``BACKWARD_PER_FORWARD`` times that. ``TOKENS``: of the patterns drawn
from 1, 2, 4 and 10 tokens, one where knowing the sizes gained most in the simulator with
any overhead per action from 0 to 0.7 token-times (what the runtime adds to the emulated
time: launches, wake-ups, bookkeeping), so that the gain does not rest on a tie.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

from rrfp import ScheduleRRFP
from rrfp.core.hints import build_hint
from rrfp.core.limits import resolve_buffer_limits
from rrfp.core.settings import Settings
from rrfp.core.sizes import MicrobatchSize
from rrfp.sim.engine import simulate
from rrfp.sim.workloads import Timing
from rrfp.testing.ab import in_alternating_order
from rrfp.testing.chains import build_stages, loss_fn, make_batch, make_chain, torch_schedule
from rrfp.testing.emulation import EmulatedDevice, EmulatedDeviceTime
from rrfp.testing.study import Study, StudySchedule

TOKENS = (4, 1, 10, 1, 2, 1, 2, 1)
BACKWARD_PER_FORWARD = 2.0
HINT, LIMIT, RANKS = "1F1B", "hint+2", 4
VARIANTS = ("fixed", "sizes", "no sizes")
LEARNING_ROUNDS = 2
"""Rounds before the timed ones: the first runs torch's shape inference (an extra forward
per stage, which would shift the emulated times by a microbatch), so it is given no
sizes; the second fits the durations, and shares the fits before the next."""


def _step(schedule, stages, x, y, sizes) -> None:
    for stage in stages:
        stage.submod.reset()
        for p in stage.submod.parameters():
            p.grad = None
    kwargs = {} if sizes is None else {"mb_sizes": sizes}
    if any(s.is_first for s in stages):
        schedule.step(x, target=y, **kwargs)
    else:
        schedule.step(target=y, **kwargs)


def sized_steps(rank: int, world_size: int, rounds: int, unit_s: float) -> dict:
    """``LEARNING_ROUNDS`` then ``rounds`` timed rounds of the three variants, alternating
    their order. Returns each variant's step times, whether the last round's gradients are
    bitwise torch's, the (stage, kind)s the sized schedule has fits of, what the sized
    schedule's policy predicts per (stage, kind, microbatch) before its last step, the
    seconds its fit sharing took, and each RRFP variant's last step's
    ``size_prediction_error``."""
    n = len(TOKENS)
    chain = make_chain(world_size)
    x, y = make_batch(n)

    def device_time(stage: int, block):
        return EmulatedDeviceTime(block, n, lambda mb: unit_s * TOKENS[mb],
                                  lambda mb: BACKWARD_PER_FORWARD * unit_s * TOKENS[mb])

    runs = {}
    for kind in VARIANTS:
        stages, _ = build_stages(chain, rank, world_size, "loop", wrap=device_time)
        runs[kind] = (torch_schedule(HINT, stages, n) if kind == "fixed" else
                      StudySchedule(stages, n, loss_fn=loss_fn, hint=HINT,
                                    settings=Settings(buffer_limit=LIMIT),
                                    study=Study(device=EmulatedDevice())), stages)
    sizes = [MicrobatchSize(tokens=t) for t in TOKENS]
    sized = runs["sizes"][0]
    times: dict[str, list[float]] = {kind: [] for kind in runs}
    for i in range(LEARNING_ROUNDS + rounds):
        for kind in in_alternating_order(VARIANTS, i):
            schedule, stages = runs[kind]
            dist.barrier()  # also: every rank's fits are published before the next step
            start = time.perf_counter()
            _step(schedule, stages, x, y, sizes if kind == "sizes" and i > 0 else None)
            if i >= LEARNING_ROUNDS:
                times[kind].append(time.perf_counter() - start)
    grads = {kind: [p.grad for s in stages for p in s.submod.parameters()]
             for kind, (_, stages) in runs.items()}
    models = sized.history.models
    result = {
        "times": times,
        "bitwise": all(torch.equal(a, b) for kind in ("sizes", "no sizes")
                       for a, b in zip(grads["fixed"], grads[kind], strict=True)),
        "fits": sorted(models.fits),
        "predicted": {(s, k, m): models.predict(s, k, size)
                      for (s, k) in models.fits for m, size in enumerate(sizes)},
        "sharing_s": sized.fit_sharing_seconds,
        "prediction_error": {kind: runs[kind][0].last_step_stats.size_prediction_error
                             for kind in ("sizes", "no sizes")},
        "sized_steps": LEARNING_ROUNDS + rounds - 1,
    }
    for schedule, _ in runs.values():
        if isinstance(schedule, ScheduleRRFP):
            schedule.close()
    return result


def simulated_step_times(unit_s: float,
                         measured: dict[tuple[int, str, int], float] | None = None
                         ) -> dict[str, float]:
    """The simulator's step times for the same durations (no CPU cost, no link latency),
    each RRFP variant after the same learning rounds: the emulated ones, or ``measured``
    ((stage, kind, microbatch) -> seconds: what the runtime's fits predict, launch and
    bookkeeping overheads included)."""
    hint = build_hint(HINT, num_ranks=RANKS, num_stages=RANKS, n_microbatches=len(TOKENS))
    limits = resolve_buffer_limits(LIMIT, hint)
    zero = [[0.0] * len(TOKENS) for _ in range(RANKS)]
    if measured is None:
        forward = [[unit_s * t for t in TOKENS]] * RANKS
        backward = [[BACKWARD_PER_FORWARD * unit_s * t for t in TOKENS]] * RANKS
    else:
        forward, backward = ([[measured[(s, kind, m)] for m in range(len(TOKENS))]
                              for s in range(RANKS)] for kind in ("F", "B"))
    timing = Timing(forward, backward, zero, zero, zero,
                    tuple(MicrobatchSize(tokens=t) for t in TOKENS))
    times = {"fixed": simulate(hint, timing.duration, policy="fixed").makespan}
    for kind in VARIANTS[1:]:
        histories = None
        for i in range(LEARNING_ROUNDS + 1):
            told = timing.sizes if kind == "sizes" and i > 0 else None
            result = simulate(hint, timing.duration, policy="critical", limits=limits,
                              histories=histories, sizes=told)
            histories = result.histories
        times[kind] = result.makespan
    return times
