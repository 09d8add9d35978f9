"""Discrete-event simulation of one training step, driving the runtime's own Arbiter.

Each rank runs one action at a time (non-preemptive compute); messages arrive after a
per-message latency. The fixed schedule is the same arbiter with the ``"fixed"`` policy,
so fixed and readiness-first runs differ only in the policy.
"""

from __future__ import annotations

import copy
import heapq
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from rrfp.arbiter import Arbiter
from rrfp.hints import _Action, B, Edge, F, Hint, I, W
from rrfp.policy import History, make_policy
from rrfp.stats import Span

Duration = Callable[[_Action], float]
"""Seconds (or any time unit) the compute of an action takes."""
Latency = Callable[[Edge, int], float]
"""Time from a send on ``edge`` for a microbatch until its arrival."""


@dataclass
class SimResult:
    makespan: float
    busy: dict[int, float]
    """Per rank: time spent computing."""
    spans: dict[int, list[Span]] = field(repr=False)
    realized: dict[int, list[_Action]] = field(repr=False)
    peak_in_flight: dict[int, int]
    """Per stage: realized peak of forwards minus backwards."""
    out_of_order: dict[int, int]
    histories: dict[int, History] = field(repr=False)
    """Per rank: what this step teaches the next (for the lookahead policy)."""

    @property
    def idle(self) -> dict[int, float]:
        """Per rank: time not computing before the step ends."""
        return {r: self.makespan - b for r, b in self.busy.items()}


class SimulationDeadlock(RuntimeError):
    pass


def simulate(
    hint: Hint,
    duration: Duration,
    *,
    latency: Latency | None = None,
    policy: str = "hint",
    limits: Mapping[int, int] | None = None,
    histories: Mapping[int, History] | None = None,
) -> SimResult:
    """Simulate one step of ``hint`` under ``policy`` ("fixed" is the fixed schedule).

    ``histories``: per rank, what earlier steps showed (``SimResult.histories`` of the
    previous step), for the ``"lookahead"`` policy.
    """
    now = 0.0
    previous = histories or {}
    arbiters = {
        r: Arbiter(hint, r, limits=limits,
                   policy=make_policy(policy, history=previous.get(r), clock=lambda: now))
        for r in range(hint.num_ranks)
    }
    learned = {r: copy.deepcopy(previous[r]) if r in previous else History()
               for r in arbiters}
    for history in learned.values():
        history.start_step()
    events: list[tuple[float, int, int, object]] = []  # (time, seq, rank, payload)
    seq = 0
    running: dict[int, tuple[float, _Action] | None] = {r: None for r in arbiters}
    spans: dict[int, list[Span]] = {r: [] for r in arbiters}
    busy = {r: 0.0 for r in arbiters}

    def push(time: float, rank: int, payload: object) -> None:
        nonlocal seq
        heapq.heappush(events, (time, seq, rank, payload))
        seq += 1

    def dispatch(ranks) -> None:
        for rank in ranks:
            arbiter = arbiters[rank]
            if running[rank] is None and not arbiter.finished:
                action = arbiter.choose()
                if action is not None:
                    running[rank] = (now, action)
                    push(now + duration(action), rank, action)

    # A rank's choice changes only when something happens to it (policies decide from
    # state and the clock, and waiting longer never makes a declined action acceptable).
    dispatch(arbiters)
    while events:
        now = events[0][0]
        touched = set()
        # Apply everything that happens at this instant before any rank decides.
        while events and events[0][0] == now:
            _, _, rank, payload = heapq.heappop(events)
            touched.add(rank)
            if isinstance(payload, _Action):
                start, action = running[rank]  # type: ignore[misc]
                running[rank] = None
                arbiter = arbiters[rank]
                arbiter.complete(action)
                busy[rank] += now - start
                spans[rank].append(Span(str(action), start, now, action.stage_index,
                                        action.computation_type.value, action.microbatch_index))
                learned[rank].record_duration(action.stage_index,
                                              action.computation_type.value, now - start)
                for edge in arbiter.messages_sent_by(action):
                    mb = action.microbatch_index
                    delay = latency(edge, mb) if latency is not None else 0.0
                    push(now + delay, hint.stage_to_rank[edge.dst], (edge, mb))
            else:
                edge, mb = payload  # type: ignore[misc]
                arbiters[rank].deliver(edge, mb, at=now)
                learned[rank].record_arrival(edge, mb, now)
        dispatch(sorted(touched))

    stuck = {r: a.waits() for r, a in arbiters.items() if not a.finished}
    if stuck:
        raise SimulationDeadlock(
            "; ".join(f"rank {r}: {', '.join(map(str, w[:2]))}" for r, w in stuck.items())
        )
    peak: dict[int, int] = {}
    for arbiter in arbiters.values():
        peak.update(arbiter.peak_in_flight)
    return SimResult(
        makespan=now,
        busy=busy,
        spans=spans,
        realized={r: a.realized for r, a in arbiters.items()},
        peak_in_flight=dict(sorted(peak.items())),
        out_of_order={r: a.out_of_order for r, a in arbiters.items()},
        histories=learned,
    )


