"""A world for self-driving RRFP (``Settings(tune_within=...)``): the byte-limits world's
stages (known, different bytes per microbatch) on an emulated asynchronous device, run by
torch's 1F1B and then by a self-driving ScheduleRRFP over the same steps
(``tests/test_self_driving.py`` asserts on it, ``benchmarks/self_driving_emulated.py``
measures with it). The emulated durations depend only on (stage, step, microbatch, kind)
and a family: both schedules run the same work."""

from __future__ import annotations

import random
import time
from collections.abc import Sequence

import torch

from rrfp.advise.cost import CPU_SHARE
from rrfp.advise.measured import MeasuredRun
from rrfp.advise.tuning import predict_candidates
from rrfp import ScheduleRRFP
from rrfp.core.settings import Settings
from rrfp.core.sizes import MicrobatchSize
from rrfp.core.stats import StepStats
from rrfp.core.tuning import Candidate, Predicted
from rrfp.runtime.meter import ActivationMeter, MeteredModule
from rrfp.testing.byte_limits_world import ROWS, WIDENING, Widened, WIDTH
from rrfp.testing.chains import build_stages, loss_fn, torch_schedule
from rrfp.testing.emulation import EmulatedDevice, EmulatedDeviceTime
from rrfp.testing.study import Study, StudySchedule

FAMILIES = ("gains", "uniform", "static-loses", "regime-change")
"""``uniform``: every action alike (nothing to gain); ``gains``: one microbatch in five takes four times as long, on every stage (a long
sequence); ``static-loses``: stage 0 costs one to five times the others with the
microbatch's images, the bottleneck; ``regime-change``: uniform until half the steps, then
``gains``."""


def predicts_no_gain(run: MeasuredRun, limits: Sequence[str],
                     hints: Sequence[str]) -> list[Predicted]:
    """Every candidate as fast as the fixed schedule: forces the "no gain" path."""
    return [Predicted(Candidate(limit), 1.0) for limit in limits]


def predicts_without_sizes(run: MeasuredRun, limits: Sequence[str],
                           hints: Sequence[str]) -> list[Predicted]:
    """Where every measured step's trace carried its microbatch sizes: the critical policy
    at the budget's top limit, not told the sizes, predicted fastest (forces a switch to a
    setting without sizes); else no gain."""
    if any(step.timing.sizes is None for step in run.steps):
        return predicts_no_gain(run, limits, hints)
    return [Predicted(Candidate("hint"), 1.0),
            Predicted(Candidate(limits[-1], "critical", use_sizes=False), 1.5)]


def predicts_top_limit(run: MeasuredRun, limits: Sequence[str],
                       hints: Sequence[str]) -> list[Predicted]:
    """The budget's top limit under the default policy predicted well above the switch
    margin, every other limit as fast as the fixed schedule: forces a switch (the advisor's
    own predictions from a few emulated steps spread too widely around this world's small
    gain to force one)."""
    return [Predicted(Candidate(limit), 1.2 if limit == limits[-1] else 1.0)
            for limit in limits]


def predicts_other_hint(run: MeasuredRun, limits: Sequence[str],
                        hints: Sequence[str]) -> list[Predicted]:
    """The first interchangeable hint ranking at the budget's top limit predicted fastest
    (forces a switch to another hint); no gain where no hint is offered."""
    if not hints:
        return predicts_no_gain(run, limits, hints)
    return [Predicted(Candidate("hint"), 1.0),
            Predicted(Candidate(limits[-1], hint=hints[0]), 1.5)]


PREDICTORS = {"advisor": predict_candidates, "no gain": predicts_no_gain,
              "without sizes": predicts_without_sizes, "top limit": predicts_top_limit,
              "other hint": predicts_other_hint}


