"""Per-rank scenario functions for the multi-process tests (run through ``run_world``)."""

from __future__ import annotations

import copy
import inspect
import datetime
import random
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining._utils import generate_stage_to_rank_mapping
from torch.distributed.pipelining.schedules import get_schedule_class, PipelineScheduleSingle

from rrfp import PipelineStallError, ScheduleRRFP
from rrfp._torch_compat import forward_states_held
from rrfp.device import EmulatedDevice
from rrfp.emulation import EmulatedDeviceTime
from rrfp.actions import Edge
from rrfp.hints import build_hint
from rrfp.loop import DEFAULT_LAUNCH_DEPTH
from rrfp.stats import StepStats
from rrfp.channels import make_channel_group

DIM = 8
BATCH_PER_MICROBATCH = 2
loss_fn = torch.nn.functional.mse_loss


def make_chain(num_stages: int, seed: int = 0) -> list[torch.nn.Module]:
    """One small float64 block per stage; the whole model is their composition."""
    torch.manual_seed(seed)
    return [
        torch.nn.Sequential(torch.nn.Linear(DIM, DIM), torch.nn.Tanh()).double()
        for _ in range(num_stages)
    ]


def make_batch(n_microbatches: int, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    n = n_microbatches * BATCH_PER_MICROBATCH
    return (torch.randn(n, DIM, generator=g, dtype=torch.float64),
            torch.randn(n, DIM, generator=g, dtype=torch.float64))


def local_stage_indices(rank: int, num_ranks: int, num_stages: int, layout: str) -> list[int]:
    mapping = generate_stage_to_rank_mapping(num_ranks, num_stages, style=layout)
    return [s for s in range(num_stages) if mapping[s] == rank]


def build_stages(chain, rank, num_ranks, layout, wrap: Callable | None = None):
    """Fresh copies of this rank's blocks as PipelineStages (and the blocks themselves)."""
    indices = local_stage_indices(rank, num_ranks, len(chain), layout)
    blocks = [copy.deepcopy(chain[s]) for s in indices]
    modules = [wrap(s, b) if wrap else b for s, b in zip(indices, blocks)]
    stages = [PipelineStage(m, s, len(chain), torch.device("cpu")) for m, s in zip(modules, indices)]
    return stages, blocks


def torch_schedule(name: str, stages, n_microbatches: int, **kwargs):
    cls = get_schedule_class(name)
    if issubclass(cls, PipelineScheduleSingle):
        return cls(stages[0], n_microbatches, loss_fn=loss_fn, **kwargs)
    return cls(stages, n_microbatches, loss_fn=loss_fn, **kwargs)


def run_steps(schedule, stages, blocks, x, y, steps: int):
    """``steps`` optimizer steps; per step the local grads and the (last stage) losses."""
    optimizer = torch.optim.SGD([p for b in blocks for p in b.parameters()], lr=0.1)
    history = []
    for _ in range(steps):
        optimizer.zero_grad(set_to_none=True)
        losses: list[torch.Tensor] = []
        if any(s.is_first for s in stages):
            schedule.step(x, target=y, losses=losses)
        else:
            schedule.step(target=y, losses=losses)
        history.append(([p.grad.clone() for b in blocks for p in b.parameters()],
                        [loss.detach().clone() for loss in losses]))
        optimizer.step()
    return history


def reference_steps(chain, x, y, steps: int, local: list[int]):
    """The same training without pipelining: full batch, full model."""
    chain = [copy.deepcopy(b) for b in chain]
    optimizer = torch.optim.SGD([p for b in chain for p in b.parameters()], lr=0.1)
    history = []
    for _ in range(steps):
        optimizer.zero_grad(set_to_none=True)
        out = x
        for block in chain:
            out = block(out)
        loss = loss_fn(out, y)
        loss.backward()
        history.append(([p.grad.clone() for s in local for p in chain[s].parameters()],
                        loss.detach()))
        optimizer.step()
    return history


def bitwise_equal(a, b) -> bool:
    return all(
        len(ga) == len(gb) and all(torch.equal(u, v) for u, v in zip(ga, gb))
        and len(la) == len(lb) and all(torch.equal(u, v) for u, v in zip(la, lb))
        for (ga, la), (gb, lb) in zip(a, b)
    )


def random_device_time(seed: int, stage: int, n_microbatches: int, max_s: float):
    """Wrapper factory: every forward/backward call sleeps a fresh random time."""
    rng = random.Random(seed * 1000 + stage)
    return lambda block: EmulatedDeviceTime(
        block, n_microbatches,
        forward_time=lambda mb: rng.uniform(0, max_s),
        backward_time=lambda mb: rng.uniform(0, max_s),
    )


def random_send_delay(seed: int, max_s: float,
                      late: dict[tuple[Edge, int], float] | None = None):
    """``send_delay`` for ScheduleRRFP: a fresh random delay per message; each message of
    ``late`` ((edge, microbatch) -> seconds) takes that much longer (and, a channel being
    FIFO, so do those after it on its edge)."""
    rng = random.Random(seed)
    late = late or {}

    def delay(edge: Edge, mb: int) -> float:
        return rng.uniform(0, max_s) + late.get((edge, mb), 0.0)
    return delay


LATE_S = 0.3
"""How much later a message made late to force an order arrives: about ten times what a
loaded machine (load 15 on 2 cores) adds to an action or a message (tens of milliseconds),
so that the work it lets pass is ready first whatever the scheduling noise."""


SECOND_ACTIVATION_LATE = {(Edge(0, 1), 1): LATE_S}
"""``random_send_delay``'s ``late`` that makes actions run out of the hint's order: stage 1
waits for microbatch 1's activation (and, the channel being FIFO, for the later ones)
while other work is ready, on its rank or on stage 0's (forwards ahead of a backward whose
gradient waits on stage 1), at any limit with room for it; even where the hint leaves
none (LoopedBFS), a later stage's forward of microbatch 0 passes it."""


def replicas_apart(hint: str, replica: int) -> dict[tuple[Edge, int], float]:
    """Late messages (``random_send_delay``'s ``late``) that make two data-parallel
    replicas of a 2-rank, 4-stage, 4-microbatch pipeline, readiness-first with memory for
    one microbatch more than the hint, run a pair of one pipeline rank's actions in
    opposite orders. Interleaved1F1B: pipeline rank 1's hint runs 1B1, then 3F2, whose
    input rank 0 sends right after 1B1's gradient; replica 0 gets 3F2's input late (1B1
    runs first), replica 1 1B1's gradient (3F2 runs first). ZBVZeroBubble: the same with
    0I0, then 3F2, on pipeline rank 0."""
    keeps_order, reverses_it = {
        "Interleaved1F1B": ((Edge(2, 3), 2), (Edge(2, 1), 1)),
        "ZBVZeroBubble": ((Edge(2, 3), 2), (Edge(1, 0), 0)),
    }[hint]
    return {(keeps_order, reverses_it)[replica]: LATE_S}


@dataclass(frozen=True)
class FidelityCase:
    hint: object
    """What ScheduleRRFP gets as hint (a name, or "csv"/"dict" built from ``reference``)."""
    reference: str
    """torch's fixed schedule to compare with bitwise."""
    stages_per_rank: int
    layout: str
    n_microbatches: int
    delay_seeds: tuple[int, ...]
    steps: int = 3
    max_delay_s: float = 0.003


def fidelity(rank: int, world_size: int, case: FidelityCase, tmpdir: str) -> dict:
    num_stages = world_size * case.stages_per_rank
    chain = make_chain(num_stages)
    x, y = make_batch(case.n_microbatches)
    local = local_stage_indices(rank, world_size, num_stages, case.layout)
    M = case.n_microbatches

    stages, blocks = build_stages(chain, rank, world_size, case.layout)
    fixed_schedule = torch_schedule(case.reference, stages, M)
    fixed = run_steps(fixed_schedule, stages, blocks, x, y, case.steps)

    hint = case.hint
    if hint == "csv":
        hint = f"{tmpdir}/hint.csv"
        if rank == 0:
            fixed_schedule._dump_csv(hint, format="compute_only")
        dist.barrier()
    elif hint == "dict":
        hint = {r: list(acts) for r, acts in fixed_schedule.pipeline_order.items()}

    results: dict[str, dict] = {}
    for i, seed in enumerate((None, *case.delay_seeds)):
        buffer_limit = ("hint", "hint+2", "hint+1")[i % 3]
        # Delayed runs go on the emulated asynchronous device, two in three with launch
        # depth 1 (decide only when the device is idle), the others unbounded.
        device, launch_depth = None, DEFAULT_LAUNCH_DEPTH
        if seed is None:
            wrap, send_delay = None, None
        else:
            device, launch_depth = EmulatedDevice(), (None, 1, 1)[i % 3]
            wrap = lambda s, b: random_device_time(seed, s, M, case.max_delay_s)(b)  # noqa: E731
            # The first reorders actions whatever the noise.
            send_delay = random_send_delay(seed * 7919 + rank, case.max_delay_s,
                                           SECOND_ACTIVATION_LATE if i == 1 else None)
        stages, blocks = build_stages(chain, rank, world_size, case.layout, wrap=wrap)
        schedule = ScheduleRRFP(stages, M, loss_fn=loss_fn, hint=hint, send_delay=send_delay,
                                buffer_limit=buffer_limit, stall_timeout=60, device=device,
                                launch_depth=launch_depth)
        history = run_steps(schedule, stages, blocks, x, y, case.steps)
        schedule.close()
        stats = schedule.last_step_stats
        results["plain" if seed is None else f"seed{seed}"] = {
            "bitwise": bitwise_equal(history, fixed),
            "out_of_order": stats.out_of_hint_order,
            "peak": stats.peak_in_flight,
            "limits": {s: stats.buffer_limits[s] for s in local},
            "device": stats.device,
            "launch_depth": stats.launch_depth,
            "most_behind": device.most_behind if device is not None else None,
        }

    reference = reference_steps(chain, x, y, case.steps, local)
    grad_err = max(
        (g - r).abs().max().item()
        for (grads, _), (ref_grads, _) in zip(fixed, reference)
        for g, r in zip(grads, ref_grads)
    )
    has_last = (num_stages - 1) in local
    loss_err = max(
        abs(torch.stack(losses).mean().item() - ref_loss.item())
        for (_, losses), (_, ref_loss) in zip(fixed, reference)
    ) if has_last else 0.0
    return {"runs": results, "grad_err": grad_err, "loss_err": loss_err,
            "n_losses": len(fixed[0][1]), "has_last": has_last}


def outputs_and_eval(rank: int, world_size: int, hint: str, reference: str,
                     stages_per_rank: int, layout: str) -> dict:
    """Returned outputs of a training step, then an eval step: RRFP vs torch, bitwise.

    torch 2.13's own runtime fails eval on V placements (it runs the backward actions
    and asserts), so there the eval output is checked against the unpipelined model.
    """
    M = 2 * world_size
    chain = make_chain(world_size * stages_per_rank)
    x, y = make_batch(M)
    results = {}
    out_of_order = {}
    for kind in ("fixed", "rrfp"):
        if kind == "fixed":
            stages, _ = build_stages(chain, rank, world_size, layout)
            schedule = torch_schedule(reference, stages, M)
        else:  # random delays, a late activation that reorders actions, memory slack
            stages, _ = build_stages(chain, rank, world_size, layout,
                                     wrap=lambda s, b: random_device_time(5, s, M, 0.003)(b))
            schedule = ScheduleRRFP(stages, M, loss_fn=loss_fn, hint=hint, device=EmulatedDevice(),
                                    launch_depth=1, stall_timeout=60, buffer_limit="hint+1",
                                    policy="hint",  # the default at hint+1 follows the hint here
                                    send_delay=random_send_delay(rank, 0.003,
                                                                 SECOND_ACTIVATION_LATE))
        inputs = (x,) if any(s.is_first for s in stages) else ()
        train_losses: list = []
        train_out = schedule.step(*inputs, target=y, losses=train_losses)
        if kind == "rrfp":
            out_of_order["train"] = schedule.last_step_stats.out_of_hint_order
        eval_losses: list = []
        if kind == "fixed" and layout == "v":
            eval_out = None
        else:
            with torch.no_grad():
                eval_out = schedule.eval(*inputs, target=y, losses=eval_losses)
        if kind == "rrfp":
            out_of_order["eval"] = schedule.last_step_stats.out_of_hint_order
            schedule.close()
        results[kind] = (train_out, train_losses, eval_out, eval_losses)

    def same(a, b) -> bool:
        if isinstance(a, list):
            return len(a) == len(b) and all(map(torch.equal, a, b))
        return (a is None and b is None) or torch.equal(a, b)

    fixed, rrfp = results["fixed"], results["rrfp"]
    checked = (0, 1) if layout == "v" else (0, 1, 2, 3)
    has_last = any(s.is_last for s in stages)
    eval_error = 0.0
    if has_last:
        with torch.no_grad():
            out = x
            for block in chain:
                out = block(out)
        eval_error = (rrfp[2] - out).abs().max().item()
    return {"same": all(same(fixed[i], rrfp[i]) for i in checked), "has_last": has_last,
            "out_of_order": out_of_order,
            "n_eval_losses": len(rrfp[3]), "eval_error": eval_error,
            "output_shape": tuple(rrfp[2].shape) if has_last else None}


def stages_listed_in_reverse(rank: int, world_size: int) -> dict:
    """Interleaved1F1B with each rank's stages listed in reverse (``[rank + pp, rank]``):
    two steps, against torch's fixed schedule given them in stage order."""
    M, steps = 2 * world_size, 2
    chain = make_chain(2 * world_size)
    x, y = make_batch(M)
    stages, blocks = build_stages(chain, rank, world_size, "loop")
    fixed = run_steps(torch_schedule("Interleaved1F1B", stages, M), stages, blocks, x, y, steps)
    stages, blocks = build_stages(chain, rank, world_size, "loop")
    schedule = ScheduleRRFP(stages[::-1], M, loss_fn=loss_fn, hint="Interleaved1F1B",
                            stall_timeout=20)
    history = run_steps(schedule, stages, blocks, x, y, steps)
    schedule.close()
    return {"bitwise": bitwise_equal(history, fixed),
            "listed": [stage.stage_index for stage in stages[::-1]]}


def settings_as_built(rank: int, world_size: int, arguments: list[dict]) -> list[tuple]:
    """What ScheduleRRFP (Interleaved1F1B, 2 stages per rank, 8 microbatches) makes of each
    set of keyword arguments: its limits per stage and per rank, policy and launch depth."""
    chain = make_chain(2 * world_size)
    built = []
    for kwargs in arguments:
        stages, _ = build_stages(chain, rank, world_size, "loop")
        schedule = ScheduleRRFP(stages, 8, loss_fn=loss_fn, hint="Interleaved1F1B", **kwargs)
        schedule.close()
        built.append((dict(schedule.buffer_limits.per_stage), dict(schedule.buffer_limits.per_rank),
                      schedule.policy, schedule.launch_depth))
    return built


def slow_microbatch_comparison(rank: int, world_size: int, hint: str, policy: str,
                               n_microbatches: int, slow_mb: int, slow_s: float,
                               repeats: int, launch_depth: int | None = None) -> dict:
    """Stage 0's forward of one microbatch is slow; time torch's fixed schedule and RRFP.

    Emulated device time: forwards 0.02 s, backwards 0.02 s on stage 0 and 0.15 s on the
    last stage (a heavy head), one slow forward on stage 0. With ``launch_depth``, RRFP runs
    on the emulated asynchronous device with that depth (else on the synchronous one).
    Waiting: the time the rank's device had nothing to run (step time minus the emulated
    compute for torch's schedule; device idle time from RRFP's stats).
    """
    chain = make_chain(world_size)
    x, y = make_batch(n_microbatches)

    def device_time(stage: int, block):
        def forward_time(mb: int) -> float:
            return slow_s if (stage == 0 and mb == slow_mb) else 0.02
        backward = 0.15 if stage == world_size - 1 else 0.02
        return EmulatedDeviceTime(block, n_microbatches, forward_time, lambda mb: backward)

    schedules = {}
    for kind in ("fixed", "rrfp"):
        stages, blocks = build_stages(chain, rank, world_size, "loop", wrap=device_time)
        schedules[kind] = (
            torch_schedule(hint, stages, n_microbatches) if kind == "fixed"
            else ScheduleRRFP(stages, n_microbatches, loss_fn=loss_fn, hint=hint, policy=policy,
                              device=None if launch_depth is None else EmulatedDevice(),
                              launch_depth=launch_depth or DEFAULT_LAUNCH_DEPTH),
            stages, blocks,
        )
    times: dict[str, list[float]] = {"fixed": [], "rrfp": []}
    waits: dict[str, list[float]] = {"fixed": [], "rrfp": []}
    for i in range(repeats + 1):  # the first round initializes (shape inference)
        for kind, (schedule, stages, blocks) in schedules.items():
            dist.barrier()
            for stage in stages:
                stage.submod.reset()
            start = time.perf_counter()
            run_steps(schedule, stages, blocks, x, y, steps=1)
            elapsed = time.perf_counter() - start
            if i > 0:
                times[kind].append(elapsed)
                waits[kind].append(
                    schedule.last_step_stats.idle_time if kind == "rrfp"
                    else elapsed - sum(stage.submod.slept for stage in stages))
    rrfp = schedules["rrfp"][0]
    stats = rrfp.last_step_stats
    rrfp.close()
    return {"times": times, "waits": waits, "hint_order": stats.hint_order,
            "realized_order": stats.realized_order, "device": stats.device}


class Detached(torch.nn.Module):
    """A block that copies its input first (a copy saves nothing for backward), so that
    every stage's saved activations are its own, the same bytes per microbatch."""

    def __init__(self, inner: torch.nn.Module):
        super().__init__()
        self.inner = inner

    def forward(self, x):
        return self.inner(torch.clone(x))


MEMORY_DIM, MEMORY_BATCH = 32, 8
MEMORY_PER_MICROBATCH = MEMORY_BATCH * MEMORY_DIM * 8
"""Bytes a memory block (``Detached`` Linear, float64) saves per microbatch: its input."""


def held_from_order(actions) -> tuple[dict[int, int], int]:
    """Peak microbatches held per stage and by all the stages together, recomputed from an
    order of actions (``_Action`` s or their strings): +1 at F, -1 at the last backward
    piece (B, or W when backward is split). Independent of the arbiter's counters."""
    from torch.distributed.pipelining.schedules import _Action as Action

    held: dict[int, int] = {}
    peaks: dict[int, int] = {}
    total = peak = 0
    for action in actions:
        if isinstance(action, str):
            action = Action.from_str(action)
        kind, stage = action.computation_type.value, action.stage_index
        change = {"F": 1, "B": -1, "W": -1}.get(kind, 0)
        if change == 0:
            continue
        held[stage] = held.get(stage, 0) + change
        total += change
        assert held[stage] >= 0, f"{action}: stage {stage} releases a microbatch it never held"
        peaks[stage] = max(peaks.get(stage, 0), held[stage])
        peak = max(peak, total)
    assert total == 0 and all(h == 0 for h in held.values()), "microbatches still held at the end"
    return peaks, peak


class StageMeters:
    """A byte meter per stage of one rank (``rrfp.memory.ActivationMeter``), and the
    rank's peak: the most bytes its stages' meters hold together after any forward (when
    saved bytes peak: they only grow during forwards)."""

    def __init__(self) -> None:
        from rrfp.memory import ActivationMeter

        self.meters: dict[int, ActivationMeter] = {}
        self._parameters: dict[int, list[torch.Tensor]] = {}
        self.rank_peak = 0

    def wrap(self, stage: int, block: torch.nn.Module) -> torch.nn.Module:
        from rrfp.memory import ActivationMeter

        meter = self.meters[stage] = ActivationMeter()
        self._parameters[stage] = list(block.parameters())
        meter.reset(self._parameters[stage])
        owner = self

        class Metered(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.inner = block

            def forward(self, x):
                with meter.saving():
                    out = self.inner(x)
                meter.sample()
                owner.rank_peak = max(owner.rank_peak,
                                      sum(m.live_bytes() for m in owner.meters.values()))
                return out

        return Metered()

    def reset(self) -> None:
        """Measure anew (at a step's start: what the first step's shape inference left
        alive is not the step's)."""
        for stage, meter in self.meters.items():
            meter.reset(self._parameters[stage])
        self.rank_peak = 0

    def stage_peaks(self) -> dict[int, int]:
        return {s: m.peak for s, m in self.meters.items()}


def memory_delays(pattern: str, num_stages: int, n_microbatches: int,
                  meters: StageMeters | None) -> Callable[[int, torch.nn.Module], torch.nn.Module]:
    """A ``build_stages`` wrap: each block metered by ``meters`` (if any), under emulated
    device time. "slow_head": the last stage's backward takes 30 ms, everything else 1 ms,
    so upstream forwards would run ahead; "slow_tail": the first stage's forwards take 30
    ms and the rest 1 ms, so ranks wait with backward pieces (and, under split backward,
    Ws) to fill in."""
    def wrap(s: int, block: torch.nn.Module) -> torch.nn.Module:
        slow_head = pattern == "slow_head" and s == num_stages - 1
        slow_tail = pattern == "slow_tail" and s == 0
        inner = meters.wrap(s, block) if meters is not None else block
        return EmulatedDeviceTime(inner, n_microbatches, lambda mb: 0.03 if slow_tail else 0.001,
                                  lambda mb: 0.03 if slow_head else 0.001)
    return wrap


def memory_steps(schedule, blocks, inputs: tuple, y: torch.Tensor,
                 meters: StageMeters | None = None, n: int = 2) -> list[list[torch.Tensor]]:
    """``n`` optimizer steps; per step the local gradients. ``meters`` are reset at each
    step's start, so they keep the last step's bytes (as ScheduleRRFP's own meter does)."""
    optimizer = torch.optim.SGD([p for b in blocks for p in b.parameters()], lr=0.1)
    grads = []
    for _ in range(n):
        optimizer.zero_grad(set_to_none=True)
        if meters is not None:
            meters.reset()
        schedule.step(*inputs, target=y, return_outputs=False)
        grads.append([p.grad.clone() for b in blocks for p in b.parameters()])
        optimizer.step()
    return grads


def bytes_when_i_frees_a_part(rank: int, world_size: int, hint: str, reference: str,
                              per_rank: int, layout: str, inputs: tuple,
                              y: torch.Tensor) -> dict[str, int]:
    """The rank's peak saved-activation bytes under torch's fixed schedule (``reference``)
    and under ScheduleRRFP at "hint" ("slow_head" delays), on blocks whose saves are partly
    freed at I: a Linear's input, which W needs, and two tanhs' outputs, which only the
    input gradient needs. At I torch detaches a stage's outputs, so what only the graph
    kept goes; the second tanh's output is the stage's output, alive while anything keeps
    it (torch's schedules: until W; RRFP on torch 2.15: until its send is handed over).
    Under split backward the microbatches held (until W) then no longer fix the bytes;
    this measures them."""
    num_stages, M = world_size * per_rank, 4 * world_size
    torch.manual_seed(0)
    chain = [Detached(torch.nn.Sequential(torch.nn.Linear(MEMORY_DIM, MEMORY_DIM), torch.nn.Tanh(),
                                          torch.nn.Tanh())).double() for _ in range(num_stages)]
    measured = {}
    for name in ("torch", "rrfp"):
        meters = StageMeters()
        stages, blocks = build_stages(chain, rank, world_size, layout,
                                      wrap=memory_delays("slow_head", num_stages, M, meters))
        schedule = torch_schedule(reference, stages, M) if name == "torch" else ScheduleRRFP(
            stages, M, loss_fn=loss_fn, hint=hint, device=EmulatedDevice(), stall_timeout=60,
            meter_activations=False)
        memory_steps(schedule, blocks, inputs, y, meters)
        if name == "rrfp":
            schedule.close()
        measured[name] = meters.rank_peak
    return measured


def memory_world(rank: int, world_size: int, hint: str, reference: str, per_rank: int,
                 layout: str) -> dict:
    """Saved-activation bytes of ScheduleRRFP measured per stage and per rank, on blocks
    that save a known number of bytes per microbatch (``MEMORY_PER_MICROBATCH``), at "hint"
    under two delay patterns, at "hint+2", at an int limit where the hint allows one, and
    at "busiest" with one stage per rank;
    the microbatches held, recomputed from the hint's order and from the realized one;
    and bitwise equality with torch's fixed schedule.

    Per stage and per rank the bytes come from a byte meter per stage (``StageMeters``,
    ScheduleRRFP's own meter off) in the runs marked "stage", and from ScheduleRRFP's own
    meter (per rank) in the others.

    Runs are keyed ``"limit/pattern"`` under "runs"; delay patterns: ``memory_delays``.
    Under "torch", the reference: torch's own fixed schedule (``reference``) on the same
    blocks, metered by the same per-stage meters under "slow_head" (its last step's peaks,
    per rank and per stage; its order is fixed, so the delays cannot change them).
    """
    num_stages, M = world_size * per_rank, 4 * world_size
    torch.manual_seed(0)
    # A Linear saves only its input (the weight is a parameter), which its weight gradient
    # needs: kept until the last backward piece, also under split backward (I/W). (A tanh's
    # saved output, which only the input gradient needs, is freed at I.)
    chain = [Detached(torch.nn.Linear(MEMORY_DIM, MEMORY_DIM)).double()
             for _ in range(num_stages)]
    g = torch.Generator().manual_seed(1)
    x = torch.randn(M * MEMORY_BATCH, MEMORY_DIM, generator=g, dtype=torch.float64)
    y = torch.randn(M * MEMORY_BATCH, MEMORY_DIM, generator=g, dtype=torch.float64)
    inputs = (x,) if 0 in local_stage_indices(rank, world_size, num_stages, layout) else ()

    fixed_meters = StageMeters()
    stages, blocks = build_stages(chain, rank, world_size, layout,
                                  wrap=memory_delays("slow_head", num_stages, M, fixed_meters))
    fixed_grads = memory_steps(torch_schedule(reference, stages, M), blocks, inputs, y,
                               fixed_meters)
    results: dict = {"per_microbatch": MEMORY_PER_MICROBATCH, "runs": {},
                     "torch": {"rank_bytes": fixed_meters.rank_peak,
                               "stage_bytes": fixed_meters.stage_peaks()}}
    if build_hint(hint, num_ranks=world_size, num_stages=num_stages, n_microbatches=M,
                  layout=layout).has_split_backward:
        results["freed_at_i"] = bytes_when_i_frees_a_part(rank, world_size, hint, reference,
                                                          per_rank, layout, inputs, y)

    runs = [("hint", "slow_head", "stage"), ("hint", "slow_tail", "rank"),
            ("hint+2", "slow_head", "stage")]
    if per_rank == 1 and hint not in ("LoopedBFS",):
        runs.append((2, "slow_head", "rank"))
    if per_rank == 1:
        runs.append(("busiest", "slow_head", "rank"))
    for limit, pattern, metered in runs:
        meters = StageMeters() if metered == "stage" else None
        stages, blocks = build_stages(chain, rank, world_size, layout,
                                      wrap=memory_delays(pattern, num_stages, M, meters))
        schedule = ScheduleRRFP(stages, M, loss_fn=loss_fn, hint=hint, buffer_limit=limit,
                                device=EmulatedDevice(), stall_timeout=60,
                                meter_activations=meters is None, meter_every=1)
        for stage in stages:
            stage.submod.reset()
        grads = memory_steps(schedule, blocks, inputs, y, meters)
        stats = schedule.last_step_stats
        schedule.close()
        realized_peaks, realized_rank_peak = held_from_order(stats.realized_order)
        hint_peaks, hint_rank_peak = held_from_order(stats.hint_order)
        results["runs"][f"{limit}/{pattern}"] = {
            "stage_bytes": meters.stage_peaks() if meters is not None else None,
            "rank_bytes": meters.rank_peak if meters is not None else stats.peak_activation_bytes,
            "held": realized_peaks, "rank_held": realized_rank_peak,
            "hint_held": hint_peaks, "hint_rank_held": hint_rank_peak,
            "arbiter_held": stats.peak_in_flight, "arbiter_rank_held": stats.peak_rank_in_flight,
            "out_of_order": stats.out_of_hint_order,
            "rank_limit": stats.rank_buffer_limit, "hint_rank_peak": stats.hint_rank_peak,
            "bitwise": all(torch.equal(a, b) for ga, gb in zip(grads, fixed_grads)
                           for a, b in zip(ga, gb)),
        }
    return results


def chunked_input_bytes(rank: int, world_size: int, limits: list) -> dict:
    """1F1B on plain blocks (a Linear saves its input, a Tanh its output), whose first stage
    gets microbatches that torch splits off one input batch as views: per limit, each
    rank's peak activation bytes and microbatches held. (No outputs returned: the last
    stage would keep every microbatch's output for the step's result.)"""
    M = 8
    chain = make_chain(world_size)
    x, y = make_batch(M)
    inputs = (x,) if rank == 0 else ()
    results = {}
    for limit in limits:
        stages, _ = build_stages(chain, rank, world_size, "loop")
        schedule = ScheduleRRFP(stages, M, loss_fn=loss_fn, hint="1F1B", buffer_limit=limit,
                                policy="hint", stall_timeout=60, meter_every=1)
        for _ in range(2):
            schedule.step(*inputs, target=y, return_outputs=False)
        stats = schedule.last_step_stats
        schedule.close()
        results[limit] = (stats.peak_activation_bytes, stats.peak_rank_in_flight)
    return results


def receive_buffers(rank: int, world_size: int, hint: str, per_rank: int, layout: str,
                    limit) -> dict:
    """Receive-buffer bytes of one training step at 4 and at 16 microbatches under one
    limit, and the bound a ring per channel allows: per incoming channel, (limit + 1)
    activations or ``limit`` gradients of its destination stage (one microbatch's message
    is ``BATCH_PER_MICROBATCH x DIM`` float64 either way)."""
    num_stages = world_size * per_rank
    chain = make_chain(num_stages)
    message = BATCH_PER_MICROBATCH * DIM * 8
    result: dict = {}
    for M in (4, 16):
        x, y = make_batch(M)
        stages, blocks = build_stages(chain, rank, world_size, layout)
        schedule = ScheduleRRFP(stages, M, loss_fn=loss_fn, hint=hint, buffer_limit=limit,
                                stall_timeout=60)
        run_steps(schedule, stages, blocks, x, y, 1)
        schedule.close()
        limits = schedule.buffer_limits.per_stage
        local = set(schedule.hint.stages_on(rank))
        bound = sum((limits[e.dst] + 1 if e.is_forward else limits[e.dst]) * message
                    for e in schedule.hint.remote_edges() if e.dst in local)
        result[M] = {"bytes": schedule.last_step_stats.receive_buffer_bytes, "bound": bound,
                     "per_microbatch": M * message * sum(
                         1 for e in schedule.hint.remote_edges() if e.dst in local)}
    return result


class HookProbe(torch.nn.Module):
    """A block that records, at each forward, whether saved-tensor hooks are installed."""

    def __init__(self, inner: torch.nn.Module):
        super().__init__()
        self.inner = inner
        self.hooked: list[bool] = []

    def forward(self, x):
        self.hooked.append(torch._C._autograd._top_saved_tensors_default_hooks(False) is not None)
        return self.inner(x)


def unmetered(rank: int, world_size: int) -> dict:
    """1F1B with and without the activation meter, against torch's Schedule1F1B: the
    gradients and losses, the bytes reported, and whether forwards ran under hooks."""
    M, steps = 4, 2
    chain = make_chain(world_size)
    x, y = make_batch(M)
    stages, blocks = build_stages(chain, rank, world_size, "loop")
    fixed = run_steps(torch_schedule("1F1B", stages, M), stages, blocks, x, y, steps)
    results = {}
    for metered in (True, False):
        stages, blocks = build_stages(chain, rank, world_size, "loop",
                                      wrap=lambda s, b: HookProbe(b))
        schedule = ScheduleRRFP(stages, M, loss_fn=loss_fn, hint="1F1B", stall_timeout=60,
                                meter_activations=metered, meter_every=1)
        history = run_steps(schedule, stages, blocks, x, y, steps)
        schedule.close()
        results[metered] = {
            "bitwise": bitwise_equal(history, fixed),
            "bytes": schedule.last_step_stats.peak_activation_bytes,
            "summary": schedule.last_step_stats.summary(),
            "hooked": [h for stage in stages for h in stage.submod.hooked],
        }
    return results


def silent_first_rank(rank: int, world_size: int, stall_timeout: float) -> dict:
    """After one normal step, rank 0 stops stepping: every rank downstream must raise.

    (The first step's shape inference uses torch's blocking P2P, so the silence starts
    in the second step.)
    """
    chain = make_chain(world_size)
    x, y = make_batch(world_size)
    stages, blocks = build_stages(chain, rank, world_size, "loop")
    schedule = ScheduleRRFP(stages, world_size, loss_fn=loss_fn, hint="1F1B",
                            stall_timeout=stall_timeout)
    run_steps(schedule, stages, blocks, x, y, steps=1)
    outcome: dict = {}
    if rank > 0:
        start = time.perf_counter()
        try:
            run_steps(schedule, stages, blocks, x, y, steps=1)
        except PipelineStallError as e:
            outcome = {"error": str(e), "elapsed": time.perf_counter() - start}
    dist.barrier()
    return outcome


def bad_input(rank: int, world_size: int, case: str) -> str:
    """Only rank 0 builds the schedule: any communication before the error would hang."""
    if rank != 0:
        return ""
    kwargs = dict(hint="1F1B", buffer_limit="hint")
    n_microbatches, per_rank, layout = 4, 1, "loop"
    if case == "unknown_hint":
        kwargs["hint"] = "OneFOneB"
    elif case == "single_stage_hint_two_stages":
        per_rank = 2
    elif case == "v_hint_loop_stages":
        kwargs["hint"], per_rank = "ZBVZeroBubble", 2
    elif case == "loop_hint_v_stages":
        kwargs["hint"], per_rank, layout = "Interleaved1F1B", 2, "v"
    elif case == "limit_zero":
        kwargs["buffer_limit"] = 0
    elif case == "limit_malformed":
        kwargs["buffer_limit"] = "hint-1"
    elif case == "limit_below_reversed_order":
        kwargs["hint"], kwargs["buffer_limit"] = "LoopedBFS", 1
    elif case == "too_few_microbatches":
        n_microbatches = 1
    elif case == "too_few_microbatches_dualpipev":
        kwargs["hint"], per_rank, layout, n_microbatches = "DualPipeV", 2, "v", 2
    elif case == "fixed_below_hint":
        kwargs["policy"], kwargs["buffer_limit"] = "fixed", 1
    elif case == "launch_depth_negative":
        kwargs["launch_depth"] = -1
    elif case == "unknown_policy":
        kwargs["policy"] = "eager"
    else:
        raise AssertionError(case)
    chain = make_chain(world_size * per_rank)
    stages, _ = build_stages(chain, rank, world_size, layout)
    try:
        ScheduleRRFP(stages, n_microbatches, loss_fn=loss_fn, **kwargs)
    except ValueError as e:
        return str(e)
    raise AssertionError(f"no ValueError for {case}")


def data_parallel(rank: int, world_size: int, wrapper: str, hint: str, reference: str,
                  layout: str, delay_seeds: tuple[int, ...]) -> dict:
    """PP=2 x DP=2 (FSDP2 or DDP per stage); delays differ between the DP replicas, and
    in the first delayed run late messages make them interleave differently
    (``replicas_apart``)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.nn.parallel import DistributedDataParallel

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "pp"))
    dp, pp = mesh["dp"].get_local_rank(), mesh["pp"].get_local_rank()
    num_stages, M, steps = 4, 4, 3
    chain = make_chain(num_stages)
    x_all, y_all = make_batch(2 * M)
    per_replica = M * BATCH_PER_MICROBATCH
    x, y = x_all[dp * per_replica:(dp + 1) * per_replica], y_all[dp * per_replica:(dp + 1) * per_replica]
    local = local_stage_indices(pp, 2, num_stages, layout)

    def build(seed: int | None):
        blocks, stages = [], []
        for s in local:
            block = copy.deepcopy(chain[s])
            module = block if seed is None else random_device_time(seed * 10 + dp, s, M, 0.003)(block)
            if wrapper == "fsdp":
                fully_shard(module, mesh=mesh["dp"])
                module.set_force_sum_reduction_for_comms(True)
            else:
                module = DistributedDataParallel(module, process_group=mesh["dp"].get_group())
            blocks.append(block)
            stages.append(PipelineStage(module, s, num_stages, torch.device("cpu"),
                                        group=mesh["pp"].get_group()))
        return stages, blocks

    def local_grads(history):
        return [([g.to_local() if hasattr(g, "to_local") else g for g in grads], losses)
                for grads, losses in history]

    stages, blocks = build(None)
    if wrapper == "ddp":
        # torch 2.13's own schedules trip an internal assert of DDP's reducer when a stage
        # runs several microbatch backwards ("rebuilt parameter indices size is not same as
        # original"), so the fixed order is run by ScheduleRRFP's "fixed" policy instead.
        baseline = ScheduleRRFP(stages, M, loss_fn=loss_fn, hint=reference, policy="fixed")
    else:
        baseline = torch_schedule(reference, stages, M)
    fixed = local_grads(run_steps(baseline, stages, blocks, x, y, steps))
    full = [p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
            for b in blocks for p in b.parameters()]
    ref = reference_steps(chain, x_all, y_all, steps, local)
    ref_error = max((g - r).abs().max().item() for g, r in zip(full, ref[-1][0]))
    runs = {}
    for seed in (None, *delay_seeds):
        stages, blocks = build(seed)
        # The first delayed run also makes the replicas interleave differently.
        late = replicas_apart(hint, dp) if seed == delay_seeds[0] else None
        send_delay = None if seed is None else random_send_delay(seed * 7919 + rank, 0.003, late)
        schedule = ScheduleRRFP(stages, M, loss_fn=loss_fn, hint=hint, buffer_limit="hint+1",
                                policy="hint", stall_timeout=60, send_delay=send_delay)
        history = local_grads(run_steps(schedule, stages, blocks, x, y, steps))
        runs["plain" if seed is None else f"seed{seed}"] = {
            "bitwise": bitwise_equal(history, fixed),
            "realized": schedule.last_step_stats.realized_order,
        }
    return {"dp": dp, "pp": pp, "runs": runs, "ref_error": ref_error}


DDP_BUCKET_CAP_BYTES = 600
"""Smaller than two of the DDP worker's weight gradients (512 B each), larger than one
with its bias (576 B): several buckets, the largest 576 B."""


def ddp_buckets(rank: int, world_size: int) -> dict:
    """A one-stage pipeline per rank, its stage wrapped in DDP over both ranks (two Linear
    layers, float64): the tensors ``all_reduce`` is given while ScheduleRRFP reduces the
    gradients at REDUCE_GRAD, and the gradients against the same model on both ranks' data
    without DDP or pipelining."""
    from torch.nn.parallel import DistributedDataParallel

    pp_group = dist.new_group([rank])
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(DIM, DIM), torch.nn.Linear(DIM, DIM)).double()
    reference = copy.deepcopy(model)
    x_all, y_all = make_batch(2 * world_size)
    x, y = x_all.chunk(world_size)[rank], y_all.chunk(world_size)[rank]
    ddp = DistributedDataParallel(model, bucket_cap_mb=DDP_BUCKET_CAP_BYTES / 2**20)
    stage = PipelineStage(ddp, 0, 1, torch.device("cpu"), group=pp_group)
    schedule = ScheduleRRFP(stage, 2, loss_fn=loss_fn, hint="GPipe")
    reduced: list[int] = []
    all_reduce = dist.all_reduce

    def recording(tensor, *args, **kwargs):
        reduced.append(tensor.numel() * tensor.element_size())
        return all_reduce(tensor, *args, **kwargs)

    dist.all_reduce = recording
    try:
        schedule.step(x, target=y)
    finally:
        dist.all_reduce = all_reduce
    schedule.close()
    # Per replica the mean over its 2 microbatches, averaged over the replicas: the mean
    # over all 4 microbatches of the whole batch.
    loss = sum(loss_fn(reference(xm), ym) for xm, ym in zip(x_all.chunk(4), y_all.chunk(4))) / 4
    loss.backward()
    error = max((p.grad - r.grad).abs().max().item()
                for p, r in zip(model.parameters(), reference.parameters()))
    return {"reduced": reduced, "cap": ddp.bucket_bytes_cap, "error": error,
            "gradient_bytes": sum(p.numel() * p.element_size() for p in model.parameters())}


def fsdp_collectives(rank: int, world_size: int) -> dict:
    """PP=2 x FSDP=2, Interleaved1F1B (two stages per rank), random delays that differ
    between the replicas and late messages that make them interleave differently
    (``replicas_apart``): the order of the
    data-parallel collectives and of the stages' actions in the second step (the first
    step's shape inference runs forwards outside the schedule's order)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "pp"))
    dp, pp = mesh["dp"].get_local_rank(), mesh["pp"].get_local_rank()
    num_stages, M = 4, 4
    chain = make_chain(num_stages)
    x, y = make_batch(M, seed=1 + dp)
    local = local_stage_indices(pp, 2, num_stages, "loop")
    log: list[tuple] = []
    stages, blocks = [], []
    for s in local:
        block = copy.deepcopy(chain[s])
        module = random_device_time(10 + dp, s, M, 0.003)(block)
        fully_shard(module, mesh=mesh["dp"])
        module.set_force_sum_reduction_for_comms(True)
        module.register_forward_pre_hook(lambda m, args, s=s: log.append(("F", s)))
        blocks.append(block)
        stage = PipelineStage(module, s, num_stages, torch.device("cpu"),
                              group=mesh["pp"].get_group())
        reduce_grad = stage.perform_reduce_grad

        def logged(*args, s=s, reduce_grad=reduce_grad, **kwargs):
            log.append(("REDUCE_GRAD", s))
            reduce_grad(*args, **kwargs)
            log.append(("REDUCE_GRAD done", s))
        stage.perform_reduce_grad = logged
        stages.append(stage)
    # Readiness-first: the default here (lookahead) would let an action pass a late one
    # only if earlier steps' arrival times, noisy on a loaded machine, said it fits.
    schedule = ScheduleRRFP(stages, M, loss_fn=loss_fn, hint="Interleaved1F1B",
                            buffer_limit="hint+1", policy="hint", stall_timeout=60,
                            send_delay=random_send_delay(10 + rank, 0.003,
                                                         replicas_apart("Interleaved1F1B", dp)))
    originals = {name: getattr(dist, name)
                 for name in ("all_gather_single", "reduce_scatter_single",
                              "all_gather_into_tensor", "reduce_scatter_tensor", "all_reduce")}

    def recording(name):
        def collective(*args, **kwargs):
            log.append((name,))
            return originals[name](*args, **kwargs)
        return collective

    run_steps(schedule, stages, blocks, x, y, 1)
    log.clear()
    for name in originals:
        setattr(dist, name, recording(name))
    try:
        run_steps(schedule, stages, blocks, x, y, 1)
    finally:
        for name, fn in originals.items():
            setattr(dist, name, fn)
    stats = schedule.last_step_stats
    schedule.close()
    return {"dp": dp, "pp": pp, "log": log, "out_of_order": stats.out_of_hint_order,
            "realized": stats.realized_order,
            "reduce_order": [a.stage_index for a in schedule.hint.orders[pp]
                             if a is not None and a.computation_type.value == "REDUCE_GRAD"]}


