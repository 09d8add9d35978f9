"""Discrete-event simulation of one training step, driving the runtime's own step loop.

Each rank runs ``rrfp.core.loop.StepLoop`` (the very loop ``ScheduleRRFP`` runs) on a simulated
device: launched actions run one at a time in launch order for their durations; a launch
may cost CPU time (``launch_cost``), during which the rank decides nothing; messages
arrive after a per-message latency. The fixed schedule is the same loop with the
``"fixed"`` policy, so fixed and readiness-first runs differ only in the policy.
"""

from __future__ import annotations

import copy
import functools
import heapq
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field

from rrfp.core.actions import _Action, Edge, F
from rrfp.core.arbiter import Arbiter
from rrfp.core.graph import step_graph
from rrfp.core.hints import Hint
from rrfp.core.history import History
from rrfp.core.limits import MemoryLimits
from rrfp.core.plan import Node
from rrfp.core.loop import Arrival, Completion, StepLoop
from rrfp.core.policy import make_policy, Policy
from rrfp.core.settings import DEFAULT_LAUNCH_DEPTH, policy_names
from rrfp.core.sizes import StepSizes
from rrfp.core.stats import Span
from rrfp.sim.foresight import (ClairvoyantFit, EstimatedChains, EstimatedCritical,
                                FORESIGHT_CRITICAL, foresight_chains, INFORMED_CRITICAL,
                                informed_chains, InformedFit, median_transit, Transit)

SIM_POLICIES = (*policy_names(), ClairvoyantFit.name, InformedFit.name, FORESIGHT_CRITICAL,
                INFORMED_CRITICAL)