class FamilyClock:
    """Emulated seconds of each (stage, microbatch, kind) in the current ``step``."""

    def __init__(self, family: str, steps: int, seed: int, base_s: float):
        if family not in FAMILIES:
            raise ValueError(f"unknown family {family!r}: use one of {list(FAMILIES)}")
        self.family, self.steps, self.seed, self.base_s = family, steps, seed, base_s
        self.step = 0

    def _draw(self, mb: int) -> tuple[bool, int]:
        """The current step's microbatch ``mb``: a long sequence or not, and its images."""
        rng = random.Random(f"{self.seed}/{self.step}/{mb}")
        return rng.random() < 0.2, rng.randint(0, 8)

    def sizes(self, n_microbatches: int) -> list[MicrobatchSize]:
        """The current step's microbatch sizes, as a data loader knows them."""
        return [MicrobatchSize(tokens=4 if long_sequence else 1, images=images)
                for long_sequence, images in map(self._draw, range(n_microbatches))]

    def seconds(self, stage: int, mb: int, kind: str) -> float:
        long_sequence, images = self._draw(mb)
        if self.family == "static-loses":
            return self.base_s * ((1 + images / 2) if stage == 0 else 1.0)
        if self.family == "uniform" or (self.family == "regime-change"
                                        and self.step < self.steps // 2):
            return self.base_s
        return self.base_s * (4 if long_sequence else 1)

    def wrap(self, stage: int, block: torch.nn.Module, n_microbatches: int
             ) -> EmulatedDeviceTime:
        return EmulatedDeviceTime(block, n_microbatches,
                                  lambda mb: self.seconds(stage, mb, "F"),
                                  lambda mb: self.seconds(stage, mb, "B"))


RECORDED = {"policy": "policy", "limits": "rank_buffer_limit",
            "bytes": "peak_activation_bytes", "sizes": "sizes", "sizes_used": "sizes_used",
            "size_error": "size_prediction_error", "ranked_by": "ranked_by"}
"""Per key the world records each step under: the ``StepStats`` field it reads."""


def _record(out: dict, stats: StepStats | None, meter: ActivationMeter | None) -> None:
    """A step's stats where the schedule keeps them (RRFP's); else the meter's bytes."""
    if stats is not None:
        for key, name in RECORDED.items():
            out[key].append(getattr(stats, name))
    elif meter is not None:
        out["bytes"].append(meter.peak)


def self_driving_world(rank: int, world_size: int, family: str, steps: int,
                       budget: str = "hint+2", seed: int = 0, base_s: float = 0.002,
                       predictor: str | None = "advisor", cpu_share: float = CPU_SHARE,
                       sizes: bool = False, tune_hints: bool = False) -> dict:
    """1F1B on ``world_size`` ranks, one stage each, 4 microbatches per rank: torch's
    Schedule1F1B (metered), then ScheduleRRFP with ``tune_within=budget`` (metered every
    step), ``steps`` steps each; ``predictor``: one of ``PREDICTORS``, run at once in the
    rank's process (None: the advisor in a child, as in a job, within ``cpu_share`` of the
    host's CPU: decisions come when it is done). Returns per schedule the step times, and for the
    self-driving one per step its policy, limits and peak bytes, whether its gradients
    are bitwise torch's in every step, the decisions it logged, and how many keys the
    store held more after it; ``sizes``: its steps are given their microbatch sizes
    (``FamilyClock.sizes``), and it returns per step the sizes its stats recorded, whether
    its policy was told them, and its ``size_prediction_error``; ``tune_hints``:
    ``Settings.tune_hints`` (each step records the hint that ranked it, ``ranked_by``)."""
    num_stages, M = world_size, 4 * world_size
    torch.manual_seed(0)
    chain = [Widened(WIDENING[s % len(WIDENING)]) for s in range(num_stages)]
    g = torch.Generator().manual_seed(1)
    x = torch.randn(M * ROWS, WIDTH, generator=g, dtype=torch.float64)
    y = torch.randn(M * ROWS, WIDTH, generator=g, dtype=torch.float64)
    inputs = (x,) if rank == 0 else ()

    def run(make_schedule, meter: ActivationMeter | None = None) -> dict:
        clock = FamilyClock(family, steps, seed, base_s)

        def wrap(s, block):
            timed = clock.wrap(s, block, M)
            return MeteredModule(timed, meter) if meter is not None else timed

        stages, blocks = build_stages(chain, rank, world_size, "loop", wrap=wrap)
        schedule = make_schedule(stages)
        optimizer = torch.optim.SGD([p for b in blocks for p in b.parameters()], lr=0.1)
        out: dict = {"grads": [], "times": [], **{key: [] for key in RECORDED}}
        sized = sizes and isinstance(schedule, ScheduleRRFP)  # torch's take none
        for step in range(steps):
            clock.step = step
            for stage in stages:
                (stage.submod.inner if meter is not None else stage.submod).reset()
            if meter is not None:
                meter.reset(p for b in blocks for p in b.parameters())
            optimizer.zero_grad(set_to_none=True)
            start = time.perf_counter()
            given = {"mb_sizes": clock.sizes(M)} if sized else {}
            schedule.step(*inputs, target=y, return_outputs=False, **given)
            out["times"].append(time.perf_counter() - start)
            out["grads"].append([p.grad.clone() for b in blocks for p in b.parameters()])
            _record(out, getattr(schedule, "last_step_stats", None), meter)
            optimizer.step()
        out["schedule"] = schedule
        return out

    fixed = run(lambda stages: torch_schedule("1F1B", stages, M), meter=ActivationMeter())
    settings = Settings(tune_within=budget, tune_hints=tune_hints, stall_timeout=60, meter_every=1)
    predict = None if predictor is None else PREDICTORS[predictor]
    # The job's store is a prefix of the default one, which counts the keys of both.
    store = torch.distributed.distributed_c10d._get_default_store()
    keys_before = store.num_keys()
    try:
        tuned = run(lambda stages: StudySchedule(stages, M, loss_fn=loss_fn, hint="1F1B",
                                                 settings=settings,
                                                 study=Study(device=EmulatedDevice(),
                                                             predict_inline=predict,
                                                             prediction_cpu_share=cpu_share)))
    except ValueError as e:
        return {"error": str(e), "fixed_bytes": max(fixed["bytes"][1:])}
    schedule = tuned["schedule"]
    decisions = schedule.tuning_decisions
    schedule.close()
    torch.distributed.barrier()  # every rank's keys are in
    return {
        "keys_added": store.num_keys() - keys_before,
        "fixed_times": fixed["times"], "fixed_bytes": max(fixed["bytes"][1:]),
        "times": tuned["times"], "policy": tuned["policy"], "limits": tuned["limits"],
        "bytes": tuned["bytes"], "decisions": decisions, "sizes": tuned["sizes"],
        "sizes_used": tuned["sizes_used"], "size_error": tuned["size_error"],
        "ranked_by": tuned["ranked_by"],
        "bitwise": [all(torch.equal(a, b) for a, b in zip(ga, gb))
                    for ga, gb in zip(tuned["grads"], fixed["grads"])],
    }