class MLPBlock(torch.nn.Module):
    """Linear up, tanh, linear down: the column-/row-parallel pair of a TP transformer."""

    def __init__(self):
        super().__init__()
        self.up = torch.nn.Linear(DIM, 2 * DIM)
        self.down = torch.nn.Linear(2 * DIM, DIM)

    def forward(self, x):
        return self.down(torch.tanh(self.up(x)))


def tensor_parallel(rank: int, world_size: int, coordination: str, hint: str, reference: str,
                    layout: str, delay_seeds: tuple[int, ...]) -> dict:
    """PP=2 x TP=2 with a DTensor MLP per stage; delays differ between the TP ranks."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import (
        ColwiseParallel, parallelize_module, RowwiseParallel)

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "tp"))
    pp, tp = mesh["pp"].get_local_rank(), mesh["tp"].get_local_rank()
    num_stages, M, steps = 4, 4, 3
    torch.manual_seed(0)
    chain = [MLPBlock().double() for _ in range(num_stages)]
    x, y = make_batch(M)
    local = local_stage_indices(pp, 2, num_stages, layout)

    def build(seed: int | None):
        blocks, stages = [], []
        for s in local:
            block = parallelize_module(copy.deepcopy(chain[s]), mesh["tp"],
                                       {"up": ColwiseParallel(), "down": RowwiseParallel()})
            module = block if seed is None else random_device_time(seed * 10 + tp, s, M, 0.003)(block)
            blocks.append(block)
            stages.append(PipelineStage(module, s, num_stages, torch.device("cpu"),
                                        group=mesh["pp"].get_group()))
        return stages, blocks

    def local_grads(history):
        return [([g.to_local() for g in grads], losses) for grads, losses in history]

    stages, blocks = build(None)
    fixed = local_grads(run_steps(torch_schedule(reference, stages, M), stages, blocks, x, y, steps))
    full = [p.grad.full_tensor() for b in blocks for p in b.parameters()]
    ref = reference_steps(chain, x, y, steps, local)
    ref_error = max((g - r).abs().max().item() for g, r in zip(full, ref[-1][0]))
    runs = coordinated_runs(rank, build, local_grads, fixed, hint, M, mesh["tp"].get_group(),
                            coordination, delay_seeds, x, y, steps)
    return {"pp": pp, "tp": tp, "runs": runs, "ref_error": ref_error}


def coordinated_runs(rank: int, build: Callable, local_grads: Callable, fixed: list, hint: str,
                     n_microbatches: int, group: dist.ProcessGroup, coordination: str,
                     delay_seeds: tuple[int, ...], x, y, steps: int) -> dict:
    """ScheduleRRFP at hint+1 (plain readiness-first, so out-of-hint actions happen)
    coordinated over ``group``, without delays and with each of ``delay_seeds`` (per-rank
    send delays, in the first with a late activation that reorders actions;
    ``build(seed)`` adds the device delays): per run, whether its gradients
    equal ``fixed`` (torch's schedule) bitwise, the realized order and the coordination
    counts."""
    runs = {}
    for seed in (None, *delay_seeds):
        stages, blocks = build(seed)
        late = SECOND_ACTIVATION_LATE if seed == delay_seeds[0] else None
        schedule = ScheduleRRFP(
            stages, n_microbatches, loss_fn=loss_fn, hint=hint, buffer_limit="hint+1",
            stall_timeout=60, policy="hint", coordination_group=group, coordination=coordination,
            send_delay=None if seed is None else random_send_delay(seed * 7919 + rank, 0.003, late))
        history = local_grads(run_steps(schedule, stages, blocks, x, y, steps))
        stats = schedule.last_step_stats
        runs["plain" if seed is None else f"seed{seed}"] = {
            "bitwise": bitwise_equal(history, fixed), "realized": stats.realized_order,
            "out_of_order": stats.out_of_hint_order, "rounds": stats.coordination_rounds,
            "deferrals": stats.coordination_deferrals,
            "coordination_us": stats.coordination_time * 1e6,
        }
    return runs


def compiled_stages(rank: int, world_size: int, hint: str, reference: str, per_rank: int,
                    layout: str) -> dict:
    """torch.compile'd stage modules under RRFP vs the uncompiled fixed schedule."""
    import torch._dynamo

    num_stages, M, steps = world_size * per_rank, 4, 3
    chain = make_chain(num_stages)
    x, y = make_batch(M)
    stages, blocks = build_stages(chain, rank, world_size, layout)
    fixed = run_steps(torch_schedule(reference, stages, M), stages, blocks, x, y, steps)
    torch._dynamo.reset()
    counters = torch._dynamo.utils.counters
    # Random delays outside the compiled module, and a late activation that makes actions
    # run out of the hint's order.
    stages, blocks = build_stages(
        chain, rank, world_size, layout,
        wrap=lambda s, b: random_device_time(3, s, M, 0.003)(torch.compile(b, backend="aot_eager")))
    schedule = ScheduleRRFP(stages, M, loss_fn=loss_fn, hint=hint, buffer_limit="hint+1",
                            policy="hint",
                            send_delay=random_send_delay(rank, 0.003, SECOND_ACTIVATION_LATE))
    compiled = run_steps(schedule, stages, blocks, x, y, 1)
    after_first = (sum(counters["frames"].values()), sum(counters["recompiles"].values()))
    compiled += run_steps(schedule, stages, blocks, x, y, steps - 1)
    after_all = (sum(counters["frames"].values()), sum(counters["recompiles"].values()))
    out_of_order = schedule.last_step_stats.out_of_hint_order
    schedule.close()
    return {"bitwise": bitwise_equal(compiled, fixed), "after_first": after_first,
            "out_of_order": out_of_order,
            "after_all": after_all, "unique_graphs": counters["stats"]["unique_graphs"]}


def refused_data_parallel(rank: int, world_size: int, case: str) -> str:
    """Data-parallel stage set-ups ScheduleRRFP must refuse (one-stage pipelines, DP over
    both ranks): DDP broadcasting buffers in forward, DDP with a communication hook, FSDP
    modules inside a stage that is not one itself."""
    from torch.distributed.fsdp import fully_shard
    from torch.nn.parallel import DistributedDataParallel

    pp_group = dist.new_group([rank])
    if case == "ddp_buffers":
        block = torch.nn.Sequential(torch.nn.Linear(DIM, DIM), torch.nn.BatchNorm1d(DIM)).double()
        module = DistributedDataParallel(block)
    elif case == "ddp_comm_hook":
        from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

        module = DistributedDataParallel(torch.nn.Linear(DIM, DIM).double())
        module.register_comm_hook(None, allreduce_hook)
    elif case == "fsdp_inner_only":
        module = torch.nn.Sequential(torch.nn.Linear(DIM, DIM), torch.nn.Linear(DIM, DIM)).double()
        fully_shard(module[0])
    else:
        raise AssertionError(case)
    stage = PipelineStage(module, 0, 1, torch.device("cpu"), group=pp_group)
    try:
        ScheduleRRFP(stage, 2, loss_fn=loss_fn, hint="GPipe")
    except ValueError as e:
        return str(e)
    raise AssertionError("no ValueError")


class FailingLoss:
    """mse, but raises at one microbatch of one step once armed."""

    def __init__(self, fail_at_call: int):
        self.calls, self.fail_at_call, self.armed = 0, fail_at_call, False

    def __call__(self, output, target):
        self.calls += 1
        if self.armed and self.calls == self.fail_at_call:
            raise RuntimeError("loss failed on purpose")
        return loss_fn(output, target)


def error_chain(error: BaseException | None) -> str:
    """An exception and its causes, as one line each."""
    lines = []
    while error is not None:
        lines.append(f"{type(error).__name__}: {error}")
        error = error.__cause__ or error.__context__
    return " <- ".join(lines)


def rrfp_threads() -> list[str]:
    return sorted(t.name for t in threading.enumerate() if t.name.startswith("rrfp-"))


def failure_and_recovery(rank: int, world_size: int, failing_rank: int) -> dict:
    """GPipe over the emulated device; the second step fails on ``failing_rank`` (rank 0:
    stage 0's forward of microbatch 2 raises; the last rank: its loss raises). Every rank
    must raise promptly; then each builds a new ScheduleRRFP in the same process and steps:
    bitwise what torch's GPipe computes from the same parameters."""
    M = 4
    chain = make_chain(world_size)
    x, y = make_batch(M)
    failing_loss = FailingLoss(fail_at_call=2)

    class FailingForward(torch.nn.Module):
        def __init__(self, inner):
            super().__init__()
            self.inner, self.calls, self.armed = inner, 0, False

        def forward(self, inp):
            self.calls += 1
            if self.armed and self.calls == 3:
                raise RuntimeError("forward failed on purpose")
            return self.inner(inp)

    wrap = (lambda s, b: FailingForward(b)) if rank == failing_rank == 0 else None
    stages, blocks = build_stages(chain, rank, world_size, "loop", wrap=wrap)
    schedule = ScheduleRRFP(stages, M, loss_fn=failing_loss, hint="GPipe", stall_timeout=30,
                            device=EmulatedDevice(), launch_depth=1)
    run_steps(schedule, stages, blocks, x, y, 1)
    snapshot = [copy.deepcopy(b) for b in blocks]
    failing_loss.armed = rank == failing_rank
    for stage in stages:
        if isinstance(stage.submod, FailingForward):
            stage.submod.calls, stage.submod.armed = 0, True
    failing_loss.calls = 0
    start = time.perf_counter()
    error = None
    try:
        run_steps(schedule, stages, blocks, x, y, 1)
    except Exception as e:
        error = error_chain(e)
    elapsed = time.perf_counter() - start
    threads_after_failure = rrfp_threads()
    # Microbatches forwarded but never backwarded: their graphs must not outlive the failure.
    cached_after_failure = sum(forward_states_held(stage) for stage in stages)
    bound_after_failure = receive_buffers_bound(stages)
    try:
        run_steps(schedule, stages, blocks, x, y, 1)
        refused = None
    except RuntimeError as e:
        refused = str(e)

    # A new schedule on the parameters as they were before the failed step (which ran no
    # optimizer step), on fresh stages.
    bitwise = recovers_as_gpipe(chain, snapshot, rank, world_size, M, x, y)
    return {"error": error, "elapsed": elapsed, "refused": refused,
            "threads_after_failure": threads_after_failure, "threads_at_end": rrfp_threads(),
            "cached_after_failure": cached_after_failure,
            "bound_after_failure": bound_after_failure,
            "bitwise": bitwise}


def recovers_as_gpipe(chain, snapshot, rank: int, world_size: int, M: int, x, y) -> bool:
    """Whether a new ScheduleRRFP, on fresh stages with the parameters ``snapshot`` holds
    (this rank's blocks), steps bitwise as torch's GPipe."""
    full = list(chain)
    for s, saved in zip(local_stage_indices(rank, world_size, world_size, "loop"), snapshot):
        full[s] = saved
    stages, blocks = build_stages(full, rank, world_size, "loop")
    recovered = ScheduleRRFP(stages, M, loss_fn=loss_fn, hint="GPipe", stall_timeout=300,
                             device=EmulatedDevice(), launch_depth=1)
    got = run_steps(recovered, stages, blocks, x, y, 1)
    recovered.close()
    fixed_stages, fixed_blocks = build_stages(full, rank, world_size, "loop")
    expected = run_steps(torch_schedule("GPipe", fixed_stages, M), fixed_stages, fixed_blocks,
                         x, y, 1)
    return bitwise_equal(got, expected)


def split_backward_failure(rank: int, world_size: int) -> dict:
    """ZBVZeroBubble (backward split into I and W) over the emulated device; the loss of
    the third microbatch raises on the rank that holds the last stage. What each rank's
    stages still hold for unfinished microbatches once the step has failed."""
    M = 4
    chain = make_chain(2 * world_size)
    x, y = make_batch(M)
    failing_loss = FailingLoss(fail_at_call=3)
    stages, blocks = build_stages(chain, rank, world_size, "v")
    failing_loss.armed = any(stage.is_last for stage in stages)
    schedule = ScheduleRRFP(stages, M, loss_fn=failing_loss, hint="ZBVZeroBubble",
                            stall_timeout=30, device=EmulatedDevice(), launch_depth=1)
    error = None
    try:
        run_steps(schedule, stages, blocks, x, y, 1)
    except Exception as e:
        error = error_chain(e)
    held = {name: sum(len(getattr(stage, name)) for stage in stages)
            for name in ("backward_state", "dw_runner", "bwd_cache")}
    held["forward_states"] = sum(forward_states_held(stage) for stage in stages)
    return {"error": error, "held": held, "bound": receive_buffers_bound(stages)}


def receive_buffers_bound(stages) -> int:
    """Receive descriptors of the stages that still point at a buffer."""
    return sum(info.buffer is not None for stage in stages
               for infos in (*stage.args_recv_info.values(), *stage.grad_recv_info.values())
               for info in infos if not info.is_root_arg)


class LazilyConnectedGroup:
    """A gloo channel group that connects at its first operation, as NCCL creates a
    communicator lazily (no bound device): the first operation on the channel blocks until
    the peer's first operation on the same channel (here for at most ``timeout_s``, then
    raises: a deadlock made visible)."""

    def __init__(self, store: dist.Store, rank: int, timeout_s: float):
        self._store, self._rank, self._timeout_s = store, rank, timeout_s
        self._group: dist.ProcessGroup | None = None
        self._failed = False

    def _connected(self, tag: int) -> dist.ProcessGroup:
        if self._group is None:
            if self._failed or tag != 0:  # after a failed connection, or rrfp closing it
                raise RuntimeError("lazily connected channel was never connected")
            self._store.set(f"first-op/{self._rank}", b"1")
            try:
                self._store.wait([f"first-op/{1 - self._rank}"],
                                 datetime.timedelta(seconds=self._timeout_s))
            except RuntimeError as e:
                self._failed = True
                raise RuntimeError(f"first operation on a lazily connected channel timed out "
                                   f"after {self._timeout_s} s: the peer never used it") from e
            self._group = make_channel_group("gloo", self._store, self._rank,
                                             datetime.timedelta(seconds=60))
        return self._group

    def send(self, tensors, peer: int, tag: int) -> dist.Work:
        return self._connected(tag).send(tensors, peer, tag)

    def recv(self, tensors, peer: int, tag: int) -> dist.Work:
        return self._connected(tag).recv(tensors, peer, tag)


def lazily_connected_channels(rank: int, world_size: int, connect: bool) -> dict:
    """1F1B over channels that connect at their first operation; with or without rrfp's
    connection step (one exchange per channel, in one order, at construction)."""
    import functools

    import rrfp.schedule
    from rrfp.channels import create_channels

    def lazy(name, store, channel_rank, timeout, **naming):
        return LazilyConnectedGroup(store, channel_rank, timeout_s=3.0)

    rrfp.schedule.create_channels = functools.partial(create_channels, group_factory=lazy,
                                                      connect=connect)
    M = 4
    chain = make_chain(world_size)
    x, y = make_batch(M)
    stages, blocks = build_stages(chain, rank, world_size, "loop")
    fixed = run_steps(torch_schedule("1F1B", stages, M), stages, blocks, x, y, 2)
    stages, blocks = build_stages(chain, rank, world_size, "loop")
    schedule = ScheduleRRFP(stages, M, loss_fn=loss_fn, hint="1F1B", stall_timeout=30)
    start = time.perf_counter()
    try:
        history = run_steps(schedule, stages, blocks, x, y, 2)
    except Exception as e:
        return {"error": error_chain(e), "elapsed": time.perf_counter() - start}
    schedule.close()
    return {"bitwise": bitwise_equal(history, fixed), "elapsed": time.perf_counter() - start}


def device_durations(rank: int, world_size: int, launch_cost: float) -> dict:
    """1F1B on the emulated asynchronous device: forwards take 100 ms, backwards 200 ms of
    emulated device time (``"targets"``), each launch ``launch_cost`` s of CPU time; three
    steps, each step's device spans (``"steps"``) and the durations the schedule learned."""
    M = 4
    targets = {"F": 0.1, "B": 0.2}
    chain = make_chain(world_size)
    x, y = make_batch(M)
    stages, blocks = build_stages(
        chain, rank, world_size, "loop",
        wrap=lambda s, b: EmulatedDeviceTime(b, M, lambda mb: targets["F"],
                                             lambda mb: targets["B"]))
    schedule = ScheduleRRFP(stages, M, loss_fn=loss_fn, hint="1F1B", launch_depth=2,
                            device=EmulatedDevice(launch_cost=launch_cost))
    steps = []
    for _ in range(3):
        run_steps(schedule, stages, blocks, x, y, 1)
        steps.append([(s.kind, s.end - s.start) for s in schedule.last_step_stats.spans
                      if s.kind in ("F", "B")])
    stats = schedule.last_step_stats
    schedule.close()
    return {"targets": targets, "steps": steps,
            "history": {kind: seconds for (_, kind), seconds in schedule.history.durations.items()},
            "launch_time": stats.launch_time, "dispatched": stats.dispatched,
            "busy": stats.device_busy_time, "step": stats.step_time}


def tensor_parallel_peer_stops(rank: int, world_size: int, coordination: str) -> dict:
    """PP 2 x TP 2; after one step, global rank 0 (the TP leader of pipeline rank 0)
    stops stepping. Every other rank must raise PipelineStallError within about the stall
    timeout (2 s), naming a peer, not wait for gloo's own timeout."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import (
        ColwiseParallel, parallelize_module, RowwiseParallel)

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "tp"))
    pp = mesh["pp"].get_local_rank()
    num_stages, M = 4, 4
    torch.manual_seed(0)
    chain = [MLPBlock().double() for _ in range(num_stages)]
    x, y = make_batch(M)
    local = local_stage_indices(pp, 2, num_stages, "loop")
    blocks = [parallelize_module(copy.deepcopy(chain[s]), mesh["tp"],
                                 {"up": ColwiseParallel(), "down": RowwiseParallel()})
              for s in local]
    stages = [PipelineStage(b, s, num_stages, torch.device("cpu"), group=mesh["pp"].get_group())
              for b, s in zip(blocks, local)]
    schedule = ScheduleRRFP(stages, M, loss_fn=loss_fn, hint="Interleaved1F1B", stall_timeout=2.0,
                            coordination_group=mesh["tp"].get_group(), coordination=coordination)
    run_steps(schedule, stages, blocks, x, y, 1)
    outcome: dict = {}
    if rank != 0:
        start = time.perf_counter()
        try:
            run_steps(schedule, stages, blocks, x, y, 1)
        except Exception as e:
            outcome = {"error": f"{type(e).__name__}: {e}", "elapsed": time.perf_counter() - start}
    return outcome


def tensor_parallel_without_coordination(rank: int, world_size: int) -> str:
    """PP 2 x TP 2 with DTensor stages but no coordination group: every rank must refuse."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import (
        ColwiseParallel, parallelize_module, RowwiseParallel)

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "tp"))
    pp = mesh["pp"].get_local_rank()
    torch.manual_seed(0)
    chain = [MLPBlock().double() for _ in range(2)]
    x, y = make_batch(2)
    block = parallelize_module(copy.deepcopy(chain[pp]), mesh["tp"],
                               {"up": ColwiseParallel(), "down": RowwiseParallel()})
    stage = PipelineStage(block, pp, 2, torch.device("cpu"), group=mesh["pp"].get_group())
    schedule = ScheduleRRFP(stage, 2, loss_fn=loss_fn, hint="1F1B", stall_timeout=30)
    try:
        run_steps(schedule, [stage], [block], x, y, 1)
    except ValueError as e:
        return str(e)
    raise AssertionError("no ValueError")


