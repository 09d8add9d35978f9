"""The best any schedule can do on known timings: an offline optimum over per-rank orders.

A CP-SAT model (``pip install -e '.[opt]'``: OR-Tools) with full knowledge of every
duration and latency: one interval per action on its rank's device (no two overlap), the
step's dependencies and link latencies, each stage's streams in hint order (what keeps
RRFP's results bitwise), and the memory limits as cumulative constraints: a microbatch is
held on its stage from its forward's start to its last backward piece's end, per stage and
per rank. It minimizes the makespan. Within the time limit the answer is proven optimal or
the best found (``Optimum.proven``); the better of the fixed schedule and readiness-first
is its starting solution, and the memory-aware lower bound its floor.
No online policy can beat it: it is the yardstick of what a policy captures.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from rrfp.core.actions import _Action
from rrfp.core.graph import Latency, step_graph
from rrfp.core.hints import Hint
from rrfp.core.limits import MemoryLimits
from rrfp.sim.engine import lower_bounds, simulate

SCALE = 1000
"""Time units per simulated unit (CP-SAT works on integers)."""


@dataclass(frozen=True)
class Optimum:
    makespan: float
    proven: bool
    """Whether CP-SAT proved it optimal (else: the best found in the time limit)."""
    orders: dict[int, list[_Action]]
    """Per rank, the actions in the order of the best schedule found."""


def optimum(hint: Hint, duration: Callable[[_Action], float], latency: Latency | None,
            limits: MemoryLimits, *, time_limit_s: float = 30.0, workers: int = 2) -> Optimum:
    """The best makespan over all schedules that RRFP could run within ``limits``."""
    from ortools.sat.python import cp_model

    def ticks(seconds: float) -> int:
        return int(round(seconds * SCALE))

    lat = latency or (lambda edge, mb: 0.0)
    graph = step_graph(hint, lambda edge, mb: ticks(lat(edge, mb)), stream_order=True)
    # Feasible starting solutions, in ticks: the fixed schedule and the greedy policies
    # within the limits (depth 1, so each release has ended before the next decision;
    # critical on its default costs): the search starts from the best of them, so what it
    # finds is never worse than those policies.
    in_ticks = dict(duration=lambda a: ticks(duration(a)), latency=lambda e, m: ticks(lat(e, m)))
    start_from = min((simulate(hint, **in_ticks, policy="fixed"),
                      *(simulate(hint, **in_ticks, policy=policy, limits=limits, launch_depth=1)
                        for policy in ("hint", "arrival", "critical"))),
                     key=lambda result: result.makespan)
    horizon = int(start_from.makespan) + 1
    bound = lower_bounds(hint, in_ticks["duration"], in_ticks["latency"], limits).tighter
    model = cp_model.CpModel()

    start, end, interval = {}, {}, {}
    for a in graph.actions:
        d = ticks(duration(a))
        start[a] = model.NewIntVar(0, horizon, f"s{a}")
        end[a] = model.NewIntVar(0, horizon, f"e{a}")
        interval[a] = model.NewIntervalVar(start[a], d, end[a], f"i{a}")
    for a, preds in graph.predecessors.items():
        for p, delay in preds:
            model.Add(start[a] >= end[p] + int(delay))
    for rank, acts in hint.orders.items():
        model.AddNoOverlap([interval[a] for a in acts if a in interval])

    held = {}
    for a in graph.actions:
        if a.computation_type.value != "F":
            continue
        release = hint.plan.release_of(a.stage_index, a.microbatch_index)
        size = model.NewIntVar(0, horizon, f"held{a}")
        held[a] = model.NewIntervalVar(start[a], size, end[release], f"h{a}")
    for s, cap in limits.per_stage.items():
        mine = [h for a, h in held.items() if a.stage_index == s]
        model.AddCumulative(mine, [1] * len(mine), cap)
    for rank, cap in limits.per_rank.items():
        stages = set(hint.stages_on(rank))
        if len(stages) > 1:
            mine = [h for a, h in held.items() if a.stage_index in stages]
            model.AddCumulative(mine, [1] * len(mine), cap)

    makespan = model.NewIntVar(int(bound), horizon, "makespan")
    model.AddMaxEquality(makespan, list(end.values()))
    model.Minimize(makespan)
    for rank, spans in start_from.spans.items():
        for span in spans:
            action = _Action.from_str(span.name)
            if action in start:
                model.AddHint(start[action], int(span.start))

    solver = cp_model.CpSolver()
    solver.parameters.max_time_in_seconds = time_limit_s
    solver.parameters.num_workers = workers
    status = solver.Solve(model)
    if status == cp_model.INFEASIBLE or status == cp_model.MODEL_INVALID:
        raise RuntimeError(f"CP-SAT found no schedule ({solver.StatusName(status)})")
    if status != cp_model.OPTIMAL and status != cp_model.FEASIBLE:
        # Out of time before completing a schedule (a loaded machine): the feasible one it
        # started from is the best known.
        return Optimum(start_from.makespan / SCALE, False, start_from.realized)
    orders = {rank: sorted((a for a in acts if a in start), key=lambda a: solver.Value(start[a]))
              for rank, acts in hint.orders.items()}
    return Optimum(solver.Value(makespan) / SCALE, status == cp_model.OPTIMAL, orders)
