"""A step's ``StepStats``, from what its loop, executor and coordinator saw."""

from __future__ import annotations

import time

import torch.distributed as dist

from rrfp.comm.coordination import Coordinator
from rrfp.core.loop import Device, StepLoop
from rrfp.core.sizes import StepSizes
from rrfp.core.stats import Span, StepStats
from rrfp.runtime.executor import StageExecutor
from rrfp.runtime.limit_plan import LimitPlan
from rrfp.runtime.meter import ActivationMeter


def step_stats(loop: StepLoop, executor: StageExecutor, coordinator: Coordinator | None,
               end: float, sent: tuple[int, int], *, rank: int, device: Device,
               meter: ActivationMeter | None, limits: LimitPlan,
               activation_bytes_per_microbatch: dict[int, int] | None,
               receive_buffer_bytes: int, step: int,
               size_prediction_error: dict[int, float] | None = None,
               setting: str | None = None, sizes: StepSizes | None = None,
               sizes_used: bool = False) -> StepStats:
    """``end``: the step's length in seconds; ``sent``: (messages, bytes) it sent;
    ``meter``: the byte meter if this step was metered; ``size_prediction_error``: per
    stage, how far the durations predicted from the sizes fell from the measured ones;
    ``setting``: what the user set in place of ``buffer_limit`` (self-driving's budget);
    ``sizes``: the step's microbatch sizes as given, ``sizes_used``: whether its policy
    was told them."""
    arbiter = loop.arbiter
    # A step ranked by an interchangeable hint is told against the run's own hint.
    ranked_by = limits.ranked_by if arbiter.hint is limits.ranked_by else None
    hint = arbiter.hint if ranked_by is None else limits.hint
    local = hint.stages_on(rank)
    stage_peaks, rank_peaks = hint.plan.stage_peaks, hint.plan.rank_peaks()
    byte_limits = limits.byte_limits
    spans = [Span(str(c.action), c.start, c.end, c.action.stage_index,
                  c.action.computation_type.value, c.action.microbatch_index)
             for c in loop.completions]
    spans += [Span("wait", start, stop, kind="wait") for start, stop in loop.waits]
    return StepStats(
        pp_rank=rank,
        global_rank=dist.get_rank(),
        hint=hint.name,
        ranked_by=None if ranked_by is None else ranked_by.name,
        policy=arbiter.policy.name,
        device=type(device).__name__,
        launch_depth=loop.launch_depth,
        arrivals=[(a.edge.src, a.edge.dst, a.microbatch, a.at) for a in loop.received],
        sends=list(executor.sends),
        buffer_limits=dict(arbiter.limits) if arbiter.limits else None,
        rank_buffer_limit=arbiter.rank_limit,
        hint_peak_in_flight={s: stage_peaks[s] for s in local},
        hint_rank_peak=rank_peaks[rank],
        hint_busiest_rank_peak=max(rank_peaks.values()),
        peak_in_flight=dict(arbiter.peak_in_flight),
        peak_rank_in_flight=arbiter.peak_held,
        peak_activation_bytes=None if meter is None else meter.peak,
        activation_bytes_per_microbatch=(
            None if activation_bytes_per_microbatch is None
            else {s: activation_bytes_per_microbatch[s] for s in local}),
        rank_budget_bytes=None if byte_limits is None else byte_limits.budgets[rank],
        rank_limit_bytes=None if byte_limits is None else byte_limits.allowed_bytes[rank],
        busiest_rank_peak_bytes=(None if byte_limits is None
                                 else max(byte_limits.fixed_peak_bytes.values())),
        receive_buffer_bytes=receive_buffer_bytes,
        messages_sent=sent[0],
        bytes_sent=sent[1],
        backpressure_entries=dict(arbiter.backpressure_entries),
        out_of_hint_order=arbiter.out_of_order,
        hint_order=[str(n.action) for n in hint.plan.ranks[rank].nodes],
        realized_order=[str(a) for a in arbiter.realized],
        step_time=end,
        device_busy_time=loop.busy_time,
        wait_time=loop.wait_time,
        decision_time=loop.decision_time,
        launch_time=loop.launch_time,
        coordination=coordinator.name if coordinator else None,
        coordination_rounds=coordinator.rounds if coordinator else 0,
        coordination_deferrals=coordinator.deferrals if coordinator else 0,
        coordination_time=coordinator.seconds if coordinator else 0.0,
        start_unix=time.time() - end,
        step=step,
        buffer_limit=setting or str(limits.setting.spec),
        num_stages=hint.num_stages,
        n_microbatches=hint.n_microbatches,
        placement=hint.layout,
        size_prediction_error=size_prediction_error,
        sizes=None if sizes is None else list(sizes),
        sizes_used=sizes_used,
        spans=spans,
    )