def dtensor_variable_shapes(rank: int, world_size: int) -> str:
    """PP 2 x TP 2, the first stage's output a DTensor (``use_local_output=False``), so
    that activations and their gradients travel as DTensors, with ``variable_shapes=True``:
    what each rank's first step raises."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import (
        ColwiseParallel, parallelize_module, RowwiseParallel)

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "tp"))
    pp = mesh["pp"].get_local_rank()
    torch.manual_seed(0)
    chain = [MLPBlock().double() for _ in range(2)]
    x, y = make_batch(2)
    block = parallelize_module(copy.deepcopy(chain[pp]), mesh["tp"],
                               {"up": ColwiseParallel(),
                                "down": RowwiseParallel(use_local_output=pp == 1)})
    stage = PipelineStage(block, pp, 2, torch.device("cpu"), group=mesh["pp"].get_group(),
                          get_mesh=lambda names, layout: mesh[names])
    schedule = ScheduleRRFP(stage, 2, loss_fn=loss_fn, hint="1F1B", stall_timeout=5,
                            variable_shapes=True, coordination_group=mesh["tp"].get_group())
    xs, ys = list(x.chunk(2)), list(y.chunk(2))
    try:
        schedule.step_microbatches([(t,) for t in xs] if pp == 0 else None,
                                   ys if pp == 1 else None)
    except Exception as e:
        return f"{type(e).__name__}: {e}"
    finally:
        schedule.close()
    return "no error"


def shared_parameters(rank: int, world_size: int) -> list[str]:
    """V placement over 2 ranks: rank 0 holds stages 0 and 3; tie their weights."""
    import warnings

    chain = make_chain(4)
    chain[3][0].weight = chain[0][0].weight
    indices = local_stage_indices(rank, world_size, 4, "v")
    stages = [PipelineStage(chain[s], s, 4, torch.device("cpu")) for s in indices]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        schedule = ScheduleRRFP(stages, 4, loss_fn=loss_fn, hint="ZBVZeroBubble")
    schedule.close()
    return [str(w.message) for w in caught if issubclass(w.category, UserWarning)
            and "share parameters" in str(w.message)]


def variable_batches(n_microbatches: int, lengths: list[int], seed: int):
    """Per microbatch an input and a target of shape [2, length, DIM] (float64)."""
    g = torch.Generator().manual_seed(seed)
    xs = [torch.randn(2, lengths[m % len(lengths)], DIM, generator=g, dtype=torch.float64)
          for m in range(n_microbatches)]
    ys = [torch.randn_like(x) for x in xs]
    return xs, ys


def variable_shapes(rank: int, world_size: int, hint: str, per_rank: int, layout: str,
                    delay_seed: int, kind: str = "gloo") -> dict:
    """Microbatches of different sequence lengths, and other lengths the next step: RRFP
    (variable_shapes, emulated device, random delays) vs RRFP's fixed policy on the same
    data, bitwise, and vs the unpipelined float64 model. ``kind``: the channels
    (``_channels_of``); on ``"nccl-like"`` ones, also what went over them."""
    made = _channels_of(kind)
    num_stages, M = world_size * per_rank, 2 * world_size
    chain = make_chain(num_stages)
    local = local_stage_indices(rank, world_size, num_stages, layout)
    data = [variable_batches(M, lengths, seed=step)
            for step, lengths in enumerate(([3, 7, 2, 5], [6, 1, 4]))]

    def run(policy: str, delayed: bool):
        wrap = (lambda s, b: random_device_time(delay_seed, s, M, 0.003)(b)) if delayed else None
        stages, blocks = build_stages(chain, rank, world_size, layout, wrap=wrap)
        # Delayed: also a late activation that reorders actions.
        send_delay = (random_send_delay(delay_seed * 31 + rank, 0.003, SECOND_ACTIVATION_LATE)
                      if delayed else None)
        schedule = ScheduleRRFP(stages, M, loss_fn=loss_fn, hint=hint, policy=policy,
                                variable_shapes=True, device=EmulatedDevice(),
                                buffer_limit="hint+1", stall_timeout=60, send_delay=send_delay)
        optimizer = torch.optim.SGD([p for b in blocks for p in b.parameters()], lr=0.1)
        history = []
        for xs, ys in data:
            optimizer.zero_grad(set_to_none=True)
            losses: list = []
            schedule.step_microbatches(
                [(x,) for x in xs] if any(s.is_first for s in stages) else None,
                ys if any(s.is_last for s in stages) else None, losses=losses)
            history.append(([p.grad.clone() for b in blocks for p in b.parameters()],
                            [loss.detach().clone() for loss in losses]))
            optimizer.step()
        stats = schedule.last_step_stats
        schedule.close()
        return history, stats

    fixed, _ = run("fixed", delayed=False)
    rrfp, stats = run(None, delayed=True)

    reference = [copy.deepcopy(b) for b in chain]
    optimizer = torch.optim.SGD([p for b in reference for p in b.parameters()], lr=0.1)
    errors = []
    for (xs, ys), (grads, _) in zip(data, fixed):
        optimizer.zero_grad(set_to_none=True)
        total = 0
        for x, y in zip(xs, ys):
            out = x
            for block in reference:
                out = block(out)
            total = total + loss_fn(out, y)
        (total / M).backward()
        expected = [p.grad for s in local for p in reference[s].parameters()]
        errors.append(max((g - e).abs().max().item() for g, e in zip(grads, expected)))
        optimizer.step()
    result = {"bitwise": bitwise_equal(rrfp, fixed), "error": max(errors),
              "out_of_order": stats.out_of_hint_order,
              "receive_bytes": stats.receive_buffer_bytes}
    if made is not None:  # the dtypes sent over the (NCCL-like) data channels
        result["data_dtypes"] = sorted({str(d) for g in made.made for d in g.sent_dtypes})
    return result


class CountingGroup:
    """A channel's gloo group that records every send made on it: (bytes, dtype)."""

    def __init__(self, group: dist.ProcessGroup, sends: list):
        self._group, self._sends = group, sends

    def send(self, tensors, peer: int, tag: int) -> dist.Work:
        self._sends.extend((t.numel() * t.element_size(), t.dtype) for t in tensors)
        return self._group.send(tensors, peer, tag)

    def __getattr__(self, name):
        return getattr(self._group, name)


