"""Fixed schedule vs RRFP on the same simulated step, and sweeps over memory limits."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from rrfp.arbiter import resolve_buffer_limits
from rrfp.hints import Hint
from rrfp.policy import default_policy
from rrfp.sim.engine import lower_bounds, LowerBounds, simulate, SimResult
from rrfp.sim.workloads import make_timing, Timing, WorkloadParams

#: The buffer limits the sweeps and the results page compare.
SWEEP_LIMITS = ("hint", "hint+1", "hint+2", "2x hint", 32)
#: Seed offset of the earlier steps that teach the lookahead policy.
_WARMUP_SEED = 100_003


@dataclass(frozen=True)
class Comparison:
    seed: int
    policy: str
    limits: dict[int, int]
    fixed: SimResult
    rrfp: SimResult
    bounds: LowerBounds
    memory_ratio: float
    """Activation memory of the most loaded rank under RRFP over the fixed schedule's
    (each rank counted as the sum of its stages' peak in-flight forwards)."""

    @property
    def speedup(self) -> float:
        return self.fixed.makespan / self.rrfp.makespan


def resolve_limit(limit: str | int, hint: Hint) -> dict[int, int]:
    """Like ``resolve_buffer_limits``, plus ``"2x hint"``."""
    if limit == "2x hint":
        return {s: 2 * peak for s, peak in hint.peak_in_flight().items()}
    return resolve_buffer_limits(limit, hint)


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
            policy: str | None = None, params: WorkloadParams = WorkloadParams()) -> Comparison:
    """Simulate the step drawn with ``seed`` under the fixed schedule and under RRFP.

    ``policy=None`` picks what ScheduleRRFP would. The lookahead policy first learns
    from two earlier steps (other seeds of the same workload), as it would at run time.
    """
    limits = resolve_limit(limit, hint)
    policy = policy or default_policy(hint.policy, limits == hint.peak_in_flight())
    timing = timing_for(hint, workload, seed, params)
    fixed = simulate(hint, timing.duration, latency=timing.latency, policy="fixed")
    histories = None
    if policy == "lookahead":
        for k, warm_policy in ((1, "fixed"), (2, policy)):
            warm = timing_for(hint, workload, seed + k * _WARMUP_SEED, params)
            histories = simulate(hint, warm.duration, latency=warm.latency, policy=warm_policy,
                                 limits=limits, histories=histories).histories
    rrfp = simulate(hint, timing.duration, latency=timing.latency, policy=policy,
                    limits=limits, histories=histories)
    return Comparison(seed, policy, limits, fixed, rrfp,
                      lower_bounds(hint, timing.duration, timing.latency),
                      _busiest_rank_memory(hint, rrfp) / _busiest_rank_memory(hint, fixed))


def _busiest_rank_memory(hint: Hint, result: SimResult) -> int:
    return max(sum(result.peak_in_flight[s] for s in hint.stages_on(r))
               for r in range(hint.num_ranks))


def sweep_limits(hint: Hint, workload: str | Timing, seeds: int, *, policy: str | None = None,
                 params: WorkloadParams = WorkloadParams(),
                 limits=SWEEP_LIMITS) -> Mapping[str, list[Comparison]]:
    """Comparisons for each buffer limit (label -> one per seed)."""
    return {str(limit): [compare(hint, workload, seed, limit=limit, policy=policy, params=params)
                         for seed in range(seeds)]
            for limit in limits}
