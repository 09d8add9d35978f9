"""Synthetic step traces for the advisor's tests: steps simulated from a workload model,
written as ScheduleRRFP writes a measured step's trace (every rank's spans, messages and
metadata)."""

from __future__ import annotations

import os

from rrfp.hints import build_hint, Hint
from rrfp.limits import resolve_buffer_limits
from rrfp.policy import default_policy
from rrfp.sim.engine import simulate
from rrfp.sim.workloads import make_timing, Timing
from rrfp.stats import StepStats, write_chrome_trace


def simulated_step_stats(hint: Hint, timing: Timing, step: int, *, buffer_limit: str = "hint",
                         policy: str | None = None, bytes_per_microbatch=None,
                         start_unix: float = 1000.0) -> list[StepStats]:
    """Every rank's ``StepStats`` of one step of ``hint`` simulated on ``timing``
    (seconds), as the runtime would report it."""
    limits = resolve_buffer_limits(buffer_limit, hint)
    policy = policy or default_policy(hint, limits)
    result = simulate(hint, timing.duration, latency=timing.latency, policy=policy,
                      limits=limits, launch_depth=1)
    ends = {(s.stage, s.kind, s.microbatch): s.end
            for spans in result.spans.values() for s in spans}
    sends: dict[int, list] = {r: [] for r in range(hint.num_ranks)}
    arrivals: dict[int, list] = {r: [] for r in range(hint.num_ranks)}
    for rank, plan in hint.plan.ranks.items():
        for node in plan.nodes:
            for edge in node.sends:
                sent = ends[(node.stage, node.action.computation_type.value, node.microbatch)]
                sends[rank].append((edge.src, edge.dst, node.microbatch, sent))
                arrivals[hint.stage_to_rank[edge.dst]].append(
                    (edge.src, edge.dst, node.microbatch, sent + timing.latency(edge, node.microbatch)))
    stats = []
    for rank in range(hint.num_ranks):
        local = hint.stages_on(rank)
        stats.append(StepStats(
            pp_rank=rank, global_rank=rank, hint=hint.name, policy=policy,
            device="HostDevice", launch_depth=2, buffer_limits=dict(limits.per_stage),
            rank_buffer_limit=limits.per_rank[rank],
            hint_peak_in_flight={s: hint.plan.stage_peaks[s] for s in local},
            hint_rank_peak=hint.plan.rank_peaks()[rank],
            hint_busiest_rank_peak=max(hint.plan.rank_peaks().values()),
            peak_in_flight={s: result.peak_in_flight[s] for s in local},
            peak_rank_in_flight=result.rank_peaks[rank], peak_activation_bytes=None,
            receive_buffer_bytes=0, messages_sent=len(sends[rank]), bytes_sent=0,
            backpressure_entries={}, out_of_hint_order=result.out_of_order[rank],
            hint_order=[str(n.action) for n in hint.plan.ranks[rank].nodes],
            realized_order=[str(a) for a in result.realized[rank]],
            step_time=result.makespan, device_busy_time=result.busy[rank], wait_time=0.0,
            decision_time=0.0, launch_time=0.0, start_unix=start_unix + 10 * step,
            activation_bytes_per_microbatch=(None if bytes_per_microbatch is None else
                                             {s: bytes_per_microbatch[s] for s in local}),
            step=step, buffer_limit=buffer_limit, num_stages=hint.num_stages,
            n_microbatches=hint.n_microbatches, placement=hint.layout,
            spans=result.spans[rank], sends=sends[rank], arrivals=arrivals[rank]))
    return stats


def write_run(folder, hint_name: str = "1F1B", *, ranks: int = 4, stages_per_rank: int = 1,
              microbatches: int = 8, workload: str = "spikes", steps: int = 6,
              unit_s: float = 0.01, **kwargs) -> Hint:
    """A run folder of ``steps`` step traces (step1.json ...), each step drawn from
    ``workload`` (its time unit ``unit_s`` seconds); returns the hint."""
    hint = build_hint(hint_name, num_ranks=ranks, num_stages=ranks * stages_per_rank,
                      n_microbatches=microbatches)
    os.makedirs(folder, exist_ok=True)
    for step in range(steps):
        drawn = make_timing(workload, hint.num_stages, microbatches, seed=step)
        timing = Timing(*[[[v * unit_s for v in row] for row in table] for table in (
            drawn.forward, drawn.backward_input, drawn.backward_weight,
            drawn.activation_latency, drawn.gradient_latency)])
        write_chrome_trace(simulated_step_stats(hint, timing, step, **kwargs),
                           os.path.join(folder, f"step{step + 1}.json"))
    return hint