def messages_per_step(rank: int, world_size: int, variable: bool) -> dict:
    """What this rank sends in the second of two 1F1B steps of fixed-shape microbatches:
    counted on the channels' groups themselves (``CountingGroup``), and as the step's stats
    report it."""
    import functools

    import rrfp.schedule
    from rrfp.channels import create_channels, make_channel_group

    sends: list = []

    def counting(name, store, channel_rank, timeout, **naming):
        return CountingGroup(make_channel_group(name, store, channel_rank, timeout, **naming),
                             sends)

    rrfp.schedule.create_channels = functools.partial(create_channels, group_factory=counting)
    M = 4
    chain = make_chain(world_size)
    x, y = make_batch(M)
    stages, _ = build_stages(chain, rank, world_size, "loop")
    schedule = ScheduleRRFP(stages, M, loss_fn=loss_fn, hint="1F1B", variable_shapes=variable)
    xs, ys = list(x.chunk(M)), list(y.chunk(M))
    for _ in range(2):
        sends.clear()  # the connection's token, then the first step's
        schedule.step_microbatches([(t,) for t in xs] if rank == 0 else None,
                                   ys if rank == world_size - 1 else None)
    schedule.close()
    stats = schedule.last_step_stats
    return {"counted": len(sends), "counted_bytes": sum(n for n, _ in sends),
            "headers": sum(1 for n, dtype in sends if dtype == torch.int64),
            "header_bytes": sorted({n for n, dtype in sends if dtype == torch.int64}),
            "reported": stats.messages_sent, "reported_bytes": stats.bytes_sent}


