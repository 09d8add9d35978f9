"""Discrete-event simulation of one training step, driving the runtime's own step loop.

Each rank runs ``rrfp.loop.StepLoop`` (the very loop ``ScheduleRRFP`` runs) on a simulated
device: launched actions run one at a time in launch order for their durations; a launch
may cost CPU time (``launch_cost``), during which the rank decides nothing; messages
arrive after a per-message latency. The fixed schedule is the same loop with the
``"fixed"`` policy, so fixed and readiness-first runs differ only in the policy.
"""

from __future__ import annotations

import copy
import heapq
import math
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field

from rrfp.arbiter import Arbiter
from rrfp.hints import _Action, B, Edge, F, Hint, I, W
from rrfp.loop import Arrival, Completion, StepLoop
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
    """Per rank: time its device spent computing."""
    spans: dict[int, list[Span]] = field(repr=False)
    realized: dict[int, list[_Action]] = field(repr=False)
    peak_in_flight: dict[int, int]
    """Per stage: realized peak of forwards minus backwards."""
    out_of_order: dict[int, int]
    histories: dict[int, History] = field(repr=False)
    """Per rank: what this step teaches the next (for the lookahead policy)."""

    @property
    def idle(self) -> dict[int, float]:
        """Per rank: time its device did not compute before the step ends."""
        return {r: self.makespan - b for r, b in self.busy.items()}


class SimulationDeadlock(RuntimeError):
    pass


class _Simulation:
    """The event queue and the simulated ranks' devices, messages and CPU clocks."""

    def __init__(self, hint: Hint, duration: Duration, latency: Latency | None,
                 launch_cost: float):
        self.hint, self.duration, self.latency = hint, duration, latency
        self.launch_cost = launch_cost
        self.now = 0.0
        self._events: list[tuple[float, int, int, object]] = []  # (time, seq, rank, payload)
        self._seq = 0
        self.cpu_free = {r: 0.0 for r in range(hint.num_ranks)}
        self.devices = {r: _SimDevice(self, r) for r in range(hint.num_ranks)}
        self.inbox: dict[int, list[Arrival]] = {r: [] for r in range(hint.num_ranks)}

    def push(self, time: float, rank: int, payload: object) -> None:
        heapq.heappush(self._events, (time, self._seq, rank, payload))
        self._seq += 1

    def clock(self, rank: int) -> Callable[[], float]:
        return lambda: max(self.now, self.cpu_free[rank])

    def arrivals(self, rank: int) -> Callable[[], list[Arrival]]:
        def take() -> list[Arrival]:
            arrived, self.inbox[rank] = self.inbox[rank], []
            return arrived
        return take

    def work(self, action: _Action, sends: list[Edge]) -> Callable[[], None]:
        """Run at the action's end: its messages leave then."""
        def send() -> None:
            for edge in sends:
                mb = action.microbatch_index
                delay = self.latency(edge, mb) if self.latency is not None else 0.0
                self.push(self.now + delay, self.hint.stage_to_rank[edge.dst], (edge, mb))
        return send

    def run(self, loops: Mapping[int, StepLoop]) -> None:
        steps: dict[int, Iterator[float]] = {r: loop.run() for r, loop in loops.items()}

        def resume(rank: int) -> None:
            try:
                next(steps[rank])
            except StopIteration:
                del steps[rank]
                return
            if self.cpu_free[rank] > self.now:  # still launching: it sees events after
                self.push(self.cpu_free[rank], rank, None)

        for rank in sorted(steps):
            resume(rank)
        while self._events:
            self.now = self._events[0][0]
            touched = set()
            # Apply everything that happens at this instant before any rank decides.
            while self._events and self._events[0][0] == self.now:
                _, _, rank, payload = heapq.heappop(self._events)
                touched.add(rank)
                if isinstance(payload, _Completing):
                    self.devices[rank].finish(payload)
                elif payload is not None:
                    edge, mb = payload  # type: ignore[misc]
                    self.inbox[rank].append(Arrival(edge, mb, self.now))
            for rank in sorted(touched):
                if rank in steps and self.cpu_free[rank] <= self.now:
                    resume(rank)
        if steps:
            raise SimulationDeadlock("; ".join(
                f"rank {r}: {', '.join(map(str, loops[r].arbiter.waits()[:2]))}"
                for r in sorted(steps)))


@dataclass(frozen=True)
class _Completing:
    action: _Action
    start: float
    end: float
    work: Callable[[], None]


class _SimDevice:
    """One rank's device in simulated time (the ``rrfp.loop.Device`` interface)."""

    def __init__(self, sim: _Simulation, rank: int):
        self._sim, self._rank = sim, rank
        self.outstanding = 0
        self.free_at = 0.0
        self._done: list[Completion] = []

    def launch(self, action: _Action, work: Callable[[], None]) -> None:
        sim = self._sim
        launched = max(sim.now, sim.cpu_free[self._rank]) + sim.launch_cost
        sim.cpu_free[self._rank] = launched
        start = max(self.free_at, launched)
        self.free_at = start + sim.duration(action)
        self.outstanding += 1
        sim.push(self.free_at, self._rank, _Completing(action, start, self.free_at, work))

    def finish(self, completing: _Completing) -> None:
        completing.work()
        self._done.append(Completion(completing.action, completing.start, completing.end))

    def completed(self) -> list[Completion]:
        done, self._done = self._done, []
        self.outstanding -= len(done)
        return done


def simulate(
    hint: Hint,
    duration: Duration,
    *,
    latency: Latency | None = None,
    policy: str = "hint",
    limits: Mapping[int, int] | None = None,
    histories: Mapping[int, History] | None = None,
    launch_depth: float = 1,
    launch_cost: float = 0.0,
) -> SimResult:
    """Simulate one step of ``hint`` under ``policy`` ("fixed" is the fixed schedule).

    ``histories``: per rank, what earlier steps showed (``SimResult.histories`` of the
    previous step), for the ``"lookahead"`` policy. ``launch_depth``: actions a device may
    hold launched but incomplete (``math.inf``: no bound); ``launch_cost``: CPU time of
    each launch, in the unit of ``duration``.
    """
    sim = _Simulation(hint, duration, latency, launch_cost)
    previous = histories or {}
    loops = {
        r: StepLoop(
            Arbiter(hint, r, limits=limits,
                    policy=make_policy(policy, history=previous.get(r), clock=sim.clock(r))),
            sim.devices[r], sim, sim.arrivals(r), sim.clock(r), launch_depth=launch_depth)
        for r in range(hint.num_ranks)
    }
    sim.run(loops)
    learned = {r: copy.deepcopy(previous[r]) if r in previous else History() for r in loops}
    for r, loop in loops.items():
        loop.teach(learned[r])
    peak: dict[int, int] = {}
    for loop in loops.values():
        peak.update(loop.arbiter.peak_in_flight)
    return SimResult(
        makespan=max((c.end for loop in loops.values() for c in loop.completions), default=0.0),
        busy={r: loop.busy_time for r, loop in loops.items()},
        spans={r: [Span(str(c.action), c.start, c.end, c.action.stage_index,
                        c.action.computation_type.value, c.action.microbatch_index)
                   for c in loop.completions] for r, loop in loops.items()},
        realized={r: loop.arbiter.realized for r, loop in loops.items()},
        peak_in_flight=dict(sorted(peak.items())),
        out_of_order={r: loop.arbiter.out_of_order for r, loop in loops.items()},
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