@dataclass(frozen=True)
class LowerBounds:
    critical_path: float
    """Longest dependency chain of any microbatch (unlimited ranks, no queueing)."""
    busiest_rank: float
    """Max over ranks of: earliest possible start + all its work + shortest possible tail."""

    @property
    def tighter(self) -> float:
        return max(self.critical_path, self.busiest_rank)


def lower_bounds(hint: Hint, duration: Duration, latency: Latency | None = None) -> LowerBounds:
    """Two makespan lower bounds that hold for any schedule of ``hint``'s actions."""
    lat = latency or (lambda edge, mb: 0.0)
    rank_of = hint.stage_to_rank
    actions = [a for acts in hint.orders.values() for a in acts if a.computation_type in (F, B, I, W)]
    present = set(actions)

    def edge_delay(src: int, dst: int, mb: int) -> float:
        return 0.0 if rank_of[src] == rank_of[dst] else lat(Edge(src, dst), mb)

    def grad_action(s: int, mb: int) -> _Action:
        full = _Action(s, B, mb)
        return full if full in present else _Action(s, I, mb)

    def predecessors(a: _Action) -> list[tuple[_Action, float]]:
        s, m, ctype = a.stage_index, a.microbatch_index, a.computation_type
        if ctype == F:
            return [(_Action(s - 1, F, m), edge_delay(s - 1, s, m))] if s > 0 else []
        if ctype == W:
            return [(_Action(s, I, m), 0.0)]
        preds = [(_Action(s, F, m), 0.0)]
        if s < hint.num_stages - 1:
            preds.append((grad_action(s + 1, m), edge_delay(s + 1, s, m)))
        return preds

    successors: dict[_Action, list[tuple[_Action, float]]] = {a: [] for a in actions}
    for a in actions:
        for p, delay in predecessors(a):
            successors[p].append((a, delay))

    # Per microbatch the DAG is a chain: forwards up the stages, backwards down, each W
    # hanging off its I. This order is topological.
    def topological_key(a: _Action) -> tuple[int, int]:
        ctype = a.computation_type
        return (0, a.stage_index) if ctype == F else (2, a.stage_index) if ctype == W \
            else (1, -a.stage_index)

    order = sorted(actions, key=topological_key)
    head: dict[_Action, float] = {}
    for a in order:
        head[a] = max((head[p] + duration(p) + d for p, d in predecessors(a)), default=0.0)
    tail: dict[_Action, float] = {}
    for a in reversed(order):
        tail[a] = max((d + duration(c) + tail[c] for c, d in successors[a]), default=0.0)
    critical = max(head[a] + duration(a) + tail[a] for a in actions)
    busiest = 0.0
    for acts in hint.orders.values():
        compute = [a for a in acts if a.computation_type in (F, B, I, W)]
        busiest = max(busiest, min(head[a] for a in compute) + sum(map(duration, compute))
                      + min(tail[a] for a in compute))
    return LowerBounds(critical, busiest)