def variable_shape_that_breaks_the_model(rank: int, world_size: int) -> dict:
    """Microbatch 2's features do not fit the first stage's Linear: every rank must raise,
    promptly, naming the problem (rank 0) or the closed channel (the others)."""
    M = 2 * world_size
    chain = make_chain(world_size)
    stages, _ = build_stages(chain, rank, world_size, "loop")
    schedule = ScheduleRRFP(stages, M, loss_fn=loss_fn, hint="1F1B", variable_shapes=True,
                            stall_timeout=60, device=EmulatedDevice())
    xs, ys = variable_batches(M, [3, 5, 4], seed=0)
    xs[2] = torch.randn(2, 4, DIM + 3, dtype=torch.float64)
    start = time.perf_counter()
    try:
        schedule.step_microbatches([(x,) for x in xs] if rank == 0 else None,
                                   ys if rank == world_size - 1 else None)
    except Exception as e:
        return {"error": error_chain(e), "elapsed": time.perf_counter() - start}
    return {"error": None}


def agree_when_policies_differ(rank: int, world_size: int) -> dict:
    """Two ranks of a coordination group whose policies rank the same two ready actions
    (pipeline rank 1 of 1F1B after its first forward: B0, and F1 whose input is here)
    oppositely: they must still settle on one action, the hint's next."""
    from rrfp.arbiter import Arbiter
    from rrfp.coordination import AgreeOnProposals
    from rrfp.actions import Edge
    from rrfp.hints import build_hint

    class Opposite:
        name = "opposite"

        def choose(self, ready, arbiter):
            return ready[rank % 2 - 1]

        def lead(self, arbiter):
            return arbiter.first_undone

    hint = build_hint("1F1B", num_ranks=2, num_stages=2, n_microbatches=4)
    arbiter = Arbiter(hint, 1, policy=Opposite())
    for mb in (0, 1):
        arbiter.deliver(Edge(0, 1), mb, at=0.0)
    arbiter.record_launch(arbiter.choose())
    coordinator = AgreeOnProposals(dist.group.WORLD, stall_timeout=10)
    for round_ in range(1, 6):
        agreed = coordinator.settle(arbiter.choose(), arbiter, time.sleep)
        if agreed is not None:
            return {"agreed": str(agreed), "hint_next": str(hint.orders[1][1]), "rounds": round_}
    return {"agreed": None, "rounds": round_}