"""What ``simulate`` runs: the runtime's policies, those registered when the simulator
is imported (the studied ones of ``rrfp.sim.policies`` among them) and the simulator-only
yardsticks."""
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
    """Per stage: realized peak of microbatches held (F until its last backward piece)."""
    rank_peaks: dict[int, int]
    """Per rank: realized peak of microbatches its stages hold together (the maximum over
    time of their sum)."""
    out_of_order: dict[int, int]
    most_behind: dict[int, int]
    """Per rank: most launched actions not yet reported complete that a launch found (the
    step loop keeps it below ``launch_depth``)."""
    histories: dict[int, History] = field(repr=False)
    """Per rank: what this step teaches the next (for the lookahead and critical policies)."""

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
        self.delivered: dict[tuple[Edge, int], float] = {}
        """Messages delivered: when each arrived."""
        self.ends: dict[_Action, float] = {}
        """When each launched action ends (fixed at its launch)."""
        self.forwards_ran: dict[_Action, float] = {}
        """How long each forward that has ended ran."""
        self._chains: dict[str, EstimatedChains] = {}

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

    def earliest_arrival(self, message: tuple[Edge, int], transit: Transit | None = None) -> float:
        """When ``message`` arrives if it is here. If not, when ``transit`` (default: its
        true latency, which makes the time of a message in flight exact) has it arrive once
        sent at its sender's end: known once the sender is launched; before that a lower
        bound, the chain of data dependencies behind the sender from actions launched and
        messages here, with nothing not yet launched starting before now and every message
        on the way arriving as ``transit`` says. It leaves out each rank's other work, the
        hint's stream order, memory limits and launch costs. Sees what no rank can: for
        the simulator's yardsticks only."""
        if message in self.delivered:
            return self.delivered[message]
        transit = transit or self.true_transit
        plan, ends, rank_of = self.hint.plan, self.ends, self.hint.stage_to_rank

        def arrival(sender: _Action, edge: Edge) -> float:
            sent = (edge, sender.microbatch_index)
            if sent in self.delivered:
                return self.delivered[sent]
            return transit(sent, earliest_end(sender))

        @functools.cache
        def earliest_end(action: _Action) -> float:
            if action in ends:
                return ends[action]
            rank_plan = plan.ranks[rank_of[action.stage_index]]
            node = rank_plan.node(action)
            inputs = [earliest_end(rank_plan.nodes[d].action) for d in node.deps]
            if node.message is not None:
                inputs.append(arrival(plan.sender(*node.message), node.message[0]))
            return max([self.now, *inputs]) + self.duration(action)

        edge, mb = message
        return arrival(self.hint.plan.sender(edge, mb), edge)

    def true_transit(self, message: tuple[Edge, int], sent_at: float) -> float:
        """When ``message``, sent at ``sent_at``, arrives."""
        return sent_at + (self.latency(*message) if self.latency is not None else 0.0)

    def latency_draws(self) -> list[float]:
        """The latency of every message between ranks in the step (for the informed
        yardstick, which does not know which message has which)."""
        return [self.latency(edge, mb) if self.latency is not None else 0.0
                for edge in self.hint.plan.remote_edges for mb in self.hint.plan.message_order(edge)]

    def work(self, node: Node) -> Callable[[], None]:
        """Run at the action's end: its messages leave then."""
        def send() -> None:
            for edge in node.sends:
                message = (edge, node.microbatch)
                self.push(self.true_transit(message, self.now),
                          self.hint.stage_to_rank[edge.dst], message)
        return send

    def completed(self, action: _Action) -> None:
        """Nothing to free in simulated time."""

    def chains(self, yardstick: str) -> EstimatedChains:
        """The chains ``yardstick`` (FORESIGHT_CRITICAL or INFORMED_CRITICAL) ranks by,
        one for every rank of the step."""
        if yardstick not in self._chains:
            self._chains[yardstick] = (foresight_chains(self.duration, self.latency)
                                       if yardstick == FORESIGHT_CRITICAL
                                       else informed_chains(self.forwards_ran))
        return self._chains[yardstick]

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
                    if payload.action.computation_type == F:
                        self.forwards_ran[payload.action] = payload.end - payload.start
                    self.devices[rank].finish(payload)
                elif payload is not None:
                    edge, mb = payload  # type: ignore[misc]
                    self.delivered[(edge, mb)] = self.now
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
    """One rank's device in simulated time (the ``rrfp.core.loop.Device`` interface)."""

    def __init__(self, sim: _Simulation, rank: int):
        self._sim, self._rank = sim, rank
        self.outstanding = 0
        self.most_behind = 0
        self.free_at = 0.0
        self._done: list[Completion] = []

    def launch(self, action: _Action, work: Callable[[], None]) -> None:
        sim = self._sim
        launched = max(sim.now, sim.cpu_free[self._rank]) + sim.launch_cost
        sim.cpu_free[self._rank] = launched
        start = max(self.free_at, launched)
        self.free_at = sim.ends[action] = start + sim.duration(action)
        self.most_behind = max(self.most_behind, self.outstanding)
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
    policy: str | Mapping[int, str] = "hint",
    limits: MemoryLimits | None = None,
    histories: Mapping[int, History] | None = None,
    launch_depth: float = DEFAULT_LAUNCH_DEPTH,
    launch_cost: float = 0.0,
    reorder_ahead: bool = False,
    sizes: StepSizes | None = None,
) -> SimResult:
    """Simulate one step of ``hint`` under ``policy`` ("fixed" is the fixed schedule), one
    name for every rank or a name per rank (as ``rrfp.core.policy.default_policy`` picks them).

    ``histories``: per rank, what earlier steps showed (``SimResult.histories`` of the
    previous step), for the ``"lookahead"`` and ``"critical"`` policies. ``policy`` may
    also be ``"clairvoyant"`` (``ClairvoyantFit``: a yardstick that sees the simulation's
    future), ``"informed"`` (``InformedFit``: one that sees all of it but the latencies
    still to come), ``"foresight-critical"`` or ``"informed-critical"`` (``critical``'s
    ranking by the true durations and latencies, or by all that has happened:
    ``rrfp.sim.foresight``). ``launch_depth``: actions a device may hold launched but
    incomplete (``math.inf``: no bound); ``launch_cost``: CPU time of each launch, in the unit of
    ``duration``; ``reorder_ahead``: see ``StepLoop``. ``sizes``: each microbatch's size,
    which every rank is told before the step as ``ScheduleRRFP`` is (never the
    durations): the policies predict durations from them by what earlier steps measured,
    and after the step each rank's fits of its stages are shared with every rank.
    """
    sim = _Simulation(hint, duration, latency, launch_cost)
    names = policy if not isinstance(policy, str) else dict.fromkeys(range(hint.num_ranks), policy)
    previous = histories or {}
    # The caller's histories stay as they were: this step learns into copies.
    learned = {r: copy.deepcopy(previous[r]) if r in previous else History()
               for r in range(hint.num_ranks)}
    for history in learned.values():
        history.expect_sizes(sizes)
    loops = {
        r: StepLoop(
            Arbiter(hint, r, limits=limits, policy=_policy(names[r], sim, r, learned[r])),
            sim.devices[r], sim, sim.arrivals(r), sim.clock(r), launch_depth=launch_depth,
            reorder_ahead=reorder_ahead)
        for r in range(hint.num_ranks)
    }
    sim.run(loops)
    for r, loop in loops.items():
        loop.teach(learned[r])
    if sizes is not None:
        _share_fits(learned.values())
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
        rank_peaks={r: loop.arbiter.peak_held for r, loop in loops.items()},
        out_of_order={r: loop.arbiter.out_of_order for r, loop in loops.items()},
        most_behind={r: sim.devices[r].most_behind for r in loops},
        histories=learned,
    )


