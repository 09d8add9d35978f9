"""Fixed schedule vs RRFP on the same simulated step, and sweeps over memory limits."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

from rrfp.core.hints import Hint
from rrfp.core.limits import MemoryLimits, resolve_buffer_limits
from rrfp.core.policy import policy_for
from rrfp.core.settings import DEFAULT_LAUNCH_DEPTH
from rrfp.sim.engine import lower_bounds, LowerBounds, simulate, SimResult
from rrfp.sim.workloads import make_timing, Timing, WorkloadParams

#: The buffer limits the sweeps and the results page compare.
SWEEP_LIMITS = ("hint", "hint+1", "hint+2", "2x hint", 32)
#: Seed offset of the earlier steps that teach the lookahead and critical policies.
_WARMUP_SEED = 100_003
#: Policies that learn from earlier steps.
LEARNING_POLICIES = {"lookahead", "critical"}


@dataclass(frozen=True)
class Comparison:
    seed: int
    policy: str
    limits: MemoryLimits
    fixed: SimResult
    rrfp: SimResult
    bounds: LowerBounds

    @property
    def memory_ratio(self) -> float:
        """Activations held by the busiest rank under RRFP over the fixed schedule's busiest
        rank (each rank: the most its stages hold together at any moment)."""
        return max(self.rrfp.rank_peaks.values()) / max(self.fixed.rank_peaks.values())

    @property
    def worst_rank_memory_ratio(self) -> float:
        """The largest ratio of a rank's peak under RRFP to the same rank's under the fixed
        schedule."""
        return max(self.rrfp.rank_peaks[r] / self.fixed.rank_peaks[r] for r in self.rrfp.rank_peaks)

    @property
    def speedup(self) -> float:
        return self.fixed.makespan / self.rrfp.makespan


def timing_for(hint: Hint, workload: str | Timing, seed: int,
               params: WorkloadParams = WorkloadParams()) -> Timing:
    if isinstance(workload, Timing):
        if (workload.num_stages, workload.n_microbatches) != (hint.num_stages, hint.n_microbatches):
            raise ValueError(
                f"replayed timings are for {workload.num_stages} stages x "
                f"{workload.n_microbatches} microbatches, the hint has {hint.num_stages} x "
                f"{hint.n_microbatches}")
        return workload
    return make_timing(workload, hint.num_stages, hint.n_microbatches, seed, params)


def compare(hint: Hint, workload: str | Timing, seed: int, *, limit: str | int = "hint",
            policy: str | None = None, params: WorkloadParams = WorkloadParams(),
            launch_depth: float = DEFAULT_LAUNCH_DEPTH, launch_cost: float = 0.0,
            reorder_ahead: bool = False, sizes_known: bool = False) -> Comparison:
    """Simulate the step drawn with ``seed`` under the fixed schedule and under RRFP.

    ``policy=None`` picks what ScheduleRRFP would; ``limit`` is refused with
    ``ValueError`` where ScheduleRRFP refuses it (for ``policy="fixed"``, below the hint's
    peaks). The policies that learn from earlier steps (lookahead, critical) first run two
    (other seeds of the same workload), as they would at run time: the same policy, from
    an empty history.
    ``launch_depth``, ``launch_cost`` (in forwards) and ``reorder_ahead`` (see
    ``StepLoop``) apply to RRFP; the fixed schedule
    pays the same launch cost but never waits to decide, so its CPU runs ahead of its
    device without bound, as torch's schedules do on CUDA. ``sizes_known``: RRFP's ranks
    are told each step's microbatch sizes (``Timing.sizes``, the warm-up steps' too), as
    ``ScheduleRRFP`` is where the caller gives them; a workload without sizes runs as
    without.
    """
    limits = resolve_buffer_limits(limit, hint, fixed_order=policy == "fixed")
    policy = policy_for(policy, hint, limits)
    timing = timing_for(hint, workload, seed, params)
    fixed = simulate(hint, timing.duration, latency=timing.latency, policy="fixed",
                     launch_depth=math.inf, launch_cost=launch_cost)
    launch = dict(launch_depth=launch_depth, launch_cost=launch_cost,
                  reorder_ahead=reorder_ahead)
    histories = None
    if policy in LEARNING_POLICIES:
        # The first step runs the policy itself, as ScheduleRRFP's does: without history
        # lookahead follows the hint and critical costs actions by default durations. (A
        # fixed-order first step would stall below the hint's peaks, where the runtime
        # refuses the fixed order.)
        for k in (1, 2):
            warm = timing_for(hint, workload, seed + k * _WARMUP_SEED, params)
            histories = simulate(hint, warm.duration, latency=warm.latency, policy=policy,
                                 limits=limits, histories=histories,
                                 sizes=warm.sizes if sizes_known else None, **launch).histories
    rrfp = simulate(hint, timing.duration, latency=timing.latency, policy=policy,
                    limits=limits, histories=histories,
                    sizes=timing.sizes if sizes_known else None, **launch)
    return Comparison(seed, policy, limits, fixed, rrfp,
                      lower_bounds(hint, timing.duration, timing.latency, limits))


def sweep_limits(hint: Hint, workload: str | Timing, seeds: int, *, policy: str | None = None,
                 params: WorkloadParams = WorkloadParams(), limits=SWEEP_LIMITS,
                 sizes_known: bool = False) -> Mapping[str, list[Comparison]]:
    """Comparisons for each buffer limit (label -> one per seed)."""
    return {str(limit): [compare(hint, workload, seed, limit=limit, policy=policy, params=params,
                                 sizes_known=sizes_known)
                         for seed in range(seeds)]
            for limit in limits}