def stats_exchange(rank: int, world_size: int) -> dict:
    """``StepStatsLog`` over three steps with made-up stats (out-of-hint = 10 x step +
    rank), the last logged twice, only the last rank reading: the scalars it returns, and
    which of this rank's keys its store still holds."""
    from torchtitan_ext.common.stats_logging import stats_store, StepStatsLog

    class Schedule:
        last_step_stats: StepStats

    schedule = Schedule()
    log = StepStatsLog(schedule, dist.new_group(list(range(world_size))), replica=None,
                       log_stats=True, trace_folder=None, reads=rank == world_size - 1)
    scalars = {}
    for step in (1, 2, 3, 3):
        schedule.last_step_stats = made_up_stats(
            rank, peak_activation_bytes=None if step == 2 else 64,
            out_of_hint_order=10 * step + rank)
        scalars[step] = log.log(step)
        dist.barrier()  # what the next training step's pipeline does
    store = stats_store(list(range(world_size)), 0)
    keys = [step for step in (1, 2, 3) if store.check([f"{step}/{rank}"])]
    dist.barrier()  # rank 0, which does not read, hosts the store
    return {"scalars": scalars, "keys": keys}


def made_up_stats(rank: int, **fields) -> StepStats:
    """A rank's ``StepStats`` with plain values in every field; ``fields`` override them."""
    values = dict(pp_rank=rank, global_rank=rank, hint="1F1B", policy="hint",
                  device="HostDevice", launch_depth=1, buffer_limits=None,
                  rank_buffer_limit=None, hint_peak_in_flight={}, hint_rank_peak=1,
                  hint_busiest_rank_peak=1,
                  peak_in_flight={}, peak_rank_in_flight=1, peak_activation_bytes=0,
                  receive_buffer_bytes=0, messages_sent=0, bytes_sent=0,
                  backpressure_entries={}, out_of_hint_order=0, hint_order=[],
                  realized_order=[], step_time=1.0, device_busy_time=0.5, wait_time=0.0,
                  decision_time=0.0, launch_time=0.0, start_unix=0.0)
    return StepStats(**{**values, **fields})


