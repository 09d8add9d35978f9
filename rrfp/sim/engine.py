"""Discrete-event simulation of one training step, driving the runtime's own Arbiter.

Each rank runs one action at a time (non-preemptive compute); messages arrive after a
per-message latency. The fixed schedule is the same arbiter with the ``"fixed"`` policy,
so fixed and readiness-first runs differ only in the policy.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from rrfp.arbiter import Arbiter
from rrfp.hints import _Action, Edge, Hint
from rrfp.policy import make_policy
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
) -> SimResult:
    """Simulate one step of ``hint`` under ``policy`` ("fixed" is the fixed schedule)."""
    arbiters = {
        r: Arbiter(hint, r, limits=limits, policy=make_policy(policy))
        for r in range(hint.num_ranks)
    }
    events: list[tuple[float, int, int, object]] = []  # (time, seq, rank, payload)
    seq = 0
    running: dict[int, tuple[float, _Action] | None] = {r: None for r in arbiters}
    spans: dict[int, list[Span]] = {r: [] for r in arbiters}
    busy = {r: 0.0 for r in arbiters}
    now = 0.0

    def push(time: float, rank: int, payload: object) -> None:
        nonlocal seq
        heapq.heappush(events, (time, seq, rank, payload))
        seq += 1

    def dispatch_free_ranks() -> None:
        for rank, arbiter in arbiters.items():
            if running[rank] is None and not arbiter.finished:
                action = arbiter.choose()
                if action is not None:
                    running[rank] = (now, action)
                    push(now + duration(action), rank, action)

    dispatch_free_ranks()
    while events:
        now = events[0][0]
        # Apply everything that happens at this instant before any rank decides.
        while events and events[0][0] == now:
            _, _, rank, payload = heapq.heappop(events)
            if isinstance(payload, _Action):
                start, action = running[rank]  # type: ignore[misc]
                running[rank] = None
                arbiter = arbiters[rank]
                arbiter.complete(action)
                busy[rank] += now - start
                spans[rank].append(Span(str(action), start, now, action.stage_index,
                                        action.computation_type.value, action.microbatch_index))
                for edge in arbiter.messages_sent_by(action):
                    mb = action.microbatch_index
                    delay = latency(edge, mb) if latency is not None else 0.0
                    push(now + delay, hint.stage_to_rank[edge.dst], (edge, mb))
            else:
                edge, mb = payload  # type: ignore[misc]
                arbiters[rank].deliver(edge, mb)
        dispatch_free_ranks()

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
    )