def _share_fits(histories: Iterable[History]) -> None:
    """Every rank's duration fits of its own stages, given to every rank (what the runtime
    exchanges between steps)."""
    histories = list(histories)
    fits = {key: fit for history in histories
            for key, fit in history.models.own_fits().items()}
    for history in histories:
        history.models.adopt(fits)


def _policy(name: str, sim: _Simulation, rank: int, history: History) -> Policy:
    if name == ClairvoyantFit.name:
        return ClairvoyantFit(sim.clock(rank), sim.duration, sim.earliest_arrival)
    if name == InformedFit.name:
        transit = median_transit(sim.latency_draws(), sim.clock(rank))
        return InformedFit(sim.clock(rank), sim.duration,
                           lambda message: sim.earliest_arrival(message, transit))
    if name in (FORESIGHT_CRITICAL, INFORMED_CRITICAL):
        return EstimatedCritical(name, sim.chains(name))
    return make_policy(name, history=history, clock=sim.clock(rank))


@dataclass(frozen=True)
class LowerBounds:
    critical_path: float
    """Longest dependency chain of any microbatch (unlimited ranks, no queueing)."""
    busiest_rank: float
    """Max over ranks of: earliest possible start + all its work + shortest possible tail."""
    memory_path: float | None = None
    """Longest chain once each stage's streams keep hint order and a stage at its memory
    limit must release before its next forward (None without limits)."""

    @property
    def tighter(self) -> float:
        return max(self.critical_path, self.busiest_rank, self.memory_path or 0.0)


def lower_bounds(hint: Hint, duration: Duration, latency: Latency | None = None,
                 limits: MemoryLimits | None = None) -> LowerBounds:
    """Makespan lower bounds for any schedule of ``hint``'s actions (with ``limits``: any
    that keeps each stage's streams in hint order within those memory limits, as RRFP and
    the fixed schedule do)."""
    head, tail = step_graph(hint, latency).longest_path(duration)
    critical = max(head[a] + duration(a) + tail[a] for a in head)
    memory_path = None
    if limits is not None:
        head, tail = step_graph(hint, latency, limits=limits,
                                stream_order=True).longest_path(duration)
        memory_path = max(head[a] + duration(a) + tail[a] for a in head)
    busiest = 0.0
    for acts in hint.orders.values():
        compute = [a for a in acts if a in head]
        busiest = max(busiest, min(head[a] for a in compute) + sum(map(duration, compute))
                      + min(tail[a] for a in compute))
    return LowerBounds(critical, busiest, memory_path)