def pre_split(rank: int, world_size: int, hint: str, stages_per_rank: int) -> dict:
    """torch's pre-split call, ``step(arg_mbs=..., target_mbs=...)``, under RRFP with random
    device and link delays and a late activation that reorders actions, against torch's
    fixed schedule given the same microbatches (torch >= 2.14: pre-split too; 2.13 has no
    such call: the whole batch, which it splits into the same chunks); and
    ``step_microbatches`` on the same microbatches."""
    M, steps = 4, 2
    chain = make_chain(world_size * stages_per_rank)
    x, y = make_batch(M)
    arg_mbs, target_mbs = [(t,) for t in x.chunk(M)], list(y.chunk(M))
    first = lambda stages: any(s.is_first for s in stages)  # noqa: E731
    last = lambda stages: any(s.is_last for s in stages)  # noqa: E731

    def train(schedule, stages, blocks, call) -> tuple[list, list]:
        optimizer = torch.optim.SGD([p for b in blocks for p in b.parameters()], lr=0.1)
        history, outputs = [], []
        for _ in range(steps):
            optimizer.zero_grad(set_to_none=True)
            losses: list = []
            outputs.append(call(schedule, stages, losses))
            history.append(([p.grad.clone() for b in blocks for p in b.parameters()],
                            [loss.detach().clone() for loss in losses]))
            optimizer.step()
        return history, outputs

    def pre_split_call(schedule, stages, losses):
        return schedule.step(arg_mbs=arg_mbs if first(stages) else None,
                             target_mbs=target_mbs if last(stages) else None, losses=losses)

    def whole_batch_call(schedule, stages, losses):
        return schedule.step(*((x,) if first(stages) else ()), target=y, losses=losses)

    def alias_call(schedule, stages, losses):
        return schedule.step_microbatches(arg_mbs if first(stages) else None,
                                          target_mbs if last(stages) else None, losses=losses)

    stages, blocks = build_stages(chain, rank, world_size, "loop")
    torch_has_pre_split = "arg_mbs" in inspect.signature(
        torch_schedule(hint, stages, M).step).parameters
    fixed, fixed_out = train(torch_schedule(hint, stages, M), stages, blocks,
                             pre_split_call if torch_has_pre_split else whole_batch_call)
    results = {"torch_pre_split": torch_has_pre_split}
    for name, call in (("step", pre_split_call), ("step_microbatches", alias_call)):
        wrap = lambda s, b: random_device_time(3, s, M, 0.003)(b)  # noqa: E731
        stages, blocks = build_stages(chain, rank, world_size, "loop", wrap=wrap)
        schedule = ScheduleRRFP(stages, M, loss_fn=loss_fn, hint=hint, buffer_limit="hint+1",
                                policy="hint", device=EmulatedDevice(), stall_timeout=60,
                                send_delay=random_send_delay(17 + rank, 0.003,
                                                             SECOND_ACTIVATION_LATE))
        history, outputs = train(schedule, stages, blocks, call)
        results[name] = {
            "bitwise": bitwise_equal(history, fixed),
            "outputs": all((a is None and b is None) or torch.equal(a, b)
                           for a, b in zip(outputs, fixed_out)),
            "out_of_order": schedule.last_step_stats.out_of_hint_order,
        }
        errors = []
        for bad in (dict(arg_mbs=arg_mbs[:-1]), dict(arg_mbs=[t for (t,) in arg_mbs]),
                    dict(arg_mbs=arg_mbs, target=y)):
            try:
                schedule.step(**bad)
            except (TypeError, ValueError) as e:
                errors.append(f"{type(e).__name__}: {e}")
        results[name]["errors"] = errors
        schedule.close()
    return results


def gradient_accumulation(rank: int, world_size: int) -> dict:
    """PP 2 x FSDP 2, 1F1B: ``step(finalize_gradients=False)`` then a finalizing step, on
    two batches, under RRFP with random delays that differ between the replicas and a late
    activation that reorders actions. Against
    torch's own schedule making the same two calls where torch has the argument (2.15),
    and against the non-pipelined model over both batches on every version."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "pp"))
    dp, pp = mesh["dp"].get_local_rank(), mesh["pp"].get_local_rank()
    num_stages, M = 2, 4
    chain = make_chain(num_stages)
    batches = [make_batch(2 * M, seed=seed) for seed in (1, 2)]
    per_replica = M * BATCH_PER_MICROBATCH
    replica = slice(dp * per_replica, (dp + 1) * per_replica)

    def build(seed: int | None):
        block = copy.deepcopy(chain[pp])
        module = block if seed is None else random_device_time(seed * 10 + dp, pp, M, 0.003)(block)
        fully_shard(module, mesh=mesh["dp"])
        module.set_force_sum_reduction_for_comms(True)
        stage = PipelineStage(module, pp, num_stages, torch.device("cpu"), group=mesh["pp"].get_group())
        return stage, block

    def accumulate(schedule, stage, block) -> dict:
        unsharded_between = []
        for i, (x, y) in enumerate(batches):
            inputs = (x[replica],) if stage.is_first else ()
            schedule.step(*inputs, target=y[replica], finalize_gradients=i == 1)
            if i == 0:
                unsharded_between = [p.shape == q.shape for p, q in
                                     zip(block.parameters(), chain[pp].parameters())]
        return {"grads": [p.grad.to_local().clone() for p in block.parameters()],
                "full": [p.grad.full_tensor() for p in block.parameters()],
                "unsharded_between": all(unsharded_between)}

    result = {}
    stage, block = build(None)
    fixed = torch_schedule("1F1B", [stage], M)
    if "finalize_gradients" in inspect.signature(fixed.step).parameters:
        result["torch"] = accumulate(fixed, stage, block)
    stage, block = build(3)
    rrfp = ScheduleRRFP(stage, M, loss_fn=loss_fn, hint="1F1B", buffer_limit="hint+1",
                        policy="hint", device=EmulatedDevice(), stall_timeout=60,
                        send_delay=random_send_delay(3 * 7919 + rank, 0.003,
                                                     SECOND_ACTIVATION_LATE))
    result["rrfp"] = accumulate(rrfp, stage, block)
    result["out_of_order"] = rrfp.last_step_stats.out_of_hint_order
    rrfp.close()
    reference = [copy.deepcopy(b) for b in chain]
    total = 0
    for x, y in batches:
        out = x
        for b in reference:
            out = b(out)
        total = total + loss_fn(out, y)
    total.backward()
    result["error"] = max((g - p.grad).abs().max().item()
                          for g, p in zip(result["rrfp"]["full"], reference[pp].parameters()))
    if "torch" in result:
        result["bitwise"] = all(torch.equal(a, b) for a, b in
                                zip(result["rrfp"]["grads"], result["torch"]["grads"]))
    for run in ("rrfp", "torch"):
        if run in result:
            del result[run]["grads"], result[run]["full"]
    return result


def _channels_of(kind: str, **fake):
    """Make ScheduleRRFP build its channels as ``kind`` says: ``"gloo"`` (rrfp's own) or
    ``"nccl-like"`` (``tests.nccl_like``: polled, local abort, sends that complete only
    once the peer receives). Returns the fake factory (or None)."""

    import rrfp.schedule
    from rrfp.channels import create_channels
    from tests import nccl_like

    if kind == "gloo":
        rrfp.schedule.create_channels = create_channels
        return None
    made = nccl_like.factory(**fake)

    def nccl_like_channels(hint, group, device, backend, **options):
        return create_channels(hint, group, device, "nccl", group_factory=made, **options)

    rrfp.schedule.create_channels = nccl_like_channels
    return made


def clean_close_then_peer_steps(rank: int, world_size: int, kind: str) -> dict:
    """An eval step (forwards only) of 1F1B over 6 microbatches; rank 1's forwards are slow
    (0.2 s), so its activation ring (2 slots) has not posted the receives of the last
    microbatches when rank 0 has sent everything. Rank 0 closes its schedule right after
    its step; rank 1 must still complete its own (no message of rank 0's dropped)."""
    _channels_of(kind)
    M = 6
    chain = make_chain(world_size)
    x, y = make_batch(M)
    wrap = ((lambda s, b: EmulatedDeviceTime(b, M, lambda mb: 0.2, lambda mb: 0.0))
            if rank == 1 else None)
    stages, blocks = build_stages(chain, rank, world_size, "loop", wrap=wrap)
    schedule = ScheduleRRFP(stages, M, loss_fn=loss_fn, hint="1F1B", stall_timeout=300,
                            device=EmulatedDevice(), launch_depth=1)
    run_steps(schedule, stages, blocks, x, y, 1)  # shape inference: torch's blocking P2P
    inputs = (x,) if rank == 0 else ()
    error = None
    start = time.perf_counter()
    try:
        with torch.no_grad():
            schedule.eval(*inputs, target=y)
        if rank == 0:
            schedule.close()
    except Exception as e:
        error = error_chain(e)
    elapsed = time.perf_counter() - start
    if rank == 1:
        schedule.close()
    return {"error": error, "elapsed": elapsed}


FAILED_AT: list[float] = []
"""``time.time()`` when a planted failure struck in this process."""


def _strike(what: str):
    FAILED_AT.append(time.time())
    raise RuntimeError(f"{what} failed on purpose")


def failure_reaches_every_rank(rank: int, world_size: int, kind: str, how: str) -> dict:
    """GPipe over ``world_size`` ranks on the emulated device, ``stall_timeout`` 300 s;
    in the second step one rank fails mid-step (``how``): ``"forward"`` (rank 0, stage 0's
    forward of microbatch 2), ``"loss"`` (the last rank, microbatch 2's loss), ``"send"``
    (rank 1's second activation send: on ``"nccl-like"`` channels its work completes with
    an error, on gloo the send call raises). Channels: ``kind`` (``_channels_of``). Every
    rank records what it raised and when; then each builds a new schedule in the same
    process, whose step must be bitwise torch's GPipe."""
    from rrfp.channels import Channel

    M = 6
    failing = {"forward": 0, "loss": world_size - 1, "send": 1}[how]
    plant = how == "send" and rank == failing
    # The second activation of the second step (the first step sent M).
    _channels_of(kind, fail_send_at={(1, 2): M + 1} if plant and kind == "nccl-like" else None)
    if plant and kind == "gloo":
        real_send, sent = Channel.send, []

        def send(self, tensor):
            if self.edge.src == 1 and self.edge.dst == 2 and tensor.numel() > 1:
                sent.append(1)
                if len(sent) == 2 and armed:
                    _strike("send")
            return real_send(self, tensor)

        Channel.send = send
    armed = False
    chain = make_chain(world_size)
    x, y = make_batch(M)

    class Failing(torch.nn.Module):
        def __init__(self, inner):
            super().__init__()
            self.inner, self.calls = inner, 0

        def forward(self, inp):
            self.calls += 1
            if armed and self.calls == 3:
                _strike("forward")
            return self.inner(inp)

    calls = [0]

    def loss(output, target):
        calls[0] += 1
        if armed and calls[0] == 3:
            _strike("loss")
        return loss_fn(output, target)

    wrap = (lambda s, b: Failing(b)) if how == "forward" and rank == failing else None
    stages, blocks = build_stages(chain, rank, world_size, "loop", wrap=wrap)
    schedule = ScheduleRRFP(stages, M, loss_fn=loss if how == "loss" and rank == failing
                            else loss_fn, hint="GPipe", stall_timeout=300,
                            device=EmulatedDevice(), launch_depth=1)
    run_steps(schedule, stages, blocks, x, y, 1)
    snapshot = [copy.deepcopy(b) for b in blocks]
    armed, calls[0] = True, 0
    for stage in stages:
        if isinstance(stage.submod, Failing):
            stage.submod.calls = 0
    if plant and kind == "gloo":
        sent.clear()
    error, failed_rank = None, None
    try:
        run_steps(schedule, stages, blocks, x, y, 1)
    except Exception as e:
        error = error_chain(e)
        failed_rank = getattr(e, "failed_rank", None)
    raised_at = time.time()
    armed = False
    if plant and kind == "gloo":
        Channel.send = real_send
    _channels_of(kind)
    bitwise = recovers_as_gpipe(chain, snapshot, rank, world_size, M, x, y)
    return {"error": error, "failed_rank": failed_rank, "raised_at": raised_at,
            "failed_at": FAILED_AT[0] if FAILED_AT else None,
            "bitwise": bitwise, "threads_at_end": rrfp_threads()}
